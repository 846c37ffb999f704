"""The multi-process executor ("mp"): one process per rank of the tensor x pipeline grid, on one or
several nodes.

Runs in the engine's process (the head node, node_rank 0). World_size = tensor_parallel_size x
pipeline_parallel_size ranks (`executor/rank_process.py`) join one torch.distributed world: gloo on
the CPU, NCCL on CUDA with one GPU per rank (picked by `placement.rank_local_index`, which also picks
the rank's `numa_bind` entry); ranks that must share a GPU run gloo with their tensors staged through
host memory (for correctness only). Global ranks are TP-innermost: rank = pp_rank x tp_size + tp_rank.
With nnodes > 1 each node runs world_size / nnodes consecutive ranks: the head spawns its own, and
every other node's launcher (`executor/worker_node.py`) spawns that node's.

The engine talks to every rank over ZeroMQ (`executor/transport.py`): each step's SchedulerOutput is
pickled once and published to every rank; every rank runs it, and only the output rank (last stage,
TP rank 0) answers with the ModelRunnerOutput (and its busy time; TP rank 0 of each other stage sends
its own after each step). `execute_model` with non_block returns at once: several steps may be in
flight through the pipeline, and their outputs are resolved in order.

Failures are noticed while the engine waits and raised as `RankFailedError` naming the rank (and its
node), never waited on: a local rank's death by its process sentinel, a rank's exception by its
error message, a worker node's rank death or the node's silence by the node monitor
(`executor/node_monitor.py`). A rank's error waits ROOT_CAUSE_GRACE_S for a death elsewhere, so the
message names the rank that died rather than the peer whose collective broke.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import time
from typing import Any

import zmq

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.core.stage_specs import JointCheckpointSpec, check_agreement, check_stages_have_kda
from deltaserve.distributed.placement import node_of_rank, node_rank_devices, rank_local_index, ranks_of_node
from deltaserve.executor.base import Executor, register_executor
from deltaserve.executor.node_monitor import PROBE_S, NodeLaunch, NodeMonitor
from deltaserve.executor.rank_process import RankLaunch, RankReady, rank_main
from deltaserve.executor.transport import EndpointPlan, EngineChannels
from deltaserve.executor.worker_node import describe_exit
from deltaserve.kv_transfer.metadata import KVOutputAggregator
from deltaserve.offload.metadata import OffloadOutputAggregator
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a wait re-checks that it still has work to wait for
SYNC_INTERVAL_S = 0.1  # how often "sync" is republished until every rank has answered
SHUTDOWN_GRACE_S = 10.0
DEATH_DRAIN_S = 0.3  # after a rank's death, how long its last message (a traceback) may take to arrive
ROOT_CAUSE_GRACE_S = 0.5  # after a rank's error, how long to look for a death elsewhere (+ PROBE_S multi-node)


class RankFailedError(RuntimeError):
    """A rank process died or raised; the engine cannot go on without it."""


class _Rank:
    """The engine's handle on one rank: its place in the grid, its node, and (on the head) its process."""

    def __init__(self, rank: int, tp: int, node_rank: int, nnodes: int, process: Any = None) -> None:
        self.rank, self.pp_rank, self.tp_rank = rank, rank // tp, rank % tp
        self.node_rank, self.nnodes, self.process = node_rank, nnodes, process
        self.pid: int | None = process.pid if process is not None else None

    def describe(self) -> str:
        node = f", node {self.node_rank}" if self.nnodes > 1 else ""
        return f"rank {self.rank} (pp_rank {self.pp_rank}, tp_rank {self.tp_rank}{node}, pid {self.pid or '?'})"


@register_executor("mp")
class MultiprocExecutor(Executor):
    def __init__(self, engine_config: EngineConfig, model_config: KimiLinearConfig, model_dir: str,
                 model: Any = None) -> None:
        if model is not None:
            raise ValueError("a model built in this process cannot be shared with rank processes: give "
                             "tensor_parallel_size=pipeline_parallel_size=1, or a model path")
        if engine_config.node_rank != 0:
            raise ValueError(f"node_rank={engine_config.node_rank}: only the head (node_rank 0) runs the engine; "
                             "a worker node runs `deltaserve serve ... --node-rank N` (executor/worker_node.py)")
        tp, pp, nnodes = engine_config.tensor_parallel_size, engine_config.pipeline_parallel_size, engine_config.nnodes
        self.tp, self.pp, self.nnodes, self.world_size = tp, pp, nnodes, tp * pp
        self.layouts = check_stages_have_kda(model_config, pp)  # refused before anything starts
        backend, devices = node_rank_devices(engine_config.device, tp, pp, nnodes, 0)
        self.backend, self.numa_bind = backend, engine_config.numa_bind
        self._ranks = [_Rank(r, tp, node_of_rank(r, self.world_size, nnodes), nnodes) for r in range(self.world_size)]
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._replies: dict[str, dict[int, Any]] = {}  # kind -> rank -> payload, for _gather
        self._stage_busy = [(0.0, 0)] * pp  # (busy seconds, steps) of each stage's reporting rank
        self._sync_token, self._synced = 0, set()
        self._failed: str | None = None
        self._closed = False
        self._kv_layouts: list[Any] = []  # P/D: each rank's registered caches, once allocated
        self._kv_outputs = KVOutputAggregator(self.world_size) if engine_config.kv_transfer_config else None
        self._offload_outputs = OffloadOutputAggregator(self.world_size) if engine_config.offloading_enabled else None
        self._monitor: NodeMonitor | None = None
        port = engine_config.master_port
        endpoints = (EndpointPlan.from_master(engine_config.master_addr or "127.0.0.1", port) if port is not None
                     else EndpointPlan.local())
        self.channels = EngineChannels(endpoints)
        self._poller = zmq.Poller()
        try:
            if nnodes > 1:
                launch = NodeLaunch(engine_config, model_config, model_dir, backend)
                self._monitor = NodeMonitor(endpoints, launch, tp, pp, nnodes)
            local = ranks_of_node(0, self.world_size, nnodes)
            ctx = multiprocessing.get_context("spawn")
            threads = max(1, (os.cpu_count() or 1) // len(local))
            for rank in local:
                launch = RankLaunch(rank, tp, pp, endpoints, backend, devices[rank],
                                    rank_local_index(rank, tp, pp, nnodes), threads, os.getpid(), 0, engine_config,
                                    model_config, model_dir)
                proc = ctx.Process(target=rank_main, args=(launch,), name=f"deltaserve-rank-{rank}", daemon=True)
                proc.start()
                self._ranks[rank].process, self._ranks[rank].pid = proc, proc.pid
                self._poller.register(proc.sentinel, zmq.POLLIN)
            self._poller.register(self.channels.replies, zmq.POLLIN)
            if nnodes > 1:
                logger.info("multi-process executor: waiting for %d worker node(s) at %s", nnodes - 1,
                            endpoints.nodes)
            self.ready: list[RankReady] = self._gather("ready")
            for r in self.ready:
                self._ranks[r.rank].pid = r.pid
            self._sync()
        except RankFailedError as e:
            raise RankFailedError(
                f"{e}; while starting (ranks are spawned: a script that builds the engine with several ranks "
                "must do so under `if __name__ == '__main__':`)") from e
        except BaseException:
            self.shutdown()
            raise
        self._log_grid()

    # Setup -----------------------------------------------------------------------------------
    def _log_grid(self) -> None:
        stages = "; ".join(
            f"stage {s.pp_rank}: layers [{s.start}, {s.end}) ({s.num_kda_layers} KDA, {s.num_mla_layers} MLA)"
            for s in self.layouts)
        nodes = []
        for node in range(self.nnodes):
            members = [r for r in self.ready if r.node_rank == node]
            placed = ", ".join(f"rank {r.rank} on {r.device}" + (f" cpus {_cpulist(r.cpu_affinity)}" if self.numa_bind
                                                                  else "") for r in members)
            nodes.append(f"node {node} ({members[0].host}): {placed}")
        logger.info("multi-process executor: tensor_parallel_size=%d x pipeline_parallel_size=%d over %d node(s) (%s, "
                    "devices %s); %s; %s", self.tp, self.pp, self.nnodes, self.backend,
                    ", ".join(r.device for r in self.ready), stages, "; ".join(nodes))

    def _sync(self) -> None:
        """Publish "sync" until every rank has answered one: from then on no rank misses a command
        (a PUB drops what it sends before a subscriber's subscription has arrived)."""
        self._sync_token += 1
        self._synced = set()
        while len(self._synced) < self.world_size:
            self.channels.broadcast(("sync", self._sync_token))
            deadline = time.monotonic() + SYNC_INTERVAL_S
            while len(self._synced) < self.world_size and (left := deadline - time.monotonic()) > 0:
                self._pump(left)

    def _stage_ready(self) -> list[list[RankReady]]:
        return [self.ready[p * self.tp:(p + 1) * self.tp] for p in range(self.pp)]

    def stage_cache_specs(self) -> list[tuple[MLALatentSpec, KDAStateSpec]]:
        specs = []
        for stage in self._stage_ready():
            first = stage[0]
            for other in stage[1:]:
                if (other.kv_spec, other.state_spec) != (first.kv_spec, first.state_spec):
                    raise ValueError(f"rank {other.rank} and rank {first.rank} of pipeline stage {first.pp_rank} "
                                     "report different cache specs; every TP rank of a stage holds the same shapes")
            specs.append((first.kv_spec, first.state_spec))
        return specs

    def stage_cache_bytes(self) -> list[int]:
        return [min(r.cache_bytes for r in stage) for stage in self._stage_ready()]

    def initialize_cache(self, plan: CachePlan, checkpoint_spec: JointCheckpointSpec | None = None) -> None:
        """Every rank allocates `plan` and reports its view of the joint checkpoint spec; every view must
        equal `checkpoint_spec` (the engine's), else ValueError naming the stage."""
        self._broadcast(("init_cache", plan, [state for _, state in self.stage_cache_specs()]))
        replies = self._gather("cache_ready")
        views = {rank: view for rank, (view, _) in enumerate(replies)}
        self._kv_layouts = [layout for _, layout in replies if layout is not None]
        if checkpoint_spec is None:
            return
        for rank in self._ranks:
            view = views[rank.rank]
            if view is None:
                raise ValueError(f"{rank.describe()} allocated no checkpoint units, but the engine planned "
                                 f"{plan.num_checkpoint_units}")
            check_agreement(checkpoint_spec, {rank.pp_rank: view})

    def kv_layouts(self) -> list[Any]:
        return list(self._kv_layouts)

    @property
    def device_name(self) -> str:
        return self.ready[-self.tp].device  # the output rank: last stage, TP rank 0

    @property
    def dtype_name(self) -> str:
        return self.ready[0].dtype

    def rank_pids(self) -> list[int]:
        """The process id of each global rank, on whichever node it runs (for tests and operators)."""
        return [r.pid for r in self._ranks]

    def metrics(self) -> dict[str, Any]:
        """Each stage's busy seconds (inside `worker.execute_model`) and steps run, as last reported."""
        if self._failed is None and not self._closed:
            while self._pump(0.0):  # what the ranks have sent since the last wait
                pass
        return {"nnodes": self.nnodes, "stage_busy_seconds": [b for b, _ in self._stage_busy],
                "stage_steps": [n for _, n in self._stage_busy]}

    # Steps -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step_id = scheduler_output.step_id
        self._broadcast(("step", scheduler_output))
        handle = AsyncModelRunnerOutput(lambda: self._wait_output(step_id))
        return handle if non_block else handle.get_output()

    def _broadcast(self, message: tuple) -> None:
        """Send `message` to every rank (pickled once)."""
        self._check_usable()
        self.channels.broadcast(message)

    def _wait_output(self, step_id: int) -> ModelRunnerOutput:
        while step_id not in self._outputs:
            self._pump(POLL_S)
        return self._outputs.pop(step_id)

    def _gather(self, kind: str) -> list[Any]:
        """One `kind` reply from every rank (in any order); returns their payloads by global rank."""
        replies = self._replies.setdefault(kind, {})
        while len(replies) < self.world_size:
            self._pump(POLL_S)
        del self._replies[kind]
        return [replies[r] for r in range(self.world_size)]

    def _pump(self, timeout_s: float) -> bool:
        """Handle the next reply, waiting up to `timeout_s` for one; a local rank's death meanwhile
        fails the executor (RankFailedError naming it). Returns whether a reply was handled."""
        self._check_usable()
        reply = self.channels.receive()
        if reply is None:
            events = dict(self._poller.poll(int(timeout_s * 1000)))
            reply = self.channels.receive()
            if reply is None:
                for rank in self._ranks:
                    if rank.process is not None and rank.process.sentinel in events:
                        self._fail_death(rank)
                return False
        self._dispatch(*reply)
        return True

    def _dispatch(self, sender: int, kind: str, payload: tuple) -> None:
        if kind == "error":
            self._fail_error(self._ranks[sender], payload[0])
        elif kind == "failed":  # from the node monitor
            self._fail(payload[0])
        elif kind == "output":
            step_id, output, busy_s, steps = payload
            if self._kv_outputs is not None:  # P/D: a load is done once every rank has done its share
                self._kv_outputs.add(sender, output.kv_connector_output)
                output = dataclasses.replace(output, kv_connector_output=self._kv_outputs.take())
            if self._offload_outputs is not None:  # the offload tier: a save or load is done on every rank
                self._offload_outputs.add(sender, output.offload_output)
                output = dataclasses.replace(output, offload_output=self._offload_outputs.take())
            self._outputs[step_id] = output
            self._stage_busy[self.pp - 1] = (busy_s, steps)
        elif kind == "kv" and self._kv_outputs is not None:
            self._kv_outputs.add(sender, payload[0])
        elif kind == "offload" and self._offload_outputs is not None:
            self._offload_outputs.add(sender, payload[0])
        elif kind == "busy":
            self._stage_busy[sender // self.tp] = payload
        elif kind == "synced":
            if payload[0] == self._sync_token:
                self._synced.add(sender)
        elif kind in self._replies:
            self._replies[kind][sender] = payload[0]
        else:
            self._fail(f"{self._ranks[sender].describe()} sent an unexpected {kind!r}")

    # Failures --------------------------------------------------------------------------------
    def _fail_death(self, rank: _Rank) -> None:
        """A local rank died: its traceback if it sent one, else how it ended."""
        reason = f"{rank.describe()} died: {self._exit_of(rank)}"
        deadline = time.monotonic() + DEATH_DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            reply = self.channels.receive()
            if reply is None:
                self.channels.replies.poll(int(left * 1000))
                continue
            sender, kind, payload = reply
            if sender == rank.rank and kind == "error":
                reason += f":\n{payload[0]}"
                break
        self._fail(reason)

    def _fail_error(self, rank: _Rank, text: str) -> None:
        """A rank raised. If another rank died (or a worker node was lost), that is the cause: a
        collective with a dead peer breaks on every rank; wait briefly for it to show."""
        grace = ROOT_CAUSE_GRACE_S + (PROBE_S + 1.0 if self.nnodes > 1 else 0.0)
        deadline = time.monotonic() + grace
        while (left := deadline - time.monotonic()) > 0:
            events = dict(self._poller.poll(int(left * 1000)))
            for other in self._ranks:
                if other is not rank and other.process is not None and other.process.sentinel in events:
                    self._fail(f"{other.describe()} died: {self._exit_of(other)}; then {rank.describe()} failed: "
                               f"{_last_line(text)}")
            while (reply := self.channels.receive()) is not None:
                if reply[1] == "failed":
                    self._fail(f"{reply[2][0]}; then {rank.describe()} failed: {_last_line(text)}")
        self._fail(f"{rank.describe()} failed:\n{text}")

    @staticmethod
    def _exit_of(rank: _Rank) -> str:
        rank.process.join(timeout=1.0)
        return describe_exit(rank.process.exitcode)

    def _fail(self, reason: str) -> None:
        self._failed = reason
        self.shutdown()
        raise RankFailedError(f"the multi-process executor stopped: {reason}")

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RankFailedError(f"the multi-process executor stopped earlier: {self._failed}")
        if self._closed:
            raise RankFailedError("the multi-process executor was shut down")

    # Shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every rank: ask, wait up to SHUTDOWN_GRACE_S, then kill what is left of the head's;
        worker nodes are told to stop theirs (and abort them after a failure). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None:
            self.channels.broadcast(("shutdown",))
        grace = SHUTDOWN_GRACE_S if self._failed is None else 0.0  # peers of a dead rank may hang
        local = [r.process for r in self._ranks if r.process is not None]
        deadline = time.monotonic() + grace
        for proc in local:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in local:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        if self._monitor is not None:
            self._monitor.stop(abort_reason=self._failed)
        self.channels.close(linger_ms=1000 if self._failed is None else 0)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _cpulist(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5" (sorted CPUs)."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)
