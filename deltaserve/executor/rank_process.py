"""One rank of the multi-process executor: the process entry point and the messages it exchanges.

Runs in each rank process (global rank r of a tensor x pipeline grid). It joins the world
(`init_distributed`), loads its stage and shard, reports `RankReady`, then runs what the engine sends,
in order: the cache plan once, then every step. Every rank runs every step (so every collective and
every stage-to-stage send is matched); only the output rank (the last stage's TP rank 0) sends the
step's `ModelRunnerOutput` back. An exception is sent back as text before the process exits.

Messages from the engine are pickled once and sent as bytes to every rank over one pipe per rank; a
reader thread drains that pipe into a queue, so the engine never blocks on a rank that is busy in a
collective. Engine -> rank: ("init_cache", plan, stage state specs), ("step", SchedulerOutput),
("shutdown",). Rank -> engine: ("ready", RankReady), ("cache_ready", JointCheckpointSpec | None),
("output", step_id, ModelRunnerOutput), ("error", traceback text).
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.stage_specs import JointCheckpointSpec, joint_checkpoint_spec

SHUTDOWN = ("shutdown",)
ORPHAN_GRACE_S = 30.0  # after the engine's pipe closes, how long a rank may take to leave cleanly


@dataclass(frozen=True)
class RankLaunch:
    """What one rank process is started with (pickled into the spawned process)."""

    rank: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    init_method: str  # torch.distributed rendezvous, e.g. "tcp://127.0.0.1:29500"
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda:N", from placement.local_device_index
    num_threads: int  # torch CPU threads of this rank
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


def _read_inbox(conn: Connection, inbox: queue.Queue) -> None:
    """Reader thread: every message from the engine into `inbox`, in order. When the engine's end
    closes (a normal shutdown, or the engine died) the rank is told to shut down, and leaves by force
    if it has not after ORPHAN_GRACE_S (it may be stuck in a collective with a dead peer)."""
    try:
        while True:
            inbox.put(pickle.loads(conn.recv_bytes()))
    except (EOFError, OSError):
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


def rank_main(launch: RankLaunch, from_engine: Connection, to_engine: Connection) -> None:
    """Process entry point of global rank `launch.rank` (see the module docstring)."""
    import torch

    from deltaserve.distributed import destroy_distributed, init_distributed
    from deltaserve.distributed.parallel_state import parallel_config_for_rank
    from deltaserve.worker.worker import Worker

    # Ctrl-C reaches the whole process group: the engine decides when ranks stop (shutdown, or its
    # pipe closing), so a rank never dies of it mid-collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_inbox, args=(from_engine, inbox), name="rank-inbox", daemon=True).start()
    try:
        torch.set_num_threads(launch.num_threads)
        device = torch.device(launch.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if launch.init_method.startswith("tcp://127.0.0.1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        parallel = parallel_config_for_rank(launch.tensor_parallel_size, launch.pipeline_parallel_size, launch.rank)
        if launch.world_size > 1:
            init_distributed(launch.tensor_parallel_size, launch.pipeline_parallel_size, launch.rank,
                             launch.world_size, launch.init_method, backend=launch.backend)
        worker = Worker(launch.engine_config, launch.model_config, launch.model_dir, parallel=parallel, device=device)
        worker.load_model()
        kv_spec, state_spec = worker.cache_specs()
        ready = RankReady(launch.rank, parallel.pipeline_parallel_rank, parallel.tensor_parallel_rank, os.getpid(),
                          parallel.stage_layer_range(launch.model_config.num_hidden_layers), kv_spec, state_spec,
                          worker.available_cache_bytes(), str(worker.device),
                          str(worker.dtype).removeprefix("torch."))
        to_engine.send(("ready", ready))
        is_output_rank = parallel.is_last_stage and parallel.tensor_parallel_rank == 0
        _serve(worker, ready, inbox, to_engine, is_output_rank)
    except BaseException:
        try:
            to_engine.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        destroy_distributed()


def _serve(worker: Any, ready: RankReady, inbox: queue.Queue, to_engine: Connection, is_output_rank: bool) -> None:
    """The rank's loop: run every message from the engine in order until told to shut down."""
    while (message := inbox.get())[0] != "shutdown":
        kind = message[0]
        if kind == "step":
            scheduler_output = message[1]
            output = worker.execute_model(scheduler_output)
            if is_output_rank:
                to_engine.send(("output", scheduler_output.step_id, output))
        elif kind == "init_cache":
            plan: CachePlan = message[1]
            stage_specs: list[KDAStateSpec] = message[2]
            worker.initialize_cache(plan)
            joint = None
            if plan.num_checkpoint_units:
                joint = _check_checkpoint_spec(ready, stage_specs, plan.checkpoint_unit_bytes)
            to_engine.send(("cache_ready", joint))
        else:
            raise ValueError(f"rank {ready.rank}: unknown message {kind!r} from the engine")
