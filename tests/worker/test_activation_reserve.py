"""The cache budget leaves room for MLA prefill's expanded K/V: a chunk after up to EXPANSION_GROUP_TOKENS
of cached context expands that context and its own tokens at once (a longer context goes in pieces of that
size), so the reserve grows with the step's tokens and shrinks with tensor parallelism."""

from __future__ import annotations

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.model.layers import mla
from deltaserve.model_files.presets import preset_config
from deltaserve.worker.worker import Worker


def reserve(tp: int, tokens: int) -> tuple[int, int]:
    config = EngineConfig(model="random:kimi-linear-48b-a3b", device="cpu", dtype="bfloat16",
                          max_num_batched_tokens=tokens)
    worker = Worker(config, preset_config("kimi-linear-48b-a3b"), "random:kimi-linear-48b-a3b",
                    parallel=ParallelConfig(tensor_parallel_size=tp))
    return worker.activation_reserve_bytes(), worker._activation_bytes_per_token()


def test_reserve_holds_the_largest_mla_expansion():
    cfg = preset_config("kimi-linear-48b-a3b")
    total, per_token = reserve(tp=1, tokens=8192)
    heads = cfg.num_attention_heads
    expansion_token = cfg.latent_dim + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim + 2 * cfg.qk_head_dim)
    assert total == 8192 * per_token + (mla.EXPANSION_GROUP_TOKENS + 8192) * expansion_token * 2
    assert (mla.EXPANSION_GROUP_TOKENS + 8192) * expansion_token * 2 > 1.5 * 2**30  # the 48B at TP 1: 1.6 GiB
    tp8, _ = reserve(tp=8, tokens=8192)
    assert tp8 < total
    assert reserve(tp=1, tokens=16384)[0] > total
