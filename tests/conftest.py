"""Test-wide setup.

transformers routes Kimi Linear's KDA through fla's Triton kernels whenever `fla` imports, and those
crash on CPU. Without CUDA, block the import so transformers (our test oracle) takes its PyTorch path.
"""

import sys

import torch

if not torch.cuda.is_available():
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
