"""The KV connector's scheduler side: pure Python, in the engine core beside the scheduler.

Producer: a finished request that asked for remote decode keeps its blocks and state slot until its
consumer's readers have all released it (over the side channel) or transfer_timeout_s passes; the
request's final output carries the kv_transfer_params a consumer needs. Consumer: a request whose
kv_transfer_params say do_remote_prefill gets blocks and a state slot for its prompt, and the next
step tells the worker side to read them from the producer; it runs once the load has finished.

Chunked transfer (`chunked_transfer` on the producer): a request for remote decode gets its
kv_transfer_params (marked "chunked") as soon as it is added, before its prefill runs, and its
progress is kept in `streams` for the side channel to answer: the prompt tokens computed so far and
their blocks while it runs, its final params once it finished (then it is held as above), or why it
ended without them (aborted, preempted). A consumer given such params reads each computed part while
the prefill goes on. It cannot carry the request to a DCP decode (a DCP rank's stripe needs the
staging path, which reads a finished request): such a consumer refuses it at admission.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from deltaserve.kv_transfer.config import KVTransferConfig
from deltaserve.kv_transfer.metadata import KVConnectorMetadata, LoadSpec, RemoteSource

logger = logging.getLogger(__name__)


def kv_transfer_params(sampling_params: Any) -> dict[str, Any] | None:
    """A request's kv_transfer_params (SamplingParams.extra_args["kv_transfer_params"]), or None."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    params = extra.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, block_size: int, clock=time.monotonic,
                 decode_context_parallel_size: int = 1) -> None:
        self.config = config
        self.block_size = block_size
        self.clock = clock
        self.decode_context_parallel_size = decode_context_parallel_size
        # producer, chunked transfer: request id -> its progress as the side channel answers it (each
        # value replaced whole, never changed in place: the side channel's thread reads them)
        self.streams: dict[str, dict[str, Any]] = {}
        self._ended_streams: dict[str, float] = {}  # streams that ended without params -> when to drop them
        self.side_channel: tuple[str, int] | None = None  # the engine core's side channel, once bound
        self._loads: list[LoadSpec] = []  # to send with the next step
        self.held: dict[str, float] = {}  # producer: request id -> deadline
        self.num_expired = 0

    # Consumer --------------------------------------------------------------------------------
    def remote_source(self, sampling_params: Any, num_prompt_tokens: int) -> RemoteSource | None:
        """Where a waiting request's prompt was prefilled, if it is to be loaded from there; ValueError
        when its kv_transfer_params are unusable here."""
        params = kv_transfer_params(sampling_params)
        if not params or not params.get("do_remote_prefill"):
            return None
        if not self.config.is_consumer:
            raise ValueError(f"kv_transfer_params: do_remote_prefill needs a consumer engine (kv_role "
                             f"kv_consumer or kv_both), this one is {self.config.kv_role}")
        source = RemoteSource.from_params(params)
        if source.chunked and self.decode_context_parallel_size > 1:
            raise ValueError(f"kv_transfer_params: the producer {source.engine_id} runs chunked transfer (it sends the "
                             "KV while its prefill runs), which cannot reach this decode's topology, "
                             f"decode_context_parallel_size={self.decode_context_parallel_size}: a DCP rank reads its "
                             "token stripe per token or through the producer's staging of a finished request; run "
                             "that producer without chunked_transfer to serve this decode")
        if source.num_tokens != num_prompt_tokens:
            raise ValueError(f"kv_transfer_params: remote_num_tokens={source.num_tokens} but the prompt has "
                             f"{num_prompt_tokens} tokens (the decode leg must send the prefill's prompt token ids)")
        if not source.chunked and len(source.block_ids) * source.block_size < source.num_tokens:
            raise ValueError("kv_transfer_params: remote_block_ids do not cover remote_num_tokens")
        return source

    def add_load(self, load: LoadSpec) -> None:
        self._loads.append(load)

    def build_meta(self) -> KVConnectorMetadata | None:
        """The loads to start in the coming step (None when there are none)."""
        if not self._loads:
            return None
        meta, self._loads = KVConnectorMetadata(loads=self._loads), []
        return meta

    # Producer --------------------------------------------------------------------------------
    def _for_remote_decode(self, request: Any) -> bool:
        params = kv_transfer_params(request.sampling_params)
        return self.config.is_producer and bool(params) and bool(params.get("do_remote_decode"))

    def stream_started(self, request: Any) -> dict[str, Any] | None:
        """Chunked transfer: the kv_transfer_params of a request for remote decode, given when it is
        added (None when chunked transfer is off or the request is not for remote decode)."""
        if not self.config.chunked_transfer or not self._for_remote_decode(request):
            return None
        assert self.side_channel is not None, "the worker side has not bound its side channel"
        host, port = self.side_channel
        self.streams[request.request_id] = {"state": "running", "ready": 0, "block_ids": []}
        return RemoteSource(self.config.engine_id, host, port, request.request_id, [], self.block_size, -1,
                            request.num_prompt_tokens, -1, chunked=True).to_params()

    def stream_progress(self, request_id: str, ready: int, block_ids: list[int]) -> None:
        """Chunked transfer: the first `ready` prompt tokens of a running request are computed, in
        `block_ids` (a step that computed them has completed on every stage)."""
        known = self.streams.get(request_id)
        if known is not None and known["state"] == "running" and ready > known["ready"]:
            self.streams[request_id] = {"state": "running", "ready": ready,
                                        "block_ids": block_ids[: -(-ready // self.block_size)]}

    def stream_done(self, request_id: str, params: dict[str, Any]) -> None:
        """Chunked transfer: the request finished and is held with these final params."""
        if request_id in self.streams:
            self.streams[request_id] = {"state": "done", "params": params}

    def stream_lost(self, request_id: str, why: str) -> None:
        """Chunked transfer: the request will not be held (aborted, preempted, not finished as a
        prefill leg): its consumer is told why; the entry goes when the consumer releases it, or
        after transfer_timeout_s."""
        known = self.streams.get(request_id)
        if known is not None and known["state"] != "gone":
            self.streams[request_id] = {"state": "gone", "why": why}
            self._ended_streams[request_id] = self.clock() + self.config.transfer_timeout_s

    def request_finished(self, request: Any, block_ids: list[int], state_slot: int | None) -> dict[str, Any] | None:
        """A producer's request finished with its KV in `block_ids` and its state in `state_slot`:
        returns the consumer's kv_transfer_params and holds the request (the caller keeps its blocks
        and slot), or None when it is not for remote decode."""
        if not self._for_remote_decode(request):
            return None
        # the prefill leg's one token (max_tokens=1): no step ran past it, so the slot holds the
        # state after exactly the prompt
        if state_slot is None or len(request.output_token_ids) != 1:
            self.stream_lost(request.request_id, f"the producer's request ended after {len(request.output_token_ids)} "
                             "tokens, not as a prefill leg of one")
            return None
        assert self.side_channel is not None, "the worker side has not bound its side channel"
        host, port = self.side_channel
        num_tokens = request.num_prompt_tokens
        source = RemoteSource(self.config.engine_id, host, port, request.request_id,
                              block_ids[: -(-num_tokens // self.block_size)], self.block_size, state_slot,
                              num_tokens, request.output_token_ids[0])
        self.held[request.request_id] = self.clock() + self.config.transfer_timeout_s
        return source.to_params()

    def released(self, request_ids: list[str]) -> list[str]:
        """Of the consumers' releases, the requests held here (to free now)."""
        for request_id in request_ids:  # its consumer is done with the stream, whatever became of it
            self.streams.pop(request_id, None)
            self._ended_streams.pop(request_id, None)
        return [r for r in request_ids if self.held.pop(r, None) is not None]

    def expired(self) -> list[str]:
        """Held requests no consumer read within transfer_timeout_s (to free now; counted)."""
        now = self.clock()
        gone = [r for r, deadline in self.held.items() if deadline <= now]
        for request_id in [r for r, drop_at in self._ended_streams.items() if drop_at <= now]:
            del self._ended_streams[request_id]
            self.streams.pop(request_id, None)
        for request_id in gone:
            del self.held[request_id]
            self.streams.pop(request_id, None)
            logger.warning("kv transfer: no consumer read request %s within %.0f s; its KV and state are freed",
                           request_id, self.config.transfer_timeout_s)
        self.num_expired += len(gone)
        return gone
