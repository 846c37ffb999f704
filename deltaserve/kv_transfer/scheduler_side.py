"""The KV connector's scheduler side: pure Python, in the engine core beside the scheduler.

Producer: a finished request that asked for remote decode keeps its blocks and state slot until its
consumer's readers have all released it (over the side channel) or transfer_timeout_s passes; the
request's final output carries the kv_transfer_params a consumer needs. Consumer: a request whose
kv_transfer_params say do_remote_prefill gets blocks and a state slot for its prompt, and the next
step tells the worker side to read them from the producer; it runs once the load has finished.
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
    def __init__(self, config: KVTransferConfig, block_size: int, clock=time.monotonic) -> None:
        self.config = config
        self.block_size = block_size
        self.clock = clock
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
        if source.num_tokens != num_prompt_tokens:
            raise ValueError(f"kv_transfer_params: remote_num_tokens={source.num_tokens} but the prompt has "
                             f"{num_prompt_tokens} tokens (the decode leg must send the prefill's prompt token ids)")
        if len(source.block_ids) * source.block_size < source.num_tokens:
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
    def request_finished(self, request: Any, block_ids: list[int], state_slot: int | None) -> dict[str, Any] | None:
        """A producer's request finished with its KV in `block_ids` and its state in `state_slot`:
        returns the consumer's kv_transfer_params and holds the request (the caller keeps its blocks
        and slot), or None when it is not for remote decode."""
        params = kv_transfer_params(request.sampling_params)
        if not self.config.is_producer or not params or not params.get("do_remote_decode"):
            return None
        # the prefill leg's one token (max_tokens=1): no step ran past it, so the slot holds the
        # state after exactly the prompt
        if state_slot is None or len(request.output_token_ids) != 1:
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
        return [r for r in request_ids if self.held.pop(r, None) is not None]

    def expired(self) -> list[str]:
        """Held requests no consumer read within transfer_timeout_s (to free now; counted)."""
        now = self.clock()
        gone = [r for r, deadline in self.held.items() if deadline <= now]
        for request_id in gone:
            del self.held[request_id]
            logger.warning("kv transfer: no consumer read request %s within %.0f s; its KV and state are freed",
                           request_id, self.config.transfer_timeout_s)
        self.num_expired += len(gone)
        return gone
