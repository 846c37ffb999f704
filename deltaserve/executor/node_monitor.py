"""The head's side of the nodes channel: worker nodes join, stay alive, and report their ranks' deaths.

Runs in a thread of the head's engine process (one `NodeMonitor` per multi-node executor). Each
worker node's launcher (`executor/worker_node.py`) connects a DEALER to the head's ROUTER on
master_port + 3 and says hello; the monitor answers with the `NodeLaunch` (the head's configs, so
every node runs the same model) and from then on both sides send a heartbeat every HEARTBEAT_S.

The monitor turns what it learns into a ("failed", text) reply on the executor's replies channel
(tagged rank -1), which the executor raises as `RankFailedError`:
- a rank of a worker node died (its launcher watches its children's sentinels);
- a node went silent for NODE_TIMEOUT_S (host lost, network cut, launcher frozen); when a node's
  connection drops (the process was killed) every node must be heard from within PROBE_S, so a
  killed node is noticed in seconds rather than after the full timeout;
- a node that joins with another world shape, or twice, is refused.

Node -> head: ("hello", node_rank, (tp, pp, nnodes)), ("started", node_rank, {rank: pid}),
("heartbeat", node_rank), ("rank_died", node_rank, rank, pid, how), ("node_failed", node_rank, text),
("bye", node_rank). Head -> node: ("launch", NodeLaunch), ("refused", text), ("heartbeat",),
("shutdown",) (every rank was told to stop: wait for them, then exit 0), ("abort", reason) (the
world failed: kill the ranks, exit 1).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.distributed.placement import ranks_of_node
from deltaserve.executor.transport import EndpointPlan, dumps

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # both ways, between the head and every worker node
NODE_TIMEOUT_S = 10.0  # a node (or the head) not heard from for this long is gone
PROBE_S = 3.0  # after a dropped connection, how soon every node must be heard from again
BYE_GRACE_S = 15.0  # at shutdown, how long the head waits for each node's goodbye


@dataclass(frozen=True)
class NodeLaunch:
    """What the head hands a worker node: the configs its ranks run (the head's, so all agree)."""

    engine_config: EngineConfig
    model_config: KimiLinearConfig
    model_dir: str
    backend: str  # the head's choice ("gloo" or "nccl"); every node follows it


def describe_node(node_rank: int, world_size: int, nnodes: int) -> str:
    ranks = ranks_of_node(node_rank, world_size, nnodes)
    which = f"rank {ranks.start}" if len(ranks) == 1 else f"ranks {ranks.start}-{ranks.stop - 1}"
    return f"node {node_rank} ({which})"


class NodeMonitor:
    """Watches the worker nodes of one world from a thread of the head's engine process."""

    def __init__(self, endpoints: EndpointPlan, launch: NodeLaunch, tp: int, pp: int, nnodes: int) -> None:
        self.launch, self.shape, self.nnodes, self.world_size = launch, (tp, pp, nnodes), nnodes, tp * pp
        self.rank_pids: dict[int, int] = {}  # ranks of worker nodes, as their launchers report them
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 1000)
        try:
            self._router.bind(endpoints.nodes)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(f"cannot listen for worker nodes on {endpoints.nodes} ({e}); choose another "
                             "master_port") from None
        self._events = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._report = self._ctx.socket(zmq.PUSH)
        self._report.setsockopt(zmq.LINGER, 1000)
        self._report.connect(endpoints.replies)
        self._nodes: dict[int, bytes] = {}  # node_rank -> its DEALER's identity
        self._deadlines: dict[int, float] = {}  # node_rank -> when it must have been heard from
        self._gone: set[int] = set()  # nodes that failed, died or said goodbye
        self._probed: set[int] = set()  # nodes not heard from since a connection dropped
        self._stop = threading.Event()
        self._abort_reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="deltaserve-node-monitor", daemon=True)
        self._thread.start()

    def stop(self, abort_reason: str | None = None) -> None:
        """Tell every node to finish (`abort_reason`: the world failed, kill the ranks), wait for
        their goodbyes (shutdown only), close the sockets. Called by the executor's thread."""
        self._abort_reason = abort_reason
        self._stop.set()
        self._thread.join(BYE_GRACE_S + 5.0)

    # The thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._events, zmq.POLLIN)
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(HEARTBEAT_S * 250)))
                now = time.monotonic()
                if self._router in events:
                    self._drain(now)
                if self._events in events:
                    self._on_disconnect(now)
                if now >= next_beat:
                    self._send_all(("heartbeat",))
                    next_beat = now + HEARTBEAT_S
                self._check_deadlines(now)
            self._finish()
        finally:
            self._events.close(linger=0)
            self._ctx.destroy(linger=1000)

    def _drain(self, now: float) -> None:
        while True:
            try:
                identity, data = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(identity, pickle.loads(data), now)

    def _on_message(self, identity: bytes, message: tuple, now: float) -> None:
        kind, node = message[0], message[1]
        if kind == "hello":
            self._on_hello(identity, node, message[2], now)
            return
        if self._nodes.get(node) != identity:
            return  # a node refused earlier, or an old connection of one that left
        self._deadlines[node] = now + NODE_TIMEOUT_S
        self._probed.discard(node)
        what = describe_node(node, self.world_size, self.nnodes)
        if kind == "started":
            self.rank_pids.update(message[2])
            logger.info("%s joined: pids %s", what, ", ".join(str(p) for p in message[2].values()))
        elif kind == "rank_died":
            _, _, rank, pid, how = message
            tp = self.shape[0]
            self._fail(node, f"rank {rank} (pp_rank {rank // tp}, tp_rank {rank % tp}, node {node}, pid {pid}) died "
                             f"on its node: {how}")
        elif kind == "node_failed":
            self._fail(node, f"{what} failed: {message[2]}")
        elif kind == "bye":
            self._gone.add(node)

    def _on_hello(self, identity: bytes, node: int, shape: tuple, now: float) -> None:
        tp, pp, nnodes = self.shape
        reason = None
        if tuple(shape) != self.shape:
            reason = (f"node {node} runs tensor_parallel_size x pipeline_parallel_size x nnodes = {shape}, the head "
                      f"{self.shape}: start every node with the same -tp, -pp and --nnodes")
        elif not 0 < node < nnodes:
            reason = f"node_rank={node} must be in 1..{nnodes - 1} for a worker node (the head is node 0)"
        elif node in self._nodes:
            reason = f"node {node} joined twice: every worker node needs its own --node-rank"
        if reason is not None:
            self._router.send_multipart([identity, dumps(("refused", reason))])
            self._report.send(dumps((-1, "failed", f"a worker node was refused: {reason}")))
            return
        self._nodes[node] = identity
        self._deadlines[node] = now + NODE_TIMEOUT_S
        self._router.send_multipart([identity, dumps(("launch", self.launch))])

    def _on_disconnect(self, now: float) -> None:
        """A connection dropped: a node that is still alive reconnects and is heard from within
        PROBE_S (it heartbeats every HEARTBEAT_S); a killed one is not."""
        try:
            while True:
                recv_monitor_message(self._events, zmq.NOBLOCK)
        except zmq.Again:
            pass
        for node in self._deadlines:
            self._deadlines[node] = min(self._deadlines[node], now + PROBE_S)
            self._probed.add(node)

    def _check_deadlines(self, now: float) -> None:
        for node, deadline in list(self._deadlines.items()):
            if node not in self._gone and now > deadline:
                what = describe_node(node, self.world_size, self.nnodes)
                if node in self._probed:
                    why = f"a connection dropped and its launcher was not heard from within {PROBE_S:g} s"
                else:
                    why = f"its launcher was not heard from for {NODE_TIMEOUT_S:g} s"
                self._fail(node, f"{what} is gone: {why} (heartbeats every {HEARTBEAT_S:g} s; the host, its "
                                 "network or its launcher died)")

    def _fail(self, node: int, text: str) -> None:
        self._gone.add(node)
        self._report.send(dumps((-1, "failed", text)))

    def _send_all(self, message: tuple) -> None:
        data = dumps(message)
        for node, identity in self._nodes.items():
            if node not in self._gone:
                self._router.send_multipart([identity, data])

    def _finish(self) -> None:
        """Shutdown: every node is told, and (unless aborting) waited for until it says goodbye."""
        if self._abort_reason is not None:
            self._send_all(("abort", self._abort_reason))
            return
        self._send_all(("shutdown",))
        deadline = time.monotonic() + BYE_GRACE_S
        while any(n not in self._gone for n in self._nodes) and time.monotonic() < deadline:
            if self._router.poll(100):
                self._drain(time.monotonic())
        left = [n for n in self._nodes if n not in self._gone]
        if left:
            logger.warning("worker node(s) %s did not confirm the shutdown", ", ".join(map(str, left)))
