"""plan_cache's refusal of a budget below one max_model_len sequence names the largest max_model_len
that fits, computed with the same formula it refuses by."""

from __future__ import annotations

import re

import pytest

from deltaserve.core.cache_sizing import default_unit_bytes, plan_cache
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec

KV = MLALatentSpec(block_size=4, num_layers=2, latent_dim=10, dtype_bytes=2)
STATE = KDAStateSpec(
    num_layers=3, num_heads=2, head_k_dim=4, head_v_dim=4, conv_dim=24, conv_window=3, conv_dtype_bytes=2
)
FITS = re.compile(r"--max-model-len.*the largest max_model_len that fits is (\d+)$")


def _suggested(cache_bytes: int, max_model_len: int, **options) -> int:
    with pytest.raises(ValueError, match=f"max_model_len={max_model_len} tokens") as refused:
        plan_cache(cache_bytes, KV, STATE, max_num_seqs=4, max_model_len=max_model_len, **options)
    match = FITS.search(str(refused.value))
    assert match is not None, str(refused.value)
    return int(match.group(1))


@pytest.mark.parametrize("slots_per_seq, checkpoint_fraction", [(1, 0.0), (2, 0.1)])
@pytest.mark.parametrize("spare_bytes", [0, 1, KV.bytes_per_block - 1])
def test_the_suggested_max_model_len_fits_and_one_block_more_does_not(slots_per_seq, checkpoint_fraction,
                                                                      spare_bytes):
    options = dict(slots_per_seq=slots_per_seq, checkpoint_fraction=checkpoint_fraction)
    unit = default_unit_bytes(STATE.bytes_per_image)
    one_checkpoint = -(-STATE.bytes_per_image // unit) * unit if checkpoint_fraction else 0  # prefix caching's minimum
    cache_bytes = slots_per_seq * STATE.bytes_per_image + one_checkpoint + 7 * KV.bytes_per_block + spare_bytes
    fits = _suggested(cache_bytes, 1 << 20, **options)
    assert fits == 7 * KV.block_size  # whole blocks: the spare bytes buy no partial block
    plan = plan_cache(cache_bytes, KV, STATE, max_num_seqs=4, max_model_len=fits, **options)
    assert plan.num_blocks >= KV.blocks_for(fits) and plan.total_bytes <= cache_bytes
    assert plan.num_checkpoint_units * plan.checkpoint_unit_bytes >= one_checkpoint
    assert _suggested(cache_bytes, fits + 1, **options) == fits
    assert _suggested(cache_bytes, fits + KV.block_size, **options) == fits


def test_a_budget_below_one_block_says_no_max_model_len_helps():
    cache_bytes = STATE.bytes_per_image + KV.bytes_per_block - 1
    with pytest.raises(ValueError, match="not even one KV block of 4 tokens fits") as refused:
        plan_cache(cache_bytes, KV, STATE, max_num_seqs=1, max_model_len=64)
    assert "largest max_model_len" not in str(refused.value) and "--cache-memory" in str(refused.value)
    with pytest.raises(ValueError, match="not even one KV block"):
        plan_cache(STATE.bytes_per_image // 2, KV, STATE, max_num_seqs=1, max_model_len=64)


def test_a_million_token_checkpoint_on_the_cpu_default_cache():
    """`--model random:small` (max_position_embeddings 1,048,576, no --max-model-len) on CPU: the
    engine refuses with the value to pass, and starts with it (one more token is refused: the plan tests)."""
    from deltaserve import LLM

    with pytest.raises(ValueError, match="max_model_len=1048576 tokens") as refused:
        LLM(model="random:small", device="cpu", dtype="float32")
    match = FITS.search(str(refused.value))
    assert match is not None, str(refused.value)
    fits = int(match.group(1))
    assert LLM(model="random:small", device="cpu", dtype="float32", max_model_len=fits).llm_engine.max_model_len == fits
