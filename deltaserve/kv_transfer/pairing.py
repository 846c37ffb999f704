"""Which producer ranks a consumer rank reads, and the (local, remote, nbytes) ops of one request.

The rules are `kv_transfer/topology.py`'s, applied to the layouts the two engines registered:
- layers pair by model layer id, on whichever producer stage holds them;
- KDA heads are split over TP. With consumer tp = k x producer tp, consumer TP rank r holds heads
  [(r % k) H_c, (r % k + 1) H_c) of producer TP rank r // k's segment (H_c = its own head count):
  the recurrent rows [heads, K, V] give one contiguous slice, the conv window
  [q | k | v channels of the local heads, W - 1] one slice per q, k and v;
- MLA latents are replicated over the producer's TP ranks; a consumer rank reads them from the same
  producer TP rank as its heads. Under DCP it reads only its stripe: token p lives on DCP rank
  (p // S) % dcp at local offset (p // (dcp S)) S + p % S, in local pages of the consumer's block
  size. Blocks map by token range, so the two sides' block sizes need not agree.

`pair_ranks` refuses a pairing with an error naming both sides' sizes; `request_ops` returns the
ops per producer rank, a run of tokens contiguous on both sides being one op.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.kv_transfer.layout import RankLayout
from deltaserve.kv_transfer.transfer_engine import TransferOp

RankKey = tuple[int, int]  # (pp_rank, tp_rank) of a producer rank


@dataclass(frozen=True)
class Pairing:
    """What one consumer rank reads: per model layer id, the producer rank holding it, and where its
    heads sit in that rank's head segment (`head_offset`, in heads)."""

    local: RankLayout
    sources: dict[RankKey, RankLayout]
    mla_source: dict[int, RankKey]
    kda_source: dict[int, RankKey]
    head_offset: int
    producer_heads: int

    def describe(self) -> str:
        ranks = ", ".join(f"pp{pp}tp{tp}" for pp, tp in sorted(self.sources))
        return (f"consumer {self.local.describe()} reads producer ranks {ranks}; KDA heads "
                f"[{self.head_offset}, {self.head_offset + self.local.kda_heads}) of {self.producer_heads}")


class PairingError(ValueError):
    """A producer and a consumer whose parallel layouts cannot be paired: a configuration error, so
    the request fails naming both sides whatever kv_load_failure_policy says."""


def _sizes(local: RankLayout, remotes: list[RankLayout]) -> str:
    first = remotes[0]
    return (f"(prefill pipeline_parallel_size={first.pp_size} x tensor_parallel_size={first.tp_size}, decode "
            f"tensor_parallel_size={local.tp_size} x decode_context_parallel_size={local.dcp_size})")


def pair_ranks(local: RankLayout, remotes: list[RankLayout]) -> Pairing:
    """The producer ranks (`remotes`: every rank of the producer engine) that consumer rank `local`
    reads; PairingError naming both sides' sizes when the pair cannot be served."""
    if not remotes:
        raise PairingError("the producer registered no cache layouts")
    sizes = _sizes(local, remotes)
    if local.pp_size > 1:
        raise PairingError(f"a pipeline-parallel decode cannot consume transferred KV {sizes}; run the decode "
                           "at pipeline_parallel_size=1")
    if len({r.tp_size for r in remotes}) != 1 or any(r.dcp_size > 1 for r in remotes):
        raise PairingError(f"the producer's ranks disagree on their TP size or run DCP {sizes}; a prefill "
                           "runs PP x TP without decode context parallelism")
    producer_tp = remotes[0].tp_size
    if local.tp_size % producer_tp:
        raise PairingError(f"decode tensor_parallel_size={local.tp_size} is not a multiple of prefill "
                           f"tensor_parallel_size={producer_tp} {sizes}: each decode rank reads its KDA heads "
                           "from one prefill TP rank")
    ratio = local.tp_size // producer_tp
    producer_rank = local.tp_rank // ratio
    mine = {(r.pp_rank, r.tp_rank): r for r in remotes if r.tp_rank == producer_rank}
    if not mine:
        raise PairingError(f"no producer rank has tp_rank {producer_rank}, the head group of decode tp_rank "
                           f"{local.tp_rank} {sizes}")
    producer_heads = {r.kda_heads for r in mine.values() if r.kda}
    if local.kda and producer_heads != {ratio * local.kda_heads}:
        raise PairingError(f"decode tp_rank {local.tp_rank} holds {local.kda_heads} KDA heads, which do not lie "
                           f"inside prefill tp_rank {producer_rank}'s head group of {sorted(producer_heads)} heads "
                           f"{sizes} (a different model?)")
    mla_source = {layer: key for key, r in mine.items() for layer in r.mla if layer in local.mla}
    kda_source = {layer: key for key, r in mine.items() for layer in r.kda if layer in local.kda}
    missing = sorted((set(local.mla) - set(mla_source)) | (set(local.kda) - set(kda_source)))
    if missing:
        raise PairingError(f"the producer holds no cache for layers {missing} of decode tp_rank {local.tp_rank} "
                           f"{sizes} (a different model?)")
    used = set(mla_source.values()) | set(kda_source.values())
    return Pairing(local, {k: mine[k] for k in used}, mla_source, kda_source,
                   (local.tp_rank % ratio) * local.kda_heads, ratio * local.kda_heads)


def latent_runs(num_tokens: int, local: RankLayout, remote_block_size: int,
                start: int = 0) -> list[tuple[int, int, int]]:
    """(position, local offset, length): the runs of the tokens in [start, num_tokens) that `local`
    stores (its DCP stripe), each contiguous in position and in local offset and inside one producer
    page (`remote_block_size` tokens) and one local page (`local.block_size` tokens)."""
    if local.dcp_size == 1:
        stripes = [(0, 0, num_tokens)]
    else:
        width, period = local.dcp_interleave, local.dcp_size * local.dcp_interleave
        stripes = []
        for round_start in range(local.dcp_rank * width, num_tokens, period):
            stripes.append((round_start, round_start // period * width, min(width, num_tokens - round_start)))
    runs = []
    for position, offset, length in stripes:
        if position + length <= start:
            continue
        cut = max(0, start - position)  # a stripe that starts before `start`: its tail only
        position, offset, length = position + cut, offset + cut, length - cut
        while length > 0:
            n = min(length, remote_block_size - position % remote_block_size,
                    local.block_size - offset % local.block_size)
            runs.append((position, offset, n))
            position, offset, length = position + n, offset + n, length - n
    return runs


def request_ops(pairing: Pairing, local_blocks: list[int], remote_blocks: list[int], remote_block_size: int,
                local_slot: int, remote_slot: int, num_tokens: int,
                staged: frozenset[RankKey] = frozenset()) -> dict[RankKey, list[TransferOp]]:
    """The reads that bring one request's first `num_tokens` latents (this rank's stripe) and its KDA
    state (this rank's heads) from the producer, per producer rank; the latents of the producer ranks
    in `staged` are left out (read through their staging slots: `staged_ops`). ValueError when the
    blocks given do not cover the tokens."""
    ops = latent_ops(pairing, local_blocks, remote_blocks, remote_block_size, 0, num_tokens, staged)
    for key, state in state_ops(pairing, local_slot, remote_slot).items():
        ops[key] += state
    return ops


def latent_ops(pairing: Pairing, local_blocks: list[int], remote_blocks: list[int], remote_block_size: int,
               start: int, end: int, staged: frozenset[RankKey] = frozenset()) -> dict[RankKey, list[TransferOp]]:
    """The reads of the latents of tokens [start, end) (this rank's stripe of them), per producer
    rank, leaving out the ranks in `staged`. A chunked transfer reads each computed part this way
    while the producer's prefill goes on. ValueError when the blocks given do not cover the tokens."""
    local = pairing.local
    if len(remote_blocks) * remote_block_size < end:
        raise ValueError(f"{end} tokens need {-(-end // remote_block_size)} producer blocks of "
                         f"{remote_block_size}, the request names {len(remote_blocks)}")
    runs = latent_runs(end, local, remote_block_size, start)
    needed = -(-(runs[-1][1] + runs[-1][2]) // local.block_size) if runs else 0
    if len(local_blocks) < needed:
        raise ValueError(f"this rank's {len(runs)} latent runs need {needed} local blocks, "
                         f"the request has {len(local_blocks)}")
    ops: dict[RankKey, list[TransferOp]] = {key: [] for key in pairing.sources}
    for layer_id, key in pairing.mla_source.items():
        if key in staged:
            continue
        here, there = local.mla[layer_id], pairing.sources[key].mla[layer_id]
        token_bytes = here.row_bytes // local.block_size
        if there.row_bytes != token_bytes * remote_block_size:
            raise ValueError(f"MLA layer {layer_id}: a token's latents are {token_bytes} bytes here and "
                             f"{there.row_bytes // remote_block_size} on the producer (different models or dtypes)")
        layer_ops: list[TransferOp] = []
        for position, offset, n in runs:
            dst = here.row(local_blocks[offset // local.block_size]) + offset % local.block_size * token_bytes
            src = there.row(remote_blocks[position // remote_block_size]) + position % remote_block_size * token_bytes
            last = layer_ops[-1] if layer_ops else None
            if last is not None and last[0] + last[2] == dst and last[1] + last[2] == src:
                layer_ops[-1] = (last[0], last[1], last[2] + n * token_bytes)
            else:
                layer_ops.append((dst, src, n * token_bytes))
        ops[key] += layer_ops
    return ops


def state_ops(pairing: Pairing, local_slot: int, remote_slot: int) -> dict[RankKey, list[TransferOp]]:
    """The reads of one request's KDA state (this rank's heads of every KDA layer), per producer rank."""
    local = pairing.local
    ops: dict[RankKey, list[TransferOp]] = {key: [] for key in pairing.sources}
    for layer_id, key in pairing.kda_source.items():
        remote = pairing.sources[key]
        for part, (here, there) in enumerate(zip(local.kda[layer_id], remote.kda[layer_id], strict=True)):
            sections = 3 if part == 0 else 1  # conv rows hold q, k and v channels of the heads; state rows heads
            head_bytes = there.row_bytes // (sections * pairing.producer_heads)
            if here.row_bytes != head_bytes * sections * local.kda_heads:
                raise ValueError(f"KDA layer {layer_id}: a head's {'conv window' if part == 0 else 'state'} is "
                                 f"{here.row_bytes // (sections * local.kda_heads)} bytes here and {head_bytes} on "
                                 "the producer (different models or dtypes)")
            length = head_bytes * local.kda_heads
            for s in range(sections):
                src = there.row(remote_slot) + (s * pairing.producer_heads + pairing.head_offset) * head_bytes
                dst, last = here.row(local_slot) + s * length, ops[key][-1] if s else None
                if last is not None and last[0] + last[2] == dst and last[1] + last[2] == src:
                    ops[key][-1] = (last[0], last[1], last[2] + length)  # the whole segment: q, k, v in one
                else:
                    ops[key].append((dst, src, length))
    return ops


def staged_ops(pairing: Pairing, key: RankKey, local_blocks: list[int], slot: int, start: int,
               count: int) -> list[TransferOp]:
    """The reads of one staged chunk: stripe offsets [start, start + count), gathered by producer rank
    `key` into its staging `slot` in stripe order, into this rank's pages; one op per destination page
    per MLA layer that rank holds."""
    local, remote = pairing.local, pairing.sources[key]
    ops: list[TransferOp] = []
    for layer_id, source in pairing.mla_source.items():
        if source != key:
            continue
        here, there = local.mla[layer_id], remote.staging[layer_id]
        token_bytes = here.row_bytes // local.block_size
        if there.row_bytes != token_bytes * remote.staging_capacity:
            raise ValueError(f"MLA layer {layer_id}: the producer's staging slot rows are {there.row_bytes} bytes, "
                             f"not {remote.staging_capacity} tokens of {token_bytes}")
        offset, end = start, start + count
        while offset < end:
            n = min(end - offset, local.block_size - offset % local.block_size)
            dst = here.row(local_blocks[offset // local.block_size]) + offset % local.block_size * token_bytes
            ops.append((dst, there.row(slot) + (offset - start) * token_bytes, n * token_bytes))
            offset += n
    return ops
