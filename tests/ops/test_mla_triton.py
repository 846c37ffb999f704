"""The Triton paged MLA decode (ops/mla/triton_decode.py) against the torch reference.

On CPU the kernels run in the Triton interpreter; on CUDA they are compiled and checked on the
Kimi-Linear shape. Caches are poisoned (NaN in every slot no sequence owns, NaN past each sequence's
end inside its last page) and block-table tails hold out-of-range ids, so a stray read shows up.
"""

from __future__ import annotations

import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from deltaserve.ops.mla import naive, paged_mla_decode_impl  # noqa: E402
from ops.triton_interpreter import (  # noqa: E402
    case_result,
    require_interpreted,
    run_interpreter_worker,
    save_case_results,
)

R, P, H = 32, 8, 4  # small kv_lora_rank, rope dim, heads for the interpreter
SCALE = 0.3


def make_case(
    gen: torch.Generator,
    seq_lens: list[int],
    block_size: int,
    *,
    heads: int = H,
    rank: int = R,
    rope: int = P,
    cache_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.long,
    spare_blocks: int = 3,
    device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Random q_latent [B, heads, rank], q_pe [B, heads, rope], poisoned kv_cache
    [num_blocks, block_size, rank + rope] with each sequence in shuffled blocks, block_tables
    [B, max_blocks] (garbage past the used blocks) and seq_lens [B]."""
    batch = len(seq_lens)
    pages = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(pages) + spare_blocks
    num_blocks = sum(pages) + 4
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    garbage = torch.randint(num_blocks, 2**30, (batch, max_blocks), generator=gen)
    garbage[:, 1::2] = -(garbage[:, 1::2] % 1000) - 1  # negative ids too
    tables, used = garbage.clone(), 0
    for b, (length, nb) in enumerate(zip(seq_lens, pages, strict=True)):
        blocks = perm[used : used + nb]
        used += nb
        tables[b, :nb] = blocks
        positions = torch.arange(length)
        slots = blocks[positions // block_size] * block_size + positions % block_size
        naive.write_latents(cache, slots, torch.randn(length, rank + rope, generator=gen))
    q_latent = torch.randn(batch, heads, rank, generator=gen).to(q_dtype)
    q_pe = torch.randn(batch, heads, rope, generator=gen).to(q_dtype)
    lens = torch.tensor(seq_lens, dtype=index_dtype)
    return tuple(t.to(device) for t in (q_latent, q_pe, cache, tables.to(index_dtype), lens))


def check_against_reference(case: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...], o_tol, lse_tol) -> None:
    q_latent, q_pe, cache, tables, lens = case
    rank = q_latent.shape[-1]
    ref_o, ref_lse = naive.paged_mla_decode(q_latent, q_pe, cache, tables, lens.long(), SCALE, rank)
    o, lse = out
    assert o.dtype == lse.dtype == torch.float32
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    empty = lens == 0
    assert torch.equal(o[empty], torch.zeros_like(o[empty])), "empty sequences must give o = 0"
    assert torch.isneginf(lse[empty]).all(), "empty sequences must give lse = -inf"
    torch.testing.assert_close(o, ref_o, atol=o_tol, rtol=o_tol, msg=lambda m: f"o_latent: {m}")
    torch.testing.assert_close(lse, ref_lse, atol=lse_tol, rtol=lse_tol, msg=lambda m: f"lse: {m}")


# ---- CPU: the kernels in the Triton interpreter, run in a subprocess (tests/ops/triton_interpreter.py) ----

# case id -> make_case arguments and launch options. Lengths cover 0, 1, a partial page, whole pages
# and several pages with a partial tail; 20 splits is more than any sequence has pages.
INTERPRETER_CASES: dict[str, dict] = {}
for _bs, _lens in [(4, [0, 1, 19]), (4, [3, 12, 33]), (16, [0, 7, 61]), (16, [1, 16, 40])]:
    for _splits in (1, 3, 20, None):
        INTERPRETER_CASES[f"bs{_bs}-{_lens}-splits{_splits}"] = {
            "block_size": _bs,
            "seq_lens": _lens,
            "num_kv_splits": _splits,
        }
INTERPRETER_CASES.update(
    {
        # 32-token tiles over 16-token pages; 20 heads = a full and a partial head group
        "tile32-heads20": {
            "block_size": 16,
            "seq_lens": [45, 0, 17],
            "num_kv_splits": 2,
            "heads": 20,
            "config": {"block_n": 32},
        },
        # bf16 cache with fp32 queries (the upcast path), 32-head groups, int32 tables and lengths
        "bf16cache-int32": {
            "block_size": 16,
            "seq_lens": [45, 0, 17],
            "num_kv_splits": 2,
            "cache_dtype": torch.bfloat16,
            "index_dtype": torch.int32,
            "config": {"block_h": 32},
        },
        "all-empty": {"block_size": 4, "seq_lens": [0, 0], "num_kv_splits": 4},
        # bf16 cache and queries: the serving path (bf16 dots, softmax weights rounded to bf16)
        "bf16-bs16": {
            "block_size": 16,
            "seq_lens": [0, 7, 61],
            "num_kv_splits": 3,
            "cache_dtype": torch.bfloat16,
            "q_dtype": torch.bfloat16,
        },
        "bf16-bs4": {
            "block_size": 4,
            "seq_lens": [3, 12, 33],
            "num_kv_splits": None,
            "cache_dtype": torch.bfloat16,
            "q_dtype": torch.bfloat16,
        },
        # several 32-token tiles in one split: the running-max rescale of the bf16 path
        "bf16-one-split": {
            "block_size": 16,
            "seq_lens": [100, 1, 70],
            "num_kv_splits": 1,
            "cache_dtype": torch.bfloat16,
            "q_dtype": torch.bfloat16,
        },
    }
)


def _patch_interpreter() -> None:
    """Work around two Triton 3.6 interpreter bugs, in the worker process only.

    - Scalars become Python ints through int(array of shape (1,)), which numpy >= 2.4 refuses
      (triton-lang/triton#9171): loop bounds from loaded values fail.
    - tl.dot on bfloat16 multiplies the raw uint16 bit patterns. The fix upcasts bf16 operands to
      float32 first, which is what tensor cores compute (exact products, fp32 sums).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is not None:

        def patched_tensor(tensor, scope) -> None:
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patched_tensor

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def as_fp32(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = patched_dot


def _interpreter_worker(out_path: str) -> None:
    """Run every INTERPRETER_CASES entry through the interpreted kernels; torch.save the results."""
    from deltaserve.ops.mla import triton_decode

    require_interpreted(triton_decode._split_kernel)
    _patch_interpreter()

    def run_case(case_id: str) -> dict:
        spec = dict(INTERPRETER_CASES[case_id])
        seed = sum(map(ord, case_id))
        config = triton_decode.DecodeConfig(**spec.pop("config", {}))
        num_kv_splits = spec.pop("num_kv_splits")
        case = make_case(torch.Generator().manual_seed(seed), spec.pop("seq_lens"), spec.pop("block_size"), **spec)
        out = triton_decode.paged_mla_decode(*case, SCALE, R, num_kv_splits=num_kv_splits, config=config)
        return {"case": case, "out": out}

    save_case_results(out_path, INTERPRETER_CASES, run_case)


@pytest.fixture(scope="module")
def interpreter_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_interpreter_worker(__file__, tmp_path_factory.mktemp("mla_triton"))


@pytest.mark.parametrize("case_id", list(INTERPRETER_CASES))
def test_interpreted_matches_reference(interpreter_results: dict, case_id: str) -> None:
    result = case_result(interpreter_results, case_id)
    spec = INTERPRETER_CASES[case_id]
    # bf16 x bf16 rounds the softmax weights to bf16 (2^-9 relative) before the value dot; scores stay exact
    bf16 = spec.get("q_dtype") == torch.bfloat16
    check_against_reference(result["case"], result["out"], 2e-2 if bf16 else 1e-4, 1e-4)


def test_host_side_validation() -> None:
    from deltaserve.ops.mla import triton_decode

    q_latent, q_pe, cache, tables, lens = make_case(torch.Generator().manual_seed(7), [5], 4)
    # an empty batch returns before any launch
    o, lse = triton_decode.paged_mla_decode(q_latent[:0], q_pe[:0], cache, tables[:0], lens[:0], SCALE, R)
    assert o.shape == (0, H, R) and lse.shape == (0, H)
    with pytest.raises(ValueError, match="kv_lora_rank=16"):
        triton_decode.paged_mla_decode(q_latent, q_pe, cache, tables, lens, SCALE, 16)
    with pytest.raises(ValueError, match="max_seq_len=1000"):
        triton_decode.paged_mla_decode(q_latent, q_pe, cache, tables, lens, SCALE, R, max_seq_len=1000)
    with pytest.raises(ValueError, match="num_kv_splits=0"):
        triton_decode.paged_mla_decode(q_latent, q_pe, cache, tables, lens, SCALE, R, num_kv_splits=0)
    with pytest.raises(ValueError, match="block_n=24"):
        triton_decode.DecodeConfig(block_n=24)


def test_split_heuristic() -> None:
    from deltaserve.ops.mla import triton_decode

    choose = triton_decode.choose_num_kv_splits
    assert choose(1, 2, 32768, 132) == triton_decode.MAX_KV_SPLITS  # one long sequence: as many as allowed
    assert choose(16, 2, 4096, 132) == 9  # 16 * 2 * 9 = 288 programs >= 2 per SM
    assert choose(256, 2, 4096, 132) == 1  # the batch alone fills the GPU
    assert choose(1, 2, 300, 132) == 2  # short context: splits of at least MIN_TOKENS_PER_SPLIT
    assert choose(4, 2, 0, 132) == 1


def test_dispatch_by_device() -> None:
    assert paged_mla_decode_impl(torch.device("cpu")) is naive.paged_mla_decode
    if torch.cuda.is_available():
        from deltaserve.ops.mla import triton_decode

        assert paged_mla_decode_impl(torch.device("cuda")) is triton_decode.paged_mla_decode


# ---- CUDA: the compiled kernels on the Kimi-Linear shape (32 heads, R = 512, P = 64) ----

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KIMI = {"heads": 32, "rank": 512, "rope": 64}
KIMI_SCALE = 192**-0.5


@cuda
@pytest.mark.parametrize(
    ("block_size", "seq_lens"),
    [
        (16, [1]),
        (16, [16384]),
        (16, [0, 1, 17, 300, 4096, 5000, 16000]),
        (64, [4097] * 3 + [0, 63, 64, 65] + [2000] * 57),  # B = 64
        (32, [1000, 12345]),
    ],
)
@pytest.mark.parametrize("num_kv_splits", [None, 1, 7])
def test_cuda_bf16_matches_reference(block_size, seq_lens, num_kv_splits) -> None:
    from deltaserve.ops.mla import triton_decode

    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + block_size)
    case = make_case(
        gen, seq_lens, block_size, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, device="cuda", **KIMI
    )
    out = triton_decode.paged_mla_decode(*case, KIMI_SCALE, 512, num_kv_splits=num_kv_splits)
    q_latent, q_pe, cache, tables, lens = case
    ref_o, ref_lse = naive.paged_mla_decode(q_latent, q_pe, cache, tables, lens, KIMI_SCALE, 512)
    # bf16 softmax weights in the value dot: o off by up to ~2^-9 * max|c|; scores are exact fp32 sums
    torch.testing.assert_close(out[0], ref_o, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out[1], ref_lse, atol=1e-3, rtol=1e-4)


def check_against_reference_cuda(case, out) -> None:
    q_latent, q_pe, cache, tables, lens = case
    ref_o, ref_lse = naive.paged_mla_decode(q_latent, q_pe, cache, tables, lens.long(), KIMI_SCALE, 512)
    torch.testing.assert_close(out[0], ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref_lse, atol=1e-4, rtol=1e-4)


@cuda
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_cuda_fp32_cache_matches_reference(q_dtype) -> None:
    from deltaserve.ops.mla import triton_decode

    gen = torch.Generator().manual_seed(3)
    case = make_case(
        gen,
        [0, 5, 700, 3001],
        16,
        cache_dtype=torch.float32,
        q_dtype=q_dtype,
        index_dtype=torch.int32,
        device="cuda",
        **KIMI,
    )
    out = triton_decode.paged_mla_decode(*case, KIMI_SCALE, 512)
    check_against_reference_cuda(case, out)


@cuda
def test_cuda_graph_replay_with_new_lengths() -> None:
    """Captured with fixed num_kv_splits; a replay serves other seq_lens (within each one's blocks)."""
    from deltaserve.ops.mla import triton_decode

    gen = torch.Generator().manual_seed(11)
    case = make_case(
        gen, [900, 33, 2048, 1], 16, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16, device="cuda", **KIMI
    )
    q_latent, q_pe, cache, tables, lens = case

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return triton_decode.paged_mla_decode(q_latent, q_pe, cache, tables, lens, KIMI_SCALE, 512, num_kv_splits=8)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = run()
    # 912 fills sequence 0's 57th block; sequence 1 becomes empty; 1500 of sequence 2's 2048
    lens.copy_(torch.tensor([912, 0, 1500, 1], device="cuda"))
    for pos in range(900, 912):  # make_case left unused slots as NaN: these are in use now
        cache[tables[0, pos // 16], pos % 16] = torch.randn(cache.shape[-1], generator=gen).to(cache)
    q_latent.copy_(torch.randn(q_latent.shape, generator=gen).to(q_latent))
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_lse = naive.paged_mla_decode(q_latent, q_pe, cache, tables, lens, KIMI_SCALE, 512)
    torch.testing.assert_close(o, ref_o, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)


if __name__ == "__main__":
    _interpreter_worker(sys.argv[1])
