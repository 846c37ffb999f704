"""The KV connector's worker side: one per rank, beside the model's caches.

It registers the rank's cache tensors with a transfer agent (`register`, after the caches are
allocated) and describes them as a `RankLayout`. On a producer that is all: consumers read its
memory one-sidedly, and its engine core's side channel hands out the layouts. On a consumer it
starts the loads each step orders (`start_loads`): a handshake with the producer once per engine
(its layouts, then `add_peer` per producer rank), then one READ per producer rank holding layers
this rank needs. `poll` reports the loads that finished or failed since the last call; a rank that
has read a request tells the producer (`release`), whatever the outcome, so it can free the request.

Staging (`staging_chunk_pages` on the producer): each producer rank with MLA layers also keeps a
staging pool and its server (kv_transfer/staging.py). A DCP consumer rank reads its latents from such a
rank chunk by chunk, one chunk in flight per producer rank: ask it to stage the chunk, read the slot
(one op per destination page per layer), unstage it, next chunk; `poll` drives the chunks.

Chunked transfer (params marked "chunked", given before the producer's prefill ran): each `poll`
asks the producer's side channel for the request's progress and reads the latents of the prompt
tokens computed since the last ask; once the producer reports the request finished, the rest of
the latents, the KDA state and the final params (the first token) follow.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from deltaserve.config.parallel import ParallelConfig
from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.kv_transfer.config import KVTransferConfig
from deltaserve.kv_transfer.layout import RankLayout, TensorRows
from deltaserve.kv_transfer.metadata import KVConnectorMetadata, KVConnectorOutput, LoadSpec, RemoteSource
from deltaserve.kv_transfer.pairing import (
    Pairing,
    PairingError,
    RankKey,
    latent_ops,
    pair_ranks,
    request_ops,
    staged_ops,
    state_ops,
)
from deltaserve.kv_transfer.side_channel import SideChannelError, ask, handshake
from deltaserve.kv_transfer.staging import StagingPool, StagingServer
from deltaserve.kv_transfer.transfer_engine import TransferAgent, TransferError, TransferHandle, make_agent

logger = logging.getLogger(__name__)


@dataclass
class _Producer:
    """A producer engine this rank has shaken hands with: what it reads there, and agent peer names."""

    engine_id: str
    pairing: Pairing
    peers: dict[RankKey, str] = field(default_factory=dict)


@dataclass
class _StagedReads:
    """The staged chunks of one load from one producer rank: stripe offsets still to read, and the
    chunk in flight (its slot and read)."""

    key: RankKey
    next_offset: int
    end: int
    slot: int | None = None
    handle: TransferHandle | None = None


@dataclass
class _Load:
    spec: LoadSpec
    handles: list[TransferHandle]
    deadline: float
    staged: list[_StagedReads] = field(default_factory=list)
    read_to: int = 0  # chunked transfer: prompt tokens whose latents have been posted
    final_params: dict | None = None  # chunked transfer: the producer's params once it finished


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, parallel: ParallelConfig, block_size: int,
                 dcp_interleave: int = 1) -> None:
        """block_size: tokens per local MLA page; dcp_interleave: consecutive tokens per DCP rank."""
        self.config = config
        self.parallel = parallel
        self.block_size = block_size
        self.dcp_interleave = dcp_interleave
        self.agent: TransferAgent | None = None
        self.layout: RankLayout | None = None
        self._producers: dict[tuple[str, int], _Producer] = {}
        self._loads: dict[str, _Load] = {}
        self._failed: dict[str, str] = {}
        self._refused: set[str] = set()
        self.staging: StagingServer | None = None  # a producer rank's, with staging on
        self._num_ops = self._num_staged_chunks = 0  # since the last poll
        self.reader_name = f"{config.engine_id}:pp{parallel.pipeline_parallel_rank}tp{parallel.tensor_parallel_rank}"

    def register(self, model) -> RankLayout:
        """Registers every cache tensor of `model` (its caches bound) and returns this rank's layout."""
        name = f"{self.config.engine_id}-pp{self.parallel.pipeline_parallel_rank}-tp" \
               f"{self.parallel.tensor_parallel_rank}-{uuid.uuid4().hex[:6]}"
        device = next(iter(model.parameters())).device
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kv_transfer_config: caches on {device.type} cannot be registered for transfer "
                             "(host or CUDA memory only)")
        cuda_index = None if device.type == "cpu" else (device.index if device.index is not None
                                                        else torch.cuda.current_device())
        self.agent = make_agent(self.config.backend, name, self.config.kv_ip)
        mla, kda, heads = {}, {}, 0
        for key, layer in model.layers.items():
            attn = layer.self_attn
            if layer.is_kda:
                kda[int(key)] = (TensorRows.of(attn.conv_state), TensorRows.of(attn.recurrent_state))
                heads = attn.num_heads
            else:
                mla[int(key)] = TensorRows.of(attn.kv_cache)
        p = self.parallel
        staging: dict = {}
        if self.config.is_producer and self.config.staging_chunk_pages and mla:
            caches = {int(key): layer.self_attn.kv_cache for key, layer in model.layers.items() if not layer.is_kda}
            pool = StagingPool(caches, self.config.staging_chunk_pages, self.config.staging_slots, self.block_size,
                               self.config.staging_stream_priority)
            self.staging = StagingServer(pool, self.config.kv_ip, self.config.transfer_timeout_s)
            staging = pool.rows()
        layout = RankLayout(p.pipeline_parallel_rank, p.tensor_parallel_rank, p.tensor_parallel_size, self.block_size,
                            "", mla, kda, heads, p.pipeline_parallel_size, p.decode_context_parallel_size,
                            p.decode_context_parallel_rank, self.dcp_interleave, staging,
                            self.staging.pool.capacity if self.staging else 0,
                            self.staging.host if self.staging else "", self.staging.port if self.staging else 0)
        self.agent.register(layout.regions(), cuda_index)
        self.layout = layout.with_metadata(base64.b64encode(self.agent.metadata()).decode())
        return self.layout

    # Consumer --------------------------------------------------------------------------------
    def _producer(self, host: str, port: int, engine_id: str) -> _Producer:
        known = self._producers.get((host, port))
        if known is not None and known.engine_id == engine_id:
            return known
        assert self.agent is not None and self.layout is not None
        found_id, layouts = handshake(host, port)
        if found_id != engine_id:
            raise SideChannelError(f"the side channel at {host}:{port} belongs to engine {found_id!r}, not "
                                   f"{engine_id!r} (the producer restarted?)")
        pairing = pair_ranks(self.layout, layouts)
        logger.info("kv transfer: paired with producer %s at %s:%d: %s", engine_id, host, port, pairing.describe())
        producer = _Producer(engine_id, pairing)
        for key, remote in pairing.sources.items():
            producer.peers[key] = self.agent.add_peer(remote.agent_bytes)
        self._producers[(host, port)] = producer
        return producer

    def start_loads(self, meta: KVConnectorMetadata | None) -> None:
        """Posts the reads of every load `meta` orders (a failure is reported by the next `poll`)."""
        if meta is None:
            return
        for spec in meta.loads:
            try:
                self._start(spec)
            except (SideChannelError, TransferError, ValueError) as e:
                logger.warning("kv transfer: load of request %s from %s:%d failed to start: %s", spec.request_id,
                               spec.source.host, spec.source.port, e)
                self._failed[spec.request_id] = str(e)
                if isinstance(e, PairingError):
                    self._refused.add(spec.request_id)
                self._release(spec)

    def _start(self, spec: LoadSpec) -> None:
        assert self.agent is not None and self.layout is not None
        source = spec.source
        producer = self._producer(source.host, source.port, source.engine_id)
        load = _Load(spec, [], time.monotonic() + self.config.transfer_timeout_s)
        if not source.chunked:  # (a chunked load posts its reads as the producer's prefill goes: poll)
            pairing = producer.pairing
            staged = frozenset(key for key in set(pairing.mla_source.values())
                               if pairing.local.dcp_size > 1 and pairing.sources[key].staging_capacity)
            self._post_reads(load, producer, request_ops(pairing, spec.block_ids, source.block_ids, source.block_size,
                                                         spec.state_slot, source.state_slot, source.num_tokens, staged))
            if staged:
                local = pairing.local
                stripe = DCPLayout(local.dcp_size, local.dcp_rank, local.block_size, local.dcp_interleave)
                length = int(stripe.local_seq_lens(torch.tensor([source.num_tokens]))[0])  # this rank's tokens
                load.staged = [_StagedReads(key, 0, length) for key in sorted(staged) if length]
        self._loads[spec.request_id] = load
        try:
            if source.chunked:
                self._advance_chunked(load, producer)
            else:
                self._advance_staged(load, producer)
        except BaseException:
            self._unstage_all(load)
            del self._loads[spec.request_id]
            raise

    def _post_reads(self, load: _Load, producer: _Producer, ops: dict[RankKey, list]) -> None:
        """One READ per producer rank with ops, its handle kept on the load."""
        assert self.agent is not None
        for key, rank_ops in ops.items():
            if rank_ops:
                load.handles.append(self.agent.read(producer.peers[key], rank_ops))
                self._num_ops += len(rank_ops)

    def _advance_chunked(self, load: _Load, producer: _Producer) -> bool:
        """Chunked transfer: posts the reads of what the producer computed since the last call; True
        once it finished and every read is posted (the last with the state). TransferError when the
        producer dropped the request, SideChannelError when it does not answer."""
        if load.final_params is not None:
            return True
        source, pairing = load.spec.source, producer.pairing
        progress = ask(source.host, source.port, {"kind": "progress", "request_id": source.request_id},
                       timeout_ms=2000)
        if progress["state"] == "gone":
            raise TransferError(f"the producer dropped request {source.request_id}: {progress['why']}")
        if progress["state"] == "running":
            ready, blocks, state = int(progress["ready"]), progress["block_ids"], None
        else:
            final = RemoteSource.from_params(progress["params"])
            ready, blocks, state = source.num_tokens, final.block_ids, final.state_slot
        if ready > load.read_to or state is not None:
            ops = latent_ops(pairing, load.spec.block_ids, blocks, source.block_size, load.read_to, ready)
            if state is not None:
                for key, rank_ops in state_ops(pairing, load.spec.state_slot, state).items():
                    ops[key] += rank_ops
            self._post_reads(load, producer, ops)
            load.read_to = ready
            load.deadline = time.monotonic() + self.config.transfer_timeout_s  # it moves: wait on
        if state is None:
            return False
        load.final_params = progress["params"]
        return True

    def _advance_staged(self, load: _Load, producer: _Producer) -> bool:
        """Moves each producer rank's staged chunks on: while its chunk in flight is read, unstage it,
        stage the next and post its read (a loopback read may be done at once, so one call can move
        through several chunks); True when every chunk has been read. TransferError / SideChannelError
        when a read or the producer's staging server fails."""
        assert self.agent is not None
        source, done = load.spec.source, True
        local = producer.pairing.local
        for reads in load.staged:
            while True:
                if reads.handle is not None:
                    if not self.agent.poll(reads.handle):
                        break
                    self._unstage(reads, producer)
                if reads.next_offset >= reads.end:
                    break
                remote = producer.pairing.sources[reads.key]
                count = min(remote.staging_capacity, reads.end - reads.next_offset)
                answer = ask(remote.staging_host, remote.staging_port, {
                    "kind": "stage", "block_ids": source.block_ids, "num_tokens": source.num_tokens,
                    "start": reads.next_offset, "count": count, "dcp_size": local.dcp_size,
                    "dcp_rank": local.dcp_rank, "interleave": local.dcp_interleave})
                if answer["slot"] is None:
                    break  # every slot is held: asked again at the next poll
                reads.slot = int(answer["slot"])
                ops = staged_ops(producer.pairing, reads.key, load.spec.block_ids, reads.slot, reads.next_offset,
                                 count)
                reads.handle = self.agent.read(producer.peers[reads.key], ops)
                reads.next_offset += count
                self._num_ops += len(ops)
                self._num_staged_chunks += 1
            done = done and reads.handle is None and reads.next_offset >= reads.end
        return done

    def _unstage(self, reads: _StagedReads, producer: _Producer) -> None:
        if reads.slot is not None:
            remote = producer.pairing.sources[reads.key]
            slot, reads.slot, reads.handle = reads.slot, None, None
            try:
                ask(remote.staging_host, remote.staging_port, {"kind": "unstage", "slot": slot}, timeout_ms=2000)
            except SideChannelError as e:  # the producer takes the slot back after its timeout
                logger.warning("kv transfer: could not unstage slot %d: %s", slot, e)

    def _unstage_all(self, load: _Load) -> None:
        producer = self._producers.get((load.spec.source.host, load.spec.source.port))
        if producer is not None:
            for reads in load.staged:
                if reads.handle is not None and not reads.handle.done:
                    continue  # a read still in flight: its slot is taken back by the producer's timeout
                self._unstage(reads, producer)

    def poll(self) -> KVConnectorOutput:
        """Loads finished or failed since the last call (each reported once)."""
        assert self.agent is not None
        out = KVConnectorOutput(failed_recving=self._failed, refused=self._refused)
        self._failed, self._refused = {}, set()
        now = time.monotonic()
        for request_id, load in list(self._loads.items()):
            try:
                producer = self._producers.get((load.spec.source.host, load.spec.source.port))
                # a chunked load posts its new reads first: it is done once those have landed too
                posted = self._advance_chunked(load, producer) if load.spec.source.chunked else True
                done = all([self.agent.poll(h) for h in load.handles]) and posted
                if load.staged:
                    done = self._advance_staged(load, producer) and done
                if not done and now > load.deadline:
                    raise TransferError(f"not done after transfer_timeout_s={self.config.transfer_timeout_s}")
            except (TransferError, SideChannelError, ValueError) as e:
                logger.warning("kv transfer: load of request %s failed: %s", request_id, e)
                out.failed_recving[request_id] = str(e)
                self._unstage_all(load)
            else:
                if not done:
                    continue
                del self._loads[request_id]
                if not self._release(load.spec):
                    why = ("the producer freed the request (its transfer_timeout_s passed) before this read was "
                           "released: its blocks may have been reused while they were read")
                    logger.warning("kv transfer: load of request %s failed: %s", request_id, why)
                    out.failed_recving[request_id] = why
                    continue
                out.finished_recving.append(request_id)
                if load.final_params is not None:
                    out.remote_params[request_id] = load.final_params
                continue
            del self._loads[request_id]
            self._release(load.spec)
        out.loads_in_flight = len(self._loads)
        out.num_ops, out.num_staged_chunks = self._num_ops, self._num_staged_chunks
        self._num_ops = self._num_staged_chunks = 0
        return out

    def _release(self, spec: LoadSpec) -> bool:
        """Tells the producer this rank is done with the request (it frees it once every reader is);
        returns whether the producer still held it (False also when the producer did not answer: a
        finished read is trusted only on its word)."""
        source = spec.source
        try:
            reply = ask(source.host, source.port, {"kind": "release", "request_id": source.request_id,
                                                   "reader": self.reader_name, "readers": self.parallel.world_size},
                        timeout_ms=2000)
        except SideChannelError as e:  # the producer frees it after its own timeout
            logger.warning("kv transfer: could not release request %s on its producer: %s", source.request_id, e)
            return False
        return bool(reply.get("held", True))

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.agent is not None:
            self.agent.close()
            self.agent = None
