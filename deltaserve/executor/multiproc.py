"""The multi-process executor ("mp"): one process per rank of the tensor x pipeline grid.

Runs in the engine's process. It spawns world_size = tensor_parallel_size x pipeline_parallel_size
rank processes (`executor/rank_process.py`), each joining one torch.distributed world: gloo on the CPU,
NCCL on CUDA with one GPU per rank (picked by `placement.local_device_index`); ranks that must share a
GPU run gloo with their tensors staged through host memory (for correctness only). Global ranks are
TP-innermost: rank = pp_rank x tp_size + tp_rank.

Each step's SchedulerOutput is pickled once and written to every rank's pipe; every rank runs it, and
only the output rank (last stage, TP rank 0) answers with the ModelRunnerOutput. `execute_model` with
non_block returns at once: several steps may be in flight through the pipeline, and their outputs are
resolved in order. A rank that dies (or raises) is noticed while the engine waits (its process
sentinel, or its error message) and the executor raises `RankFailedError` naming the rank, its stage,
its TP rank and its exit code; it never waits on a dead rank.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.core.stage_specs import JointCheckpointSpec, check_agreement, check_stages_have_kda
from deltaserve.distributed.placement import local_device_index
from deltaserve.executor.base import Executor, register_executor
from deltaserve.executor.rank_process import RankLaunch, RankReady, rank_main
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often a wait re-checks that it still has work to wait for
SHUTDOWN_GRACE_S = 10.0


class RankFailedError(RuntimeError):
    """A rank process died or raised; the engine cannot go on without it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_devices(device: str | None, tp: int, pp: int) -> tuple[str, list[str]]:
    """(backend, device of each global rank): gloo on the CPU; on CUDA NCCL with GPU
    `local_device_index(pp_rank, tp_rank, tp)` per rank, or, with fewer GPUs than ranks, gloo with
    every rank on GPU 0 (tensors staged through host memory, for tests only)."""
    import torch

    kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
    world = tp * pp
    if kind == "cpu":
        return "gloo", ["cpu"] * world
    if kind != "cuda":
        raise ValueError(f"device={device!r}: the multi-process executor runs on 'cpu' or 'cuda'")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    if count < world:
        logger.warning("%d ranks share %d GPU(s): NCCL refuses that, so they run gloo with tensors staged "
                       "through host memory (correct, slow: for tests only)", world, count)
        return "gloo", ["cuda:0"] * world
    return "nccl", [f"cuda:{local_device_index(r // tp, r % tp, tp, gpus_on_node=count)}" for r in range(world)]


class _Rank:
    """The engine's handle on one rank process: its pipes and its place in the grid."""

    def __init__(self, process: Any, to_rank: Connection, from_rank: Connection, rank: int, tp: int) -> None:
        self.process, self.to_rank, self.from_rank = process, to_rank, from_rank
        self.rank, self.pp_rank, self.tp_rank = rank, rank // tp, rank % tp

    def describe(self) -> str:
        return f"rank {self.rank} (pp_rank {self.pp_rank}, tp_rank {self.tp_rank}, pid {self.process.pid})"


@register_executor("mp")
class MultiprocExecutor(Executor):
    def __init__(self, engine_config: EngineConfig, model_config: KimiLinearConfig, model_dir: str,
                 model: Any = None) -> None:
        if model is not None:
            raise ValueError("a model built in this process cannot be shared with rank processes: give "
                             "tensor_parallel_size=pipeline_parallel_size=1, or a model path")
        parallel = engine_config.parallel
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.tp, self.pp, self.world_size = tp, pp, tp * pp
        self.layouts = check_stages_have_kda(model_config, pp)  # refused before anything starts
        backend, devices = rank_devices(engine_config.device, tp, pp)
        self._ranks: list[_Rank] = []
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._queued: deque[int] = deque()  # step ids sent, not yet answered
        self._failed: str | None = None
        self._closed = False
        ctx = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        threads = max(1, (os.cpu_count() or 1) // self.world_size)
        try:
            for rank in range(self.world_size):
                launch = RankLaunch(rank, tp, pp, init_method, backend, devices[rank], threads, engine_config,
                                    model_config, model_dir)
                rank_reads, engine_writes = ctx.Pipe(duplex=False)
                engine_reads, rank_writes = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=rank_main, args=(launch, rank_reads, rank_writes),
                                   name=f"deltaserve-rank-{rank}", daemon=True)
                proc.start()
                rank_reads.close()
                rank_writes.close()
                self._ranks.append(_Rank(proc, engine_writes, engine_reads, rank, tp))
            self.ready: list[RankReady] = self._gather("ready")
        except RankFailedError as e:
            raise RankFailedError(
                f"{e}; while starting (ranks are spawned: a script that builds the engine with several ranks "
                "must do so under `if __name__ == '__main__':`)") from e
        except BaseException:
            self.shutdown()
            raise
        self._log_grid(backend)

    # Setup -----------------------------------------------------------------------------------
    def _log_grid(self, backend: str) -> None:
        stages = "; ".join(
            f"stage {s.pp_rank}: layers [{s.start}, {s.end}) ({s.num_kda_layers} KDA, {s.num_mla_layers} MLA)"
            for s in self.layouts)
        logger.info("multi-process executor: tensor_parallel_size=%d x pipeline_parallel_size=%d (%s, devices %s); %s",
                    self.tp, self.pp, backend, ", ".join(r.device for r in self.ready), stages)

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
        views = dict(enumerate(self._gather("cache_ready")))
        if checkpoint_spec is None:
            return
        for rank in self._ranks:
            view = views[rank.rank]
            if view is None:
                raise ValueError(f"{rank.describe()} allocated no checkpoint units, but the engine planned "
                                 f"{plan.num_checkpoint_units}")
            check_agreement(checkpoint_spec, {rank.pp_rank: view})

    @property
    def device_name(self) -> str:
        return self.ready[-self.tp].device  # the output rank: last stage, TP rank 0

    @property
    def dtype_name(self) -> str:
        return self.ready[0].dtype

    def rank_pids(self) -> list[int]:
        """The process id of each global rank (for tests and operators)."""
        return [r.process.pid for r in self._ranks]

    # Steps -----------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step_id = scheduler_output.step_id
        self._broadcast(("step", scheduler_output))
        self._queued.append(step_id)
        handle = AsyncModelRunnerOutput(lambda: self._wait_output(step_id))
        return handle if non_block else handle.get_output()

    def _broadcast(self, message: tuple) -> None:
        """Send `message` to every rank (pickled once), in rank order."""
        self._check_usable()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in self._ranks:
            try:
                rank.to_rank.send_bytes(data)
            except OSError:
                self._fail(self._death_of(rank))

    def _wait_output(self, step_id: int) -> ModelRunnerOutput:
        output_rank = self._ranks[-self.tp]
        while step_id not in self._outputs:
            _, message = self._receive({output_rank.rank})
            if message[0] != "output":
                self._fail(f"{output_rank.describe()} sent {message[0]!r} while the engine waited for a step")
            self._outputs[message[1]] = message[2]
        if self._queued and self._queued[0] == step_id:
            self._queued.popleft()
        return self._outputs.pop(step_id)

    def _gather(self, kind: str) -> list[Any]:
        """One `kind` reply from every rank (in any order); returns their payloads by global rank."""
        replies: dict[int, Any] = {}
        while len(replies) < self.world_size:
            rank, message = self._receive(set(range(self.world_size)) - set(replies))
            if message[0] != kind:
                self._fail(f"{rank.describe()} sent {message[0]!r}, expected {kind!r}")
            replies[rank.rank] = message[1]
        return [replies[r] for r in range(self.world_size)]

    def _receive(self, wanted: set[int]) -> tuple[_Rank, tuple]:
        """(rank, its next message) from one of the ranks in `wanted`. Meanwhile any rank's error
        message or death fails the executor (RankFailedError naming it): nothing waits on a dead rank."""
        self._check_usable()
        by_conn = {r.from_rank: r for r in self._ranks}
        by_sentinel = {r.process.sentinel: r for r in self._ranks}
        while True:
            ready = wait(list(by_conn) + list(by_sentinel), timeout=POLL_S)
            for obj in sorted(ready, key=lambda o: o not in by_conn):  # messages first: an error's traceback
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        message = obj.recv()
                    except (EOFError, OSError):
                        self._fail(self._death_of(rank))
                    if message[0] == "error":
                        self._fail(f"{rank.describe()} failed:\n{message[1]}")
                    if rank.rank in wanted:
                        return rank, message
                    self._fail(f"{rank.describe()} sent an unexpected {message[0]!r}")
                else:
                    self._fail(self._death_of(by_sentinel[obj]))

    def _death_of(self, rank: _Rank) -> str:
        rank.process.join(timeout=1.0)
        code = rank.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how += f" (killed by {signal.Signals(-code).name})"
        elif code is None:
            how = "its pipe closed while it still runs"
        return f"{rank.describe()} died: {how}"

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
        """Stop every rank: ask, wait up to SHUTDOWN_GRACE_S, then kill what is left. Idempotent."""
        if self._closed:
            return
        self._closed = True
        data = pickle.dumps(("shutdown",))
        for rank in self._ranks:
            try:
                if self._failed is None and rank.process.is_alive():
                    rank.to_rank.send_bytes(data)
            except OSError:
                pass
        grace = SHUTDOWN_GRACE_S if self._failed is None else 0.0  # peers of a dead rank may hang
        for rank in self._ranks:
            rank.process.join(timeout=grace)
        for rank in self._ranks:
            if rank.process.is_alive():
                rank.process.kill()
                rank.process.join(timeout=5.0)
            rank.to_rank.close()
            rank.from_rank.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass
