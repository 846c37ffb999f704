"""One rank of the multi-process executor: the process entry point and the messages it exchanges.

Runs in each rank process (global rank r of a tensor x pipeline grid), spawned by the launcher of its
node: the head's executor (`executor/multiproc.py`) or a worker node's (`executor/worker_node.py`).
At start it binds its CPUs (`numa_bind`, by the same node-local index that chose its GPU), joins the
world (`init_distributed`), loads its stage and shard, reports `RankReady`, then runs what the engine
sends, in order: the cache plan once, then every step. Every rank runs every step (so every
collective and every stage-to-stage send is matched); only the output rank (the last stage's TP rank
0) sends the step's `ModelRunnerOutput` back. A step is launched without waiting for the device: its
messages go out through the rank's outbox (`executor/rank_outbox.py`) once its output reaches the
host, while the rank already prepares the next step. An exception is sent back as text before the
process exits.

Messages travel over ZeroMQ (`executor/transport.py`): the engine's are pickled once and published
to every rank; a reader thread drains them into a queue, so the engine never blocks on a rank that is
busy in a collective, and leaves if this process's parent (its node's launcher) is gone.
Engine -> rank: ("sync", n), ("init_cache", plan, stage state specs), ("step", SchedulerOutput),
("shutdown",). Rank -> engine, each tagged with the rank: ("synced", n), ("ready", RankReady),
("cache_ready", (JointCheckpointSpec | None, RankLayout | None)), ("output", step_id,
ModelRunnerOutput, busy_s, steps) from the output rank, ("busy", busy_s, steps) after each step from
TP rank 0 of every other stage (busy_s: seconds the rank had a step in flight, from launching it to
its output on the host, overlapping steps counted once; steps: steps run; both since start), ("kv",
KVConnectorOutput) from any other rank whose P/D loads finished or failed in a step, ("offload",
OffloadOutput) from any other rank whose offload tier saved, loaded or counted something, and
("error", traceback text).
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.stage_specs import JointCheckpointSpec, joint_checkpoint_spec
from deltaserve.executor.rank_outbox import RankOutbox
from deltaserve.executor.transport import EndpointPlan, RankChannels
from deltaserve.worker.runner_output import AsyncModelRunnerOutput

SHUTDOWN = ("shutdown",)
OUTPUT_FAILED = "output_failed"  # put in the inbox by the outbox's thread: a step's output raised
ORPHAN_GRACE_S = 30.0  # after its launcher is gone, how long a rank may take to leave cleanly
INBOX_POLL_MS = 500  # how often the inbox thread checks that its launcher is still there


@dataclass(frozen=True)
class RankLaunch:
    """What one rank process is started with (pickled into the spawned process)."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    endpoints: EndpointPlan  # torch.distributed rendezvous and the engine's channels
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda:N", from placement.rank_local_index
    local_index: int  # placement.rank_local_index: picks the GPU and the numa_bind entry
    num_threads: int  # torch CPU threads of this rank
    parent_pid: int  # the node launcher that spawned it: when it is gone, the rank leaves
    node_rank: int
    engine_config: EngineConfig
    model_config: KimiLinearConfig
    model_dir: str

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class RankReady:
    """What a rank reports once its stage is loaded."""

    rank: int
    pp_rank: int
    tp_rank: int
    pid: int
    layer_range: tuple[int, int]  # [start, end) of the decoder layers its stage holds
    kv_spec: MLALatentSpec
    state_spec: KDAStateSpec
    cache_bytes: int
    device: str
    dtype: str
    node_rank: int = 0
    host: str = ""
    local_index: int = 0
    cpu_affinity: tuple[int, ...] = ()  # the CPUs it may run on, after numa_bind


def _read_inbox(channels: RankChannels, inbox: queue.Queue, parent_pid: int) -> None:
    """Reader thread: every message from the engine into `inbox`, in order. When the launcher that
    spawned this rank is gone (the engine died, or a worker node's launcher did) the rank is told to
    shut down, and leaves by force if it has not after ORPHAN_GRACE_S (it may be stuck in a
    collective with a dead peer)."""
    sub = channels.subscribe()
    try:
        while os.getppid() == parent_pid:
            if sub.poll(INBOX_POLL_MS):
                inbox.put(pickle.loads(sub.recv()))
    except zmq.ZMQError:
        pass
    inbox.put(SHUTDOWN)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def _check_checkpoint_spec(ready: RankReady, stage_specs: list[KDAStateSpec], unit_bytes: int,
                           ) -> JointCheckpointSpec:
    """This rank's view of the joint checkpoint spec; refused if the engine's stage list does not
    hold this stage's own KDA state spec (a rank built with another config or dtype)."""
    if stage_specs[ready.pp_rank] != ready.state_spec:
        raise ValueError(
            f"rank {ready.rank} (pipeline stage {ready.pp_rank}) holds KDA state {ready.state_spec}, but the "
            f"engine planned the stage as {stage_specs[ready.pp_rank]}; every rank must run the same model "
            "config and dtype"
        )
    return joint_checkpoint_spec(list(stage_specs), unit_bytes)


def _bind_cpus(launch: RankLaunch) -> None:
    """numa_bind: pin this process to the NUMA node of its local GPU index (the index that chose its
    device, so binding and placement cannot drift); on the CPU the index is used the same way."""
    numa_bind = launch.engine_config.numa_bind
    if numa_bind:
        from deltaserve.distributed.placement import apply_numa_binding, parse_numa_bind

        apply_numa_binding(launch.local_index, parse_numa_bind(numa_bind))


def rank_main(launch: RankLaunch) -> None:
    """Process entry point of global rank `launch.rank` (see the module docstring)."""
    import torch

    from deltaserve.distributed import destroy_distributed, init_distributed
    from deltaserve.distributed.parallel_state import parallel_config_for_rank
    from deltaserve.worker.worker import Worker

    # Ctrl-C reaches the whole process group: the engine decides when ranks stop (shutdown, or its
    # launcher going away), so a rank never dies of it mid-collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channels = RankChannels(launch.endpoints, launch.rank)
    inbox: queue.Queue = queue.Queue()
    outbox = RankOutbox(channels, on_failure=lambda text: inbox.put((OUTPUT_FAILED, text)))
    threading.Thread(target=_read_inbox, args=(channels, inbox, launch.parent_pid), name="rank-inbox",
                     daemon=True).start()
    try:
        _bind_cpus(launch)
        affinity = tuple(sorted(os.sched_getaffinity(0)))
        torch.set_num_threads(max(1, min(launch.num_threads, len(affinity))))
        device = torch.device(launch.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_method = launch.endpoints.rendezvous
        if init_method.startswith("tcp://127.0.0.1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dcp = launch.engine_config.decode_context_parallel_size
        parallel = parallel_config_for_rank(launch.tensor_parallel_size, launch.pipeline_parallel_size, launch.rank,
                                            decode_context_parallel_size=dcp,
                                            enable_expert_parallel=launch.engine_config.enable_expert_parallel)
        if launch.world_size > 1:
            init_distributed(launch.tensor_parallel_size, launch.pipeline_parallel_size, launch.rank,
                             launch.world_size, init_method, backend=launch.backend,
                             decode_context_parallel_size=dcp,
                             enable_expert_parallel=launch.engine_config.enable_expert_parallel)
        worker = Worker(launch.engine_config, launch.model_config, launch.model_dir, parallel=parallel, device=device)
        worker.load_model()
        kv_spec, state_spec = worker.cache_specs()
        ready = RankReady(launch.rank, parallel.pipeline_parallel_rank, parallel.tensor_parallel_rank, os.getpid(),
                          parallel.stage_layer_range(launch.model_config.num_hidden_layers), kv_spec, state_spec,
                          worker.available_cache_bytes(), str(worker.device),
                          str(worker.dtype).removeprefix("torch."), launch.node_rank, socket.gethostname(),
                          launch.local_index, affinity)
        outbox.send("ready", ready)
        is_output_rank = parallel.is_last_stage and parallel.tensor_parallel_rank == 0
        _serve(worker, ready, inbox, outbox, is_output_rank)
    except BaseException:
        try:
            outbox.send_error(traceback.format_exc())
        except zmq.ZMQError:
            pass
        raise SystemExit(1) from None
    finally:
        outbox.close()
        destroy_distributed()
        channels.close()


class _BusyClock:
    """A rank's busy time: the union of its steps' [launch, output on the host] intervals (steps end
    in launch order), and how many steps ended. Advanced by whichever thread sends a step's output,
    one at a time."""

    def __init__(self) -> None:
        self.busy_s, self.steps, self._last_end = 0.0, 0, 0.0

    def end_step(self, launched: float) -> tuple[float, int]:
        """A step launched at `launched` (perf_counter seconds) has its output now: the totals after it."""
        now = time.perf_counter()
        self.busy_s += now - max(launched, self._last_end)
        self.steps, self._last_end = self.steps + 1, now
        return self.busy_s, self.steps


def _step_messages(handle: AsyncModelRunnerOutput, step_id: int, launched: float, clock: _BusyClock,
                   is_output_rank: bool, reports_busy: bool) -> list[tuple[Any, ...]]:
    """What a rank sends for one step, once its output is on the host (waits for it)."""
    output = handle.get_output()
    busy_s, steps = clock.end_step(launched)
    if is_output_rank:  # its counters ride on the output: nothing else to wait for
        return [("output", step_id, output, busy_s, steps)]
    messages: list[tuple[Any, ...]] = []
    transfers = output.kv_connector_output  # P/D: this rank's share of the loads
    if transfers is not None and (transfers.finished_recving or transfers.failed_recving
                                  or transfers.num_ops or transfers.num_staged_chunks):
        messages.append(("kv", transfers))
    if output.offload_output is not None:  # the offload tier: this rank's saves and loads
        messages.append(("offload", output.offload_output))
    if reports_busy:
        messages.append(("busy", busy_s, steps))
    return messages


def _serve(worker: Any, ready: RankReady, inbox: queue.Queue, outbox: RankOutbox, is_output_rank: bool) -> None:
    """The rank's loop: run every message from the engine in order until told to shut down. A step
    is launched and left to the outbox, which sends its messages once its output is on the host."""
    clock = _BusyClock()
    while (message := inbox.get())[0] != "shutdown":
        kind = message[0]
        if kind == "step":
            scheduler_output = message[1]
            launched = time.perf_counter()
            handle = worker.execute_model(scheduler_output, non_block=True)
            if not isinstance(handle, AsyncModelRunnerOutput):
                handle = AsyncModelRunnerOutput.ready(handle)
            outbox.put(functools.partial(_step_messages, handle, scheduler_output.step_id, launched, clock,
                                         is_output_rank, ready.tp_rank == 0), ready=handle.is_ready)
        elif kind == "sync":
            outbox.send("synced", message[1])
        elif kind == "init_cache":
            plan: CachePlan = message[1]
            stage_specs: list[KDAStateSpec] = message[2]
            worker.initialize_cache(plan)
            joint = None
            if plan.num_checkpoint_units:
                joint = _check_checkpoint_spec(ready, stage_specs, plan.checkpoint_unit_bytes)
            outbox.send("cache_ready", (joint, worker.kv_layout()))
        elif kind == OUTPUT_FAILED:
            raise RuntimeError(f"rank {ready.rank}: a step's output failed on its way to the host:\n{message[1]}")
        else:
            raise ValueError(f"rank {ready.rank}: unknown message {kind!r} from the engine")
