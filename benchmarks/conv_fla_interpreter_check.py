"""fla's conv prefill kernel, through `ops/conv/fla_prefill.py`, against the torch reference on CPU in the
Triton interpreter: the window mapping (fla's W columns, the pool's W - 1), sequences shorter than the
window continuing from a pooled one, fresh sequences whose slots hold NaN, strided input rows, untouched
slots. fla-core stays out of the CPU test environment (transformers would run its kernels on CPU tensors),
so this is a check to run by hand, not a test:

    pip install --no-deps --target /tmp/flasite .whl/fla_core-0.6.0-py3-none-any.whl einops
    TRITON_INTERPRET=1 PYTHONPATH=/tmp/flasite:$PWD python benchmarks/conv_fla_interpreter_check.py

The interpreter cannot benchmark, so every autotuned kernel runs its first config. Exit status 1 on a
mismatch.
"""

from __future__ import annotations

import sys

import torch
import triton.runtime.autotuner as autotuner

_run = autotuner.Autotuner.run


def _first_config_only(self, *args, **kwargs):  # noqa: ANN001, ANN202  (Autotuner.run's signature)
    self.configs = self.configs[:1]
    return _run(self, *args, **kwargs)


autotuner.Autotuner.run = _first_config_only

from deltaserve.ops.conv import naive  # noqa: E402
from deltaserve.ops.conv.fla_prefill import causal_conv1d_prefill_fla  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    dim, width = 64, 4
    lens = [1, 2, 3, 70, 130, 5]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = torch.randn(cu[-1].item(), dim + 40)[:, 8 : 8 + dim]  # strided rows, as the fused projection's
    weight = torch.randn(dim, width)
    pool = torch.randn(9, dim, width - 1)
    slots = torch.tensor([7, 1, 4, 2, 8, 5])
    has_initial = torch.tensor([True, False, True, False, True, True])
    pool[slots[~has_initial]] = float("nan")  # must never be read
    outs, pools = {}, {}
    for name, fn in (("torch", naive.causal_conv1d_prefill), ("fla", causal_conv1d_prefill_fla)):
        p = pool.clone()
        extra = {"cu_seqlens_cpu": cu} if name == "fla" else {}
        outs[name] = fn(x, weight, cu, p, slots, has_initial, "silu", **extra)
        pools[name] = p
    out_diff = (outs["fla"] - outs["torch"]).abs().max().item()
    window_diff = (pools["fla"][slots] - pools["torch"][slots]).abs().max().item()
    untouched = torch.equal(pools["fla"][[0, 3, 6]], pool[[0, 3, 6]])
    print(f"outputs max |diff| {out_diff:.2e}, windows max |diff| {window_diff:.2e}, untouched slots kept: {untouched}")
    return 0 if out_diff < 1e-5 and window_diff == 0 and untouched else 1


if __name__ == "__main__":
    sys.exit(main())
