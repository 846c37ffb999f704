"""P/D disaggregation with the caches in CUDA memory, registered with NIXL (VRAM), both engines on one
GPU in this process; and the MLA staging pool's gather streams. Skipped without CUDA or NIXL.

Greedy tokens equal a colocated engine's on the same GPU (float32, logprobs within 1e-4), through the
per-request path and chunked transfer; the staging slots land the same bytes as the caches' rows,
each slot on its own stream of the configured priority.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM
from deltaserve.kv_transfer import available_backends
from deltaserve.kv_transfer.staging import StagingPool, stripe_positions
from kv_transfer.test_pd_engine import LOGPROB_TOL, PROMPTS, _greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
COMMON = dict(dtype="float32", device="cuda", enable_prefix_caching=True, max_num_batched_tokens=48,
              cache_memory="256MiB", enforce_eager=True)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**COMMON)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("chunked", [False, True], ids=["per_request", "chunked"])
def test_cuda_caches_move_over_nixl_vram(reference, chunked):
    if "nixl" not in available_backends():
        pytest.skip("NIXL is not installed")
    producer = LLM(**COMMON, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                                 "chunked_transfer": chunked})
    consumer = LLM(**COMMON, kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_consumer",
                                                 "kv_load_failure_policy": "fail"})
    try:
        ids = [reference.generate([p], _greedy(1), use_tqdm=False)[0].prompt_token_ids for p in PROMPTS]
        want = reference.generate([{"prompt_token_ids": i} for i in ids], _greedy(10), use_tqdm=False)
        for prompt_ids, w in zip(ids, want, strict=True):
            prefilled = producer.generate([{"prompt_token_ids": prompt_ids}],
                                          _greedy(1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)[0]
            params = prefilled.kv_transfer_params
            got = consumer.generate([{"prompt_token_ids": prompt_ids}], _greedy(10, kv_transfer_params=params),
                                    use_tqdm=False)[0]
            assert got.outputs[0].token_ids == w.outputs[0].token_ids
            for a, b in zip(got.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
                (token, la), = ((t, lp.logprob) for t, lp in a.items() if t in b)
                assert abs(la - b[token].logprob) <= LOGPROB_TOL
        assert consumer.llm_engine.core._num_computed_tokens == len(PROMPTS) * 9  # nothing recomputed
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


@pytest.mark.parametrize("priority", [-1, 0])
def test_cuda_staging_streams_gather_the_stripe(priority):
    torch.manual_seed(0)
    block_size, latent = 16, 8
    caches = {3: torch.randn(10, block_size, latent, device="cuda"), 7: torch.randn(10, block_size, latent,
                                                                                    device="cuda")}
    pool = StagingPool(caches, chunk_pages=2, slots=3, block_size=block_size, stream_priority=priority)
    assert pool.streams is not None and len(pool.streams) == 3
    assert {s.priority for s in pool.streams} == {priority}
    block_ids = [4, 0, 9, 2]
    slot = pool.stage(block_ids, 60, 3, 20, dcp_size=2, dcp_rank=1, interleave=1, hold_s=60)
    positions = stripe_positions(3, 20, 2, 1, 1)
    for layer, cache in caches.items():
        want = torch.stack([cache[block_ids[p // block_size], p % block_size] for p in positions])
        assert torch.equal(pool.slots[layer][slot, :20], want)
    pool.unstage(slot)
    assert pool.num_free == 3
