"""What the KV connector's two halves exchange: plain data that crosses a process boundary.

The scheduler side puts `KVConnectorMetadata` (loads to start) on each SchedulerOutput; the worker
side answers with `KVConnectorOutput` (transfers finished or failed) on its ModelRunnerOutput. A
producer's finished request carries `kv_transfer_params` (a JSON object, `RemoteSource.to_params`)
that the proxy hands to the consumer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RemoteSource:
    """Where a request's prefilled KV and KDA state wait on its producer."""

    engine_id: str
    host: str
    port: int  # the producer's side channel
    request_id: str  # the request's id on the producer (what the release names)
    block_ids: list[int]  # the producer's blocks of the prompt, in order
    block_size: int
    state_slot: int
    num_tokens: int  # prompt tokens the blocks and the state cover
    first_token_id: int  # what the producer sampled after the prompt
    first_token_logprobs: tuple[list[int], list[float], int] | None = None  # (ids, logprobs, rank)
    # chunked transfer: sent when the producer admitted the request, before its prefill ran, so the
    # blocks, the slot and the first token are not known yet (empty, -1, -1): the consumer asks the
    # producer's side channel for its progress and reads each computed part as it lands
    chunked: bool = False

    def to_params(self) -> dict[str, Any]:
        """The consumer's kv_transfer_params (vLLM's do_remote_prefill / remote_* names)."""
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_host": self.host, "remote_port": self.port, "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids), "remote_block_size": self.block_size,
            "remote_state_slot": self.state_slot, "remote_num_tokens": self.num_tokens,
            "first_token_id": self.first_token_id,
            "first_token_logprobs": None if self.first_token_logprobs is None else list(self.first_token_logprobs),
            "chunked": self.chunked,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemoteSource:
        """From a consumer request's kv_transfer_params; ValueError naming the missing or bad field."""
        names = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids",
                 "remote_block_size", "remote_state_slot", "remote_num_tokens", "first_token_id")
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)} (the producer's "
                             "kv_transfer_params, as the proxy passes them)")
        try:
            lp = params.get("first_token_logprobs")
            return cls(
                engine_id=str(params["remote_engine_id"]), host=str(params["remote_host"]),
                port=int(params["remote_port"]), request_id=str(params["remote_request_id"]),
                block_ids=[int(b) for b in params["remote_block_ids"]], block_size=int(params["remote_block_size"]),
                state_slot=int(params["remote_state_slot"]), num_tokens=int(params["remote_num_tokens"]),
                first_token_id=int(params["first_token_id"]),
                first_token_logprobs=None if lp is None else ([int(t) for t in lp[0]], [float(x) for x in lp[1]],
                                                             int(lp[2])),
                chunked=bool(params.get("chunked", False)),
            )
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"kv_transfer_params: a remote_* field has the wrong type ({e})") from None


@dataclass(frozen=True)
class LoadSpec:
    """Read one request's KV and state from its producer into these local blocks and state slot."""

    request_id: str
    block_ids: list[int]
    state_slot: int
    source: RemoteSource


@dataclass(frozen=True)
class KVConnectorMetadata:
    """The scheduler side's orders for one step."""

    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """What the worker side finished since its last report."""

    finished_recving: list[str] = field(default_factory=list)  # consumer: requests whose load completed
    failed_recving: dict[str, str] = field(default_factory=dict)  # consumer: request id -> why its load failed
    refused: set[str] = field(default_factory=set)  # of failed_recving: the layouts cannot pair (never recompute)
    loads_in_flight: int = 0
    num_ops: int = 0  # consumer: transfer descriptors posted since the last report (every rank's)
    num_staged_chunks: int = 0  # consumer: staged chunks read since the last report
    # consumer, chunked transfer: the producer's final kv_transfer_params of each finished load (its
    # first token and that token's logprobs, learnt at the end of the producer's prefill)
    remote_params: dict[str, dict] = field(default_factory=dict)

    def merge(self, other: KVConnectorOutput) -> None:
        self.finished_recving += other.finished_recving
        self.failed_recving.update(other.failed_recving)
        self.refused |= other.refused
        self.remote_params.update(other.remote_params)
        self.num_ops += other.num_ops
        self.num_staged_chunks += other.num_staged_chunks
        self.loads_in_flight = other.loads_in_flight


class KVOutputAggregator:
    """Joins the KVConnectorOutputs of an engine's ranks (the multi-process executor). Every rank
    reads its own share of a request, so the request's load is finished once every rank reported it
    finished, and failed once every rank reported it and one of them failed (no rank still writes
    into its blocks when the scheduler frees or reuses them)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._reports: dict[str, dict[int, str | None]] = {}  # request -> rank -> None (done) or why it failed
        self._refused: set[str] = set()
        self._remote_params: dict[str, dict] = {}
        self._num_ops = self._num_staged_chunks = 0
        self._in_flight: dict[int, int] = {}

    def add(self, rank: int, output: KVConnectorOutput | None) -> None:
        if output is None:
            return
        for request_id in output.finished_recving:
            self._reports.setdefault(request_id, {})[rank] = None
        for request_id, why in output.failed_recving.items():
            self._reports.setdefault(request_id, {})[rank] = f"rank {rank}: {why}"
        self._refused |= output.refused
        self._remote_params.update(output.remote_params)
        self._num_ops += output.num_ops
        self._num_staged_chunks += output.num_staged_chunks
        self._in_flight[rank] = output.loads_in_flight

    def take(self) -> KVConnectorOutput:
        """The requests every rank has reported since the last call."""
        out = KVConnectorOutput(loads_in_flight=max(self._in_flight.values(), default=0), num_ops=self._num_ops,
                                num_staged_chunks=self._num_staged_chunks)
        self._num_ops = self._num_staged_chunks = 0
        for request_id, reports in list(self._reports.items()):
            if len(reports) < self.world_size:
                continue
            del self._reports[request_id]
            failures = [why for why in reports.values() if why is not None]
            if failures:
                out.failed_recving[request_id] = "; ".join(failures)
                if request_id in self._refused:
                    out.refused.add(request_id)
            else:
                out.finished_recving.append(request_id)
                if request_id in self._remote_params:
                    out.remote_params[request_id] = self._remote_params[request_id]
            self._refused.discard(request_id)
            self._remote_params.pop(request_id, None)
        return out
