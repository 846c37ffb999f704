"""Test-wide setup.

transformers routes Kimi Linear's KDA through fla's Triton kernels whenever `fla` imports, and those
crash on CPU. Without CUDA, block the import so transformers (our test oracle) takes its PyTorch path.

With CUDA, fla reads the shipped configs in fuzzy mode (before anything imports fla): the tests' small
shapes take the shipped config of the same dtypes instead of autotuning, which took minutes per test on
an H100 (tests/ops/test_kda_fla.py and the bf16 parity tests ran out of time autotuning). Shapes with no
entry of their dtypes (float32) still autotune. FLA_CONFIG_DIR or FLA_CACHE_MODE set by hand win.
"""

import sys

import torch

if not torch.cuda.is_available():
    sys.modules["fla"] = None  # makes `import fla` raise ImportError
else:
    from deltaserve.ops.kda.fla_tuning import use_shipped_configs

    use_shipped_configs(mode="fuzzy")
