"""The Triton combine of the routed experts (ops/moe/triton_combine.py) against the torch reference
(`grouped.combine_pairs`): random expert-sorted rows, a random permutation, float32 routing weights.

On CPU the kernel runs in the Triton interpreter, in a fresh process (tests/ops/triton_interpreter.py); on
CUDA it is compiled. Hidden sizes include one that is not a multiple of the column block.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from deltaserve.ops.moe.grouped import combine_pairs  # noqa: E402
from ops.triton_interpreter import (  # noqa: E402
    case_result,
    require_interpreted,
    run_interpreter_worker,
    save_case_results,
)

# case id -> (tokens, top_k, hidden, dtype, column block)
CASES = {
    "f32-k2": (5, 2, 48, torch.float32, 16),
    "f32-k9-one-block": (3, 9, 32, torch.float32, 32),
    "bf16-k3": (4, 3, 40, torch.bfloat16, 16),
    "empty": (0, 2, 16, torch.float32, 16),
}


def make_inputs(tokens: int, top_k: int, hidden: int, dtype: torch.dtype, gen: torch.Generator,
                device: str = "cpu") -> dict:
    y_sorted = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    order = torch.randperm(tokens * top_k, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return {name: t.to(device) for name, t in (("y_sorted", y_sorted), ("order", order), ("weights", weights))}


def check(inputs: dict, out: torch.Tensor, dtype: torch.dtype) -> None:
    ref = combine_pairs(inputs["y_sorted"], inputs["order"], inputs["weights"])
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # bf16: the interpreter truncates where the GPU and torch round; float32: the same products, summed in order
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)


def _interpreter_worker(out_path: str) -> None:
    from deltaserve.ops.moe import triton_combine

    require_interpreted(triton_combine._combine_kernel)

    def run_case(case_id: str) -> dict:
        tokens, top_k, hidden, dtype, block = CASES[case_id]
        inputs = make_inputs(tokens, top_k, hidden, dtype,
                             torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
        out = triton_combine.combine_pairs(inputs["y_sorted"], inputs["order"], inputs["weights"], block_h=block)
        return {"inputs": inputs, "out": out}

    save_case_results(out_path, CASES, run_case)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_interpreter_worker(__file__, tmp_path_factory.mktemp("moe_combine_triton"))


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_matches_reference(interpreter_results: dict, case_id: str) -> None:
    result = case_result(interpreter_results, case_id)
    check(result["inputs"], result["out"], CASES[case_id][3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_combine_matches_reference(dtype: torch.dtype) -> None:
    from deltaserve.ops.moe import triton_combine

    inputs = make_inputs(300, 9, 2304, dtype, torch.Generator().manual_seed(0), device="cuda")
    out = triton_combine.combine_pairs(inputs["y_sorted"], inputs["order"], inputs["weights"])
    ref = combine_pairs(inputs["y_sorted"], inputs["order"], inputs["weights"])
    # the same roundings of the products; the float32 sums may add in another order: a bf16 ulp at most
    tol = {"atol": 1.6e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)


if __name__ == "__main__":
    _interpreter_worker(sys.argv[1])
