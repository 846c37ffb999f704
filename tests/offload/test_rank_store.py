"""The rank side of the offload tier: payload packing, the producer fence (and the race it closes),
bounded asynchronous saves, all-or-nothing loads, PP key isolation, shutdown."""

import threading
from types import SimpleNamespace

import pytest
import torch

from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.offload.fence import Fence
from deltaserve.offload.objects import encode, key_namespace, object_key, worker_id
from deltaserve.offload.rank_caches import (
    RankCaches,
    kv_chunk_payload_bytes,
    state_image_payload_bytes,
    stored_object_bytes,
)
from deltaserve.offload.rank_store import RankOffloader
from deltaserve.offload.tiered_store import TieredStore
from deltaserve.offload.tiers import HostTier
from deltaserve.worker.state_store import StateCheckpointStore

BLOCK_SIZE, LATENT_DIM, NUM_BLOCKS = 4, 8, 8
CONV_DIM, CONV_WINDOW, HEADS, HEAD_DIM, NUM_SLOTS = 5, 3, 2, 4, 5  # 30-byte conv rows: fp32 rows start unaligned
UNIT_BYTES, NUM_UNITS = 128, 12  # an image (316 bytes) takes 3 units
NAMESPACE = key_namespace("tiny-kimi", "mla+kda", "bfloat16")
WAIT_S = 10.0  # a bound on waits that only a broken implementation reaches


def make_caches(seed: int = 0, device: str = "cpu", mla_ids=(0, 2), kda_ids=(1, 3)) -> RankCaches:
    """Random caches (never zeros) of two MLA layers and two KDA layers, given out of id order."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    mla = {i: rand(NUM_BLOCKS, BLOCK_SIZE, LATENT_DIM) for i in reversed(mla_ids)}
    kda = {i: (rand(NUM_SLOTS, CONV_DIM, CONV_WINDOW), rand(NUM_SLOTS, HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float32))
           for i in reversed(kda_ids)}
    units = torch.randint(0, 256, (NUM_UNITS, UNIT_BYTES), generator=g, dtype=torch.uint8).to(device)
    return RankCaches(mla, kda, units)


def snapshot(caches: RankCaches) -> list[torch.Tensor]:
    tensors = list(caches.mla.values()) + [t for pair in caches.kda.values() for t in pair]
    return [t.clone() for t in tensors] + [caches.checkpoint_units.clone()]


def assert_unchanged(caches: RankCaches, before: list[torch.Tensor]) -> None:
    for old, new in zip(before, snapshot(caches), strict=True):
        assert torch.equal(old, new)


_open: list[RankOffloader] = []


@pytest.fixture(autouse=True)
def close_offloaders():
    """Closes every offloader a test made, after the test (closing one frees its host tier, which
    tests share between writers and readers)."""
    yield
    while _open:
        _open.pop().close(drain=False)


def make_offloader(caches: RankCaches, tier: HostTier | None = None, max_pending_saves: int = 8) -> RankOffloader:
    store = TieredStore([tier or HostTier(1 << 20)], caches.fingerprint())
    offloader = RankOffloader(caches, store, max_pending_saves=max_pending_saves, fence_poll_s=0.01)
    _open.append(offloader)
    return offloader


def key(prefix_hash: int, kind: str, pp_rank: int = 0, pp_size: int = 1) -> str:
    rank = worker_id(pp_rank=pp_rank, pp_size=pp_size, tp_rank=0, tp_size=1)
    return object_key(NAMESPACE, prefix_hash, kind, rank)


# Payloads ------------------------------------------------------------------------------------
def test_payload_sizes_match_the_scheduler_specs():
    caches = make_caches()
    mla_spec = MLALatentSpec(block_size=BLOCK_SIZE, num_layers=2, latent_dim=LATENT_DIM, dtype_bytes=2)
    kda_spec = KDAStateSpec(num_layers=2, num_heads=HEADS, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
                            conv_dim=CONV_DIM, conv_window=CONV_WINDOW, conv_dtype_bytes=2)
    assert caches.kv_block_bytes == 2 * BLOCK_SIZE * LATENT_DIM * 2 == mla_spec.bytes_per_block
    assert caches.kv_chunk_bytes(3) == kv_chunk_payload_bytes(mla_spec, 3) == caches.pack_kv([1, 4, 6]).nbytes
    assert caches.state_image_bytes == state_image_payload_bytes(kda_spec) == caches.pack_state(2).nbytes
    fingerprint = caches.fingerprint()
    assert stored_object_bytes(100, fingerprint) == len(encode(bytes(100), fingerprint))


def test_kv_chunk_layout_is_layer_major_in_layer_id_order():
    caches = make_caches()
    payload = torch.frombuffer(bytearray(caches.pack_kv([5, 2])), dtype=torch.bfloat16)
    expected = torch.stack([caches.mla[i][[5, 2]] for i in (0, 2)])  # [layers, blocks, block_size, latent]
    assert torch.equal(payload.view(expected.shape), expected)


def test_kv_chunk_round_trips_into_other_blocks():
    source, target = make_caches(seed=1), make_caches(seed=2)
    untouched = [3, 4, 5, 6, 7]
    before = {i: cache[untouched].clone() for i, cache in target.mla.items()}
    target.unpack_kv(source.pack_kv([6, 1, 3]), [0, 2, 1])
    for i in (0, 2):
        assert torch.equal(target.mla[i][[0, 2, 1]], source.mla[i][[6, 1, 3]])
        assert torch.equal(target.mla[i][untouched], before[i])
    assert bytes(target.pack_kv([0, 2, 1])) == bytes(source.pack_kv([6, 1, 3]))


def test_state_image_round_trips_between_slots_and_units():
    source, target = make_caches(seed=1), make_caches(seed=2)
    image = bytes(source.pack_state(4))
    target.unpack_state(image, 0)
    assert bytes(target.pack_state(0)) == image
    for i in (1, 3):
        for old, new in zip(source.kda[i], target.kda[i], strict=True):
            assert torch.equal(new[0], old[4])
    target.unpack_state_units(image, [7, 2, 10])
    assert bytes(target.pack_state_units([7, 2, 10])) == image


def test_state_image_is_the_checkpoint_stores_image():
    """A checkpoint saved by the worker's StateCheckpointStore is the image the tier stores."""
    caches = make_caches()
    tensors = [t for pair in caches.kda.values() for t in pair]
    store = StateCheckpointStore(tensors, NUM_UNITS, UNIT_BYTES)
    store.save(3, [9, 0, 5])
    units = RankCaches(caches.mla, caches.kda, store.units)
    assert bytes(units.pack_state_units([9, 0, 5])) == bytes(caches.pack_state(3))


def test_from_model_reads_the_bound_caches():
    caches = make_caches()
    layers = {str(i): SimpleNamespace(is_kda=False, self_attn=SimpleNamespace(kv_cache=t))
              for i, t in caches.mla.items()}
    layers |= {str(i): SimpleNamespace(is_kda=True, self_attn=SimpleNamespace(conv_state=c, recurrent_state=r))
               for i, (c, r) in caches.kda.items()}
    model = SimpleNamespace(layers=layers)
    again = RankCaches.from_model(model, caches.checkpoint_units)
    assert again.fingerprint() == caches.fingerprint()
    assert bytes(again.pack_kv([2, 3])) == bytes(caches.pack_kv([2, 3]))


def test_a_stage_without_kda_layers_packs_an_empty_image():
    caches = make_caches(kda_ids=())
    assert caches.state_image_bytes == 0 and caches.pack_state_units([]).nbytes == 0
    with pytest.raises(ValueError, match="state_slot=0"):
        caches.pack_state(0)


def test_bad_ids_name_the_field():
    caches = make_caches()
    with pytest.raises(ValueError, match="block id 8 is outside"):
        caches.pack_kv([0, 8])
    with pytest.raises(ValueError, match="cannot hold"):
        caches.pack_state_units([1])
    with pytest.raises(ValueError, match="exactly one"):
        caches.check_state_target(1, [2, 3])


# Save and load -------------------------------------------------------------------------------
def save_prefix(offloader: RankOffloader, pp_rank: int = 0, pp_size: int = 1):
    """Saves two KV chunks (blocks [0, 1] and [2, 3]) and the state image of slot 1 at their end."""
    kv_keys = [key(0xA1, "kv", pp_rank, pp_size), key(0xA2, "kv", pp_rank, pp_size)]
    state_key = key(0xA2, "state", pp_rank, pp_size)
    assert offloader.save_kv_chunk(kv_keys[0], [0, 1], Fence.ready())
    assert offloader.save_kv_chunk(kv_keys[1], [2, 3], Fence.ready())
    assert offloader.save_state(state_key, Fence.ready(), state_slot=1)
    assert offloader.drain(WAIT_S)
    saved, failed = offloader.poll()
    assert sorted(saved) == sorted([*kv_keys, state_key]) and failed == []
    assert offloader.poll() == ([], [])
    return kv_keys, state_key


def test_save_then_load_restores_the_caches_elsewhere():
    source = make_caches(seed=1)
    tier = HostTier(1 << 20)
    writer = make_offloader(source, tier)
    kv_keys, state_key = save_prefix(writer)  # the writer stays open: closing frees the host tier
    target = make_caches(seed=2)
    reader = make_offloader(target, tier)
    assert reader.load(kv_keys, [[7, 5], [4, 6]], state_key, state_slot=3)
    assert bytes(target.pack_kv([7, 5, 4, 6])) == bytes(source.pack_kv([0, 1, 2, 3]))
    assert bytes(target.pack_state(3)) == bytes(source.pack_state(1))
    assert reader.load(kv_keys[:1], [[0, 1]], state_key, unit_ids=[4, 5, 6])
    assert bytes(target.pack_state_units([4, 5, 6])) == bytes(source.pack_state(1))
    assert reader.stats.loads_done == 2 and reader.stats.loads_missed == 0


def test_save_from_checkpoint_units():
    caches = make_caches()
    offloader = make_offloader(caches)
    assert offloader.save_state(key(0xB, "state"), Fence.ready(), unit_ids=[3, 8, 1])
    assert offloader.drain(WAIT_S) and offloader.poll() == ([key(0xB, "state")], [])
    assert offloader.store.load(key(0xB, "state")) == bytes(caches.pack_state_units([3, 8, 1]))
    offloader.close()


@pytest.mark.parametrize("damage", ["missing_chunk", "corrupt_chunk", "truncated_state", "missing_state"])
def test_a_load_with_any_bad_object_writes_nothing(damage):
    source = make_caches(seed=1)
    tier = HostTier(1 << 20)
    writer = make_offloader(source, tier)
    kv_keys, state_key = save_prefix(writer)
    if damage == "missing_chunk":
        kv_keys = [*kv_keys, key(0xA3, "kv")]
    elif damage == "corrupt_chunk":
        data = bytearray(tier._objects[kv_keys[1]])
        data[-1] ^= 0xFF
        tier._objects[kv_keys[1]] = bytes(data)
    elif damage == "truncated_state":
        tier._objects[state_key] = tier._objects[state_key][:-7]
    else:
        state_key = key(0xA3, "state")
    target = make_caches(seed=2)
    before = snapshot(target)
    reader = make_offloader(target, tier)
    block_ids = [[4, 5], [6, 7], [0, 1]][: len(kv_keys)]
    assert not reader.load(kv_keys, block_ids, state_key, state_slot=0)
    assert_unchanged(target, before)
    assert reader.stats.loads_missed == 1 and reader.stats.loads_done == 0
    assert tier.stats.corrupt_objects == (damage in ("corrupt_chunk", "truncated_state"))


def test_pipeline_stages_keep_their_own_objects():
    """Two stages save the same prefix into one shared tier under their own worker ids."""
    tier = HostTier(1 << 20)
    stages = [make_caches(seed=10 + pp_rank) for pp_rank in range(2)]
    writers = [make_offloader(caches, tier) for caches in stages]
    keys = [save_prefix(writer, pp_rank, pp_size=2) for pp_rank, writer in enumerate(writers)]
    assert not set(keys[0][0] + [keys[0][1]]) & set(keys[1][0] + [keys[1][1]])
    for pp_rank, caches in enumerate(stages):
        target = make_caches(seed=20)
        reader = make_offloader(target, tier)
        kv_keys, state_key = keys[pp_rank]
        assert reader.load(kv_keys, [[0, 1], [2, 3]], state_key, state_slot=1)
        assert bytes(target.pack_kv([0, 1, 2, 3])) == bytes(caches.pack_kv([0, 1, 2, 3]))
        assert bytes(target.pack_state(1)) == bytes(caches.pack_state(1))


def test_pending_saves_are_bounded_and_refusals_counted():
    caches = make_caches()
    offloader = make_offloader(caches, max_pending_saves=2)
    fences = [Fence.pending(), Fence.pending()]
    assert offloader.save_kv_chunk(key(1, "kv"), [0], fences[0])
    assert offloader.save_state(key(1, "state"), fences[1], state_slot=0)
    assert not offloader.save_kv_chunk(key(2, "kv"), [1], Fence.ready())
    assert offloader.num_pending_saves == 2 and offloader.stats.saves_refused == 1
    for fence in fences:
        fence.signal()
    assert offloader.drain(WAIT_S)
    assert sorted(offloader.poll()[0]) == sorted([key(1, "kv"), key(1, "state")])
    assert offloader.save_kv_chunk(key(2, "kv"), [1], Fence.ready())
    offloader.close()
    assert offloader.poll() == ([key(2, "kv")], [])
    assert offloader.stats.saves_done == 3 and offloader.stats.saves_queued == 3


def test_a_save_no_tier_takes_is_reported_failed():
    offloader = make_offloader(make_caches(), HostTier(capacity_bytes=16))
    assert offloader.save_kv_chunk(key(1, "kv"), [0, 1], Fence.ready())
    offloader.close()
    assert offloader.poll() == ([], [key(1, "kv")])
    assert offloader.stats.saves_failed == 1


def saver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "offload-saver"]


def test_close_drops_pending_saves_and_stops_the_thread():
    running = len(saver_threads())
    offloader = make_offloader(make_caches())
    assert len(saver_threads()) == running + 1
    never = Fence.pending()  # a step that never completes
    assert offloader.save_kv_chunk(key(1, "kv"), [0], never)
    assert offloader.save_kv_chunk(key(2, "kv"), [1], Fence.ready())
    offloader.close(drain=False)
    assert len(saver_threads()) == running
    assert offloader.poll() == ([], [key(1, "kv"), key(2, "kv")])
    assert offloader.stats.saves_dropped == 2
    assert not offloader.save_kv_chunk(key(3, "kv"), [2], Fence.ready())
    offloader.close()


# The fence race ------------------------------------------------------------------------------
class ObservedFence(Fence):
    """A host fence that tells when a saver first waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_on = threading.Event()

    def wait(self, timeout_s: float | None = None) -> bool:
        self.waited_on.set()
        return super().wait(timeout_s)


def stored_values(offloader: RankOffloader, k: str, caches: RankCaches) -> torch.Tensor:
    payload = offloader.store.load(k)
    return torch.frombuffer(bytearray(payload), dtype=caches.mla[0].dtype).float()


@pytest.mark.parametrize("fenced", [False, True])
def test_fence_race_on_the_host(fenced):
    """A block the step fills with 1.0 "later": a thread stands for the compute stream and writes
    only once released. Unfenced, the store reads the block first (0.0); fenced, it reads 1.0.

    The writer is released at the worst moment for the save: unfenced, after the save completed;
    fenced, as soon as the saver waits on the fence (so a saver that skipped the wait would read
    before the write, deterministically)."""
    cache = torch.zeros(2, BLOCK_SIZE, LATENT_DIM, dtype=torch.bfloat16)
    caches = RankCaches({0: cache}, {})
    offloader = make_offloader(caches)
    release = threading.Event()
    fence = ObservedFence() if fenced else Fence.ready()

    def compute_stream():
        assert release.wait(WAIT_S)
        cache[1].fill_(1.0)
        if fenced:
            fence.signal()

    writer = threading.Thread(target=compute_stream)
    writer.start()
    assert offloader.save_kv_chunk(key(1, "kv"), [1], fence)
    if fenced:
        assert fence.waited_on.wait(WAIT_S)
    else:
        assert offloader.drain(WAIT_S)
    release.set()
    writer.join()
    assert offloader.drain(WAIT_S) and offloader.poll() == ([key(1, "kv")], [])
    assert torch.equal(cache[1], torch.ones_like(cache[1]))
    expected = 1.0 if fenced else 0.0
    assert torch.equal(stored_values(offloader, key(1, "kv"), caches), torch.full((BLOCK_SIZE * LATENT_DIM,), expected))
    offloader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fenced", [False, True])
def test_fence_race_on_cuda(fenced):
    """The same race on a GPU: the step's fill runs on a side stream behind a long sleep, and the
    saver copies on its own stream; only a fence recorded after the fill makes it wait."""
    cache = torch.zeros(2, BLOCK_SIZE, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    caches = RankCaches({0: cache}, {})
    offloader = make_offloader(caches)
    # a first save, so that the race's save allocates nothing new: a page-locked host or a device memory
    # allocation is an implicit synchronization (CUDA's programming guide), which would hide the race
    assert offloader.save_kv_chunk(key(0, "kv"), [0], Fence.ready())
    assert offloader.drain(WAIT_S) and offloader.poll() == ([key(0, "kv")], [])
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(2_000_000_000)  # about a second on current GPUs: the save is queued long before
        cache[1].fill_(1.0)
    fence = Fence.record(compute) if fenced else Fence.ready()
    assert fence.is_cuda == fenced
    assert offloader.save_kv_chunk(key(1, "kv"), [1], fence)
    assert offloader.drain(WAIT_S * 3) and offloader.poll() == ([key(1, "kv")], [])
    torch.cuda.synchronize()
    assert torch.equal(cache[1].cpu(), torch.ones(BLOCK_SIZE, LATENT_DIM, dtype=torch.bfloat16))
    expected = 1.0 if fenced else 0.0
    assert torch.equal(stored_values(offloader, key(1, "kv"), caches), torch.full((BLOCK_SIZE * LATENT_DIM,), expected))
    offloader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_save_then_load_on_cuda():
    source, target = make_caches(seed=1, device="cuda"), make_caches(seed=2, device="cuda")
    tier = HostTier(1 << 20)
    writer = make_offloader(source, tier)
    kv_keys, state_key = save_prefix(writer)
    reader = make_offloader(target, tier)
    assert reader.load(kv_keys, [[7, 5], [4, 6]], state_key, state_slot=3)
    torch.cuda.synchronize()
    assert bytes(target.pack_kv([7, 5, 4, 6])) == bytes(source.pack_kv([0, 1, 2, 3]))
    assert bytes(target.pack_state(3)) == bytes(source.pack_state(1))
