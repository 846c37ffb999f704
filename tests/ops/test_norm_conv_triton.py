"""The Triton norms (ops/norm/triton_norm.py) and conv decode (ops/conv/triton_conv.py) against the
torch references.

On CPU the kernels run in the Triton interpreter, in a fresh process (tests/ops/triton_interpreter.py);
on CUDA they are compiled. Inputs
are fresh random values; conv pools hold NaN in every slot no sequence owns, which must stay untouched.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from deltaserve.ops.conv import naive as conv_naive  # noqa: E402
from deltaserve.ops.norm import naive as norm_naive  # noqa: E402
from ops.triton_interpreter import (  # noqa: E402
    case_result,
    require_interpreted,
    run_interpreter_worker,
    save_case_results,
)

# case id -> (kind, arguments). D values include non-powers of two; "strided" feeds a column slice.
CASES: dict[str, tuple[str, dict]] = {
    "norm-f32-D64": ("norm", {"rows": 5, "D": 64, "dtype": torch.float32, "residual": False}),
    "norm-f32-D48-residual": ("norm", {"rows": 7, "D": 48, "dtype": torch.float32, "residual": True}),
    "norm-bf16-D96-residual": ("norm", {"rows": 3, "D": 96, "dtype": torch.bfloat16, "residual": True}),
    "norm-f32-strided": ("norm", {"rows": 4, "D": 32, "dtype": torch.float32, "residual": True, "strided": True}),
    "norm-empty": ("norm", {"rows": 0, "D": 32, "dtype": torch.float32, "residual": True}),
    "gated-f32": ("gated", {"rows": 6, "heads": 3, "D": 32, "dtype": torch.float32}),
    "gated-bf16-D40": ("gated", {"rows": 2, "heads": 2, "D": 40, "dtype": torch.bfloat16}),
    "conv-f32-W4": ("conv", {"B": 3, "D": 40, "W": 4, "dtype": torch.float32, "block_d": 16}),
    "conv-bf16-W4-int32": ("conv", {"B": 2, "D": 64, "W": 4, "dtype": torch.bfloat16, "block_d": 32,
                                    "index_dtype": torch.int32}),
    "conv-f32-W2-noact": ("conv", {"B": 2, "D": 24, "W": 2, "dtype": torch.float32, "block_d": 16,
                                   "activation": None}),
}


def make_inputs(kind: str, spec: dict, gen: torch.Generator, device: str = "cpu") -> dict:
    dtype = spec["dtype"]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    if kind == "norm":
        width = spec["D"] * (2 if spec.get("strided") else 1)
        x = randn(spec["rows"], width)[:, : spec["D"]]
        residual = randn(spec["rows"], spec["D"]) if spec["residual"] else None
        return {"x": x, "weight": randn(spec["D"]) + 1, "eps": 1e-5, "residual": residual}
    if kind == "gated":
        shape = (spec["rows"], spec["heads"], spec["D"])
        return {"x": randn(*shape), "gate": randn(*shape), "weight": randn(spec["D"]), "eps": 1e-5}
    B, D, W = spec["B"], spec["D"], spec["W"]
    num_slots = B + 3
    pool = torch.full((num_slots, D, W - 1), float("nan"), dtype=dtype)
    slots = torch.randperm(num_slots, generator=gen)[:B]
    pool[slots] = torch.randn(B, D, W - 1, generator=gen).to(dtype)
    return {
        "x": randn(B, D),
        "weight": randn(D, W),
        "conv_state_pool": pool.to(device),
        "state_slots": slots.to(spec.get("index_dtype", torch.long)).to(device),
        "activation": spec.get("activation", "silu"),
    }


def run_kernel(kind: str, spec: dict, inputs: dict):
    from deltaserve.ops.conv import triton_conv
    from deltaserve.ops.norm import triton_norm

    if kind == "norm":
        return triton_norm.add_rms_norm(inputs["x"], inputs["weight"], inputs["eps"], inputs["residual"])
    if kind == "gated":
        return triton_norm.gated_rms_norm(inputs["x"], inputs["gate"], inputs["weight"], inputs["eps"])
    pool = inputs["conv_state_pool"].clone()
    y = triton_conv.causal_conv1d_decode(inputs["x"], inputs["weight"], pool, inputs["state_slots"],
                                         inputs["activation"], block_d=spec["block_d"])
    return y, pool


def check(kind: str, spec: dict, inputs: dict, out) -> None:
    bf16 = spec["dtype"] == torch.bfloat16
    tol = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 1e-5, "rtol": 1e-5}
    if kind == "norm":
        ref = norm_naive.add_rms_norm(inputs["x"], inputs["weight"], inputs["eps"], inputs["residual"])
        if inputs["residual"] is None:
            torch.testing.assert_close(out, ref, **tol)
        else:
            torch.testing.assert_close(out[0], ref[0], **tol)
            # the sum is one rounding, as in torch (the interpreter truncates to bf16 instead of rounding)
            exact = not bf16 or out[1].is_cuda
            torch.testing.assert_close(out[1], ref[1], **({"atol": 0, "rtol": 0} if exact else tol))
        return
    if kind == "gated":
        ref = norm_naive.gated_rms_norm(inputs["x"], inputs["gate"], inputs["weight"], inputs["eps"])
        torch.testing.assert_close(out, ref, **tol)
        return
    pool_ref = inputs["conv_state_pool"].clone()
    y_ref = conv_naive.causal_conv1d_decode(inputs["x"], inputs["weight"], pool_ref, inputs["state_slots"],
                                            inputs["activation"])
    y, pool = out
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(pool, pool_ref, atol=0, rtol=0, equal_nan=True)  # windows are copies


def _interpreter_worker(out_path: str) -> None:
    from deltaserve.ops.norm import triton_norm

    require_interpreted(triton_norm._add_rms_norm_kernel)

    def run_case(case_id: str) -> dict:
        kind, spec = CASES[case_id]
        inputs = make_inputs(kind, spec, torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
        return {"inputs": inputs, "out": run_kernel(kind, spec, inputs)}

    save_case_results(out_path, CASES, run_case)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_interpreter_worker(__file__, tmp_path_factory.mktemp("norm_conv_triton"))


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_matches_reference(interpreter_results: dict, case_id: str) -> None:
    result = case_result(interpreter_results, case_id)
    kind, spec = CASES[case_id]
    check(kind, spec, result["inputs"], result["out"])


def test_dispatch_by_device() -> None:
    from deltaserve.ops import conv, norm

    x, w = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-5), norm_naive.rms_norm(x, w, 1e-5))
    assert conv._decode_impl("cpu") is conv_naive.causal_conv1d_decode


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("norm", {"rows": 300, "D": 2304, "dtype": torch.bfloat16, "residual": True}),
        ("norm", {"rows": 17, "D": 2304, "dtype": torch.float32, "residual": False}),
        ("gated", {"rows": 64, "heads": 32, "D": 128, "dtype": torch.bfloat16}),
        ("conv", {"B": 64, "D": 12288, "W": 4, "dtype": torch.bfloat16, "block_d": 256}),
        ("conv", {"B": 5, "D": 1000, "W": 4, "dtype": torch.float32, "block_d": 256}),
    ],
)
def test_cuda_matches_reference(kind: str, spec: dict) -> None:
    inputs = make_inputs(kind, spec, torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()))), "cuda")
    check(kind, spec, inputs, run_kernel(kind, spec, inputs))


if __name__ == "__main__":
    _interpreter_worker(sys.argv[1])
