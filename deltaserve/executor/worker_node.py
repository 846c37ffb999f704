"""A worker node's launcher: `deltaserve serve|generate ... --nnodes N --node-rank R` with R > 0.

Runs on every node but the head, in the command's own process, and serves no HTTP. It joins the
head's nodes channel (`executor/node_monitor.py`), receives the head's configs, spawns this node's
ranks (global ranks R x ranks_per_node ...; each picks its GPU and NUMA node by its node-local index)
which join the head's torch.distributed world and its commands and replies channels, then watches
them:
- the head's shutdown: the ranks were told to stop; wait for them, say goodbye, exit 0;
- a rank's death: report it to the head (which raises RankFailedError naming it), stop the others,
  exit 1;
- the head silent for NODE_TIMEOUT_S (or aborting): stop the ranks, exit 1;
- SIGTERM / SIGINT: report it, stop the ranks, exit 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import time
from typing import Any

import zmq

from deltaserve.config.engine_config import EngineConfig
from deltaserve.distributed.placement import node_rank_devices, rank_local_index, ranks_of_node
from deltaserve.executor.node_monitor import HEARTBEAT_S, NODE_TIMEOUT_S, NodeLaunch
from deltaserve.executor.rank_process import RankLaunch, rank_main
from deltaserve.executor.transport import EndpointPlan, dumps

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # how long a worker node waits for the head to answer its hello
STOP_GRACE_S = 10.0  # how long ranks get to leave after the head's shutdown


def describe_exit(code: int | None) -> str:
    """How a process that is no longer alive ended."""
    if code is None:
        return "still running"
    if code < 0:
        return f"exit code {code} (killed by {signal.Signals(-code).name})"
    return f"exit code {code}"


class _WorkerNode:
    def __init__(self, config: EngineConfig) -> None:
        assert config.master_addr is not None and config.master_port is not None  # EngineConfig checks
        self.config, self.node_rank = config, config.node_rank
        self.endpoints = EndpointPlan.from_master(config.master_addr, config.master_port)
        self.ctx = zmq.Context()
        self.head = self.ctx.socket(zmq.DEALER)
        self.head.setsockopt(zmq.LINGER, 2000)
        self.head.connect(self.endpoints.nodes)
        self.processes: dict[int, Any] = {}
        self.signalled: str | None = None

    def send(self, *message: Any) -> None:
        self.head.send(dumps(message))

    def join(self) -> NodeLaunch:
        """Say hello and wait for the head's launch parameters (ValueError if refused or absent)."""
        c = self.config
        self.send("hello", self.node_rank, (c.tensor_parallel_size, c.pipeline_parallel_size, c.nnodes))
        logger.info("node %d of %d: joining the head at %s", self.node_rank, c.nnodes, self.endpoints.nodes)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while time.monotonic() < deadline and self.signalled is None:
            if self.head.poll(500):
                message = pickle.loads(self.head.recv())
                if message[0] == "launch":
                    return message[1]
                if message[0] == "refused":
                    raise ValueError(f"the head refused node {self.node_rank}: {message[1]}")
        raise ValueError(f"node {self.node_rank}: the head at {self.endpoints.nodes} did not answer "
                         f"(waited {JOIN_TIMEOUT_S:g} s, or stopped by {self.signalled})")

    def spawn(self, launch: NodeLaunch) -> None:
        c = launch.engine_config
        tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
        backend, devices = node_rank_devices(c.device, tp, pp, c.nnodes, self.node_rank, launch.backend)
        ctx = multiprocessing.get_context("spawn")
        ranks = ranks_of_node(self.node_rank, tp * pp, c.nnodes)
        threads = max(1, (os.cpu_count() or 1) // len(ranks))
        for rank in ranks:
            rank_launch = RankLaunch(rank, tp, pp, self.endpoints, backend, devices[rank],
                                     rank_local_index(rank, tp, pp, c.nnodes), threads, os.getpid(), self.node_rank,
                                     c, launch.model_config, launch.model_dir)
            proc = ctx.Process(target=rank_main, args=(rank_launch,), name=f"deltaserve-rank-{rank}", daemon=True)
            proc.start()
            self.processes[rank] = proc
        self.send("started", self.node_rank, {r: p.pid for r, p in self.processes.items()})
        logger.info("node %d: ranks %s started (pids %s)", self.node_rank, ", ".join(map(str, self.processes)),
                    ", ".join(str(p.pid) for p in self.processes.values()))

    def watch(self) -> int:
        """Heartbeats and the ranks' sentinels until the world ends; the exit code."""
        poller = zmq.Poller()
        poller.register(self.head, zmq.POLLIN)
        for proc in self.processes.values():
            poller.register(proc.sentinel, zmq.POLLIN)
        head_deadline = time.monotonic() + NODE_TIMEOUT_S
        next_beat = 0.0
        while True:
            poller.poll(int(HEARTBEAT_S * 250))
            now = time.monotonic()
            while self.head.poll(0):
                message = pickle.loads(self.head.recv())
                head_deadline = now + NODE_TIMEOUT_S
                if message[0] == "shutdown":
                    return self.finish()
                if message[0] == "abort":
                    logger.error("node %d: the head stopped the world: %s", self.node_rank, message[1])
                    return self.stop_ranks(1)
            exited = {r: p.exitcode for r, p in self.processes.items() if not p.is_alive()}
            if exited and all(code == 0 for code in exited.values()) and len(exited) == len(self.processes):
                return self.finish()  # every rank had its shutdown before this launcher did
            for rank, code in exited.items():
                if code != 0:
                    self.send("rank_died", self.node_rank, rank, self.processes[rank].pid, describe_exit(code))
                    logger.error("node %d: rank %d died: %s; stopping", self.node_rank, rank, describe_exit(code))
                    return self.stop_ranks(1)
            if self.signalled is not None:
                self.send("node_failed", self.node_rank, f"its launcher was stopped by {self.signalled}")
                return self.stop_ranks(1)
            if now > head_deadline:
                logger.error("node %d: the head at %s was not heard from for %g s; stopping", self.node_rank,
                             self.endpoints.nodes, NODE_TIMEOUT_S)
                return self.stop_ranks(1)
            if now >= next_beat:
                self.send("heartbeat", self.node_rank)
                next_beat = now + HEARTBEAT_S

    def finish(self) -> int:
        """The head shut down: the ranks were told; wait for them, say goodbye."""
        code = self.stop_ranks(0, grace_s=STOP_GRACE_S)
        self.send("bye", self.node_rank)
        logger.info("node %d: the head shut down; exiting", self.node_rank)
        return code

    def stop_ranks(self, code: int, grace_s: float = 0.0) -> int:
        deadline = time.monotonic() + grace_s
        for proc in self.processes.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.processes.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        return code

    def close(self) -> None:
        self.head.close()
        self.ctx.term()


def run_worker_node(config: EngineConfig) -> int:
    """The command of a worker node (node_rank > 0); returns its exit code."""
    if config.node_rank == 0:
        raise ValueError("node_rank=0 is the head: it runs the engine (deltaserve serve/generate), not a worker node")
    node = _WorkerNode(config)

    def on_signal(signum: int, _frame: Any) -> None:
        node.signalled = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        node.spawn(node.join())
        return node.watch()
    finally:
        node.stop_ranks(1)
        node.close()
