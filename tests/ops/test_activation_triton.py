"""The Triton SwiGLU activation (ops/activation/triton_silu_mul.py) against the torch reference
(`naive.silu_and_mul`), on random fused [gate | up] rows.

On CPU the kernel runs in the Triton interpreter, in a fresh process (tests/ops/triton_interpreter.py); on
CUDA it is compiled. Widths include one that is not a multiple of the column block, a 3-d input and an
empty one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from deltaserve.ops.activation import naive, silu_and_mul  # noqa: E402
from ops.triton_interpreter import (  # noqa: E402
    case_result,
    require_interpreted,
    run_interpreter_worker,
    save_case_results,
)

# case id -> (shape of gate_up, dtype, column block)
CASES = {
    "f32": ((7, 96), torch.float32, 16),
    "f32-ragged-block": ((5, 2 * 40), torch.float32, 16),
    "bf16": ((6, 64), torch.bfloat16, 32),
    "bf16-3d": ((2, 3, 48), torch.bfloat16, 1024),
    "empty": ((0, 32), torch.float32, 16),
}


def make_input(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return (4 * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def check(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    ref = naive.silu_and_mul(gate_up)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # bf16: the interpreter truncates where the GPU and torch round; float32: one exp apart at most
    tol = {"atol": 3e-2, "rtol": 3e-2} if gate_up.dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)


def _interpreter_worker(out_path: str) -> None:
    from deltaserve.ops.activation import triton_silu_mul

    require_interpreted(triton_silu_mul._silu_and_mul_kernel)

    def run_case(case_id: str) -> dict:
        shape, dtype, block = CASES[case_id]
        gate_up = make_input(shape, dtype, torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
        return {"gate_up": gate_up, "out": triton_silu_mul.silu_and_mul(gate_up, block=block)}

    save_case_results(out_path, CASES, run_case)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_interpreter_worker(__file__, tmp_path_factory.mktemp("silu_mul_triton"))


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_matches_reference(interpreter_results: dict, case_id: str) -> None:
    result = case_result(interpreter_results, case_id)
    check(result["gate_up"], result["out"])


def test_reference_is_silu_times_up_and_the_api_uses_it_off_cuda() -> None:
    gate_up = make_input((4, 10), torch.float32, torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(naive.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=0, atol=0)
    torch.testing.assert_close(silu_and_mul(gate_up), naive.silu_and_mul(gate_up), rtol=0, atol=0)


def test_an_odd_width_is_refused() -> None:
    from deltaserve.ops.activation import triton_silu_mul

    with pytest.raises(ValueError, match="even last dim"):
        triton_silu_mul.silu_and_mul(torch.zeros(2, 5))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    from deltaserve.ops.activation import triton_silu_mul

    gate_up = make_input((3000, 2 * 1024), dtype, torch.Generator().manual_seed(0), device="cuda")
    out = triton_silu_mul.silu_and_mul(gate_up)
    ref = naive.silu_and_mul(gate_up)
    # the same two roundings; SiLU's exp may differ in float32's last bits, so a bf16 ulp at most
    tol = {"atol": 1.6e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    strided = torch.cat([gate_up, gate_up], dim=-1)[:, : 2 * 1024]  # rows with a stride past their width
    torch.testing.assert_close(triton_silu_mul.silu_and_mul(strided), ref, **tol)


if __name__ == "__main__":
    _interpreter_worker(sys.argv[1])
