"""ZeroMQ channels between the engine and its ranks, on one host or across hosts.

Three channels, each a pair of socket kinds (the engine side binds, ranks and node launchers connect):

- commands, engine PUB -> every rank's SUB: each message (a step, the cache plan, shutdown) is
  pickled once and sent once; every rank receives every message, in order.
- replies, every rank's PUSH -> engine PULL: each message is `(rank, kind, *payload)`, tagged with
  the sender's global rank (-1: the head's node monitor).
- nodes, the head's ROUTER <-> each worker node launcher's DEALER: launch parameters, heartbeats
  both ways, a rank's death on a worker node (`executor/node_monitor.py`, `executor/worker_node.py`).

Ports, with several nodes (on master_addr; `EndpointPlan.from_master`):
  master_port      torch.distributed rendezvous (tcp://master_addr:master_port)
  master_port + 1  commands
  master_port + 2  replies
  master_port + 3  nodes
On one node without master_port, every port is a free one on 127.0.0.1.

A PUB drops what it sends before a subscriber has joined, so the engine sends nothing but "sync"
messages until every rank has answered one (`MultiprocExecutor._sync`); from then on nothing is
dropped (no high-water mark on either side).
"""

from __future__ import annotations

import pickle
import random
import socket
from dataclasses import dataclass
from typing import Any

import zmq

LISTEN_PORTS_START = 10000  # where free_port starts looking, below the kernel's ephemeral range
_PORT_RNG = random.SystemRandom()  # not the seeded `random`: two processes must not try the same ports
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections and to bind(port 0) (Linux's default, 32768
    to 60999, where the setting cannot be read)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", taken: set[int] | None = None, attempts: int = 64) -> int:
    """A port nothing listens on now, below the ephemeral range where one exists, and not in `taken`
    (which it joins).

    A port the kernel picked for bind(0) is ephemeral: until a rank binds it, any outgoing connection
    (a rank's own TCPStore or ZeroMQ client, a test beside it) may take it as its source port, and the
    listen then fails with EADDRINUSE (seen with two test runs starting engines at once). Random ports
    under the ephemeral range are never handed out that way; the kernel's choice is the fallback.
    """
    taken = set() if taken is None else taken
    low, _ = ephemeral_port_range()
    candidates = ([_PORT_RNG.randrange(LISTEN_PORTS_START, low) for _ in range(attempts)]
                  if low > LISTEN_PORTS_START else [])
    for port in candidates + [0]:
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            chosen = s.getsockname()[1]
        if chosen not in taken:
            taken.add(chosen)
            return chosen
    raise OSError(f"no free port on {host} after {attempts} tries")


@dataclass(frozen=True)
class EndpointPlan:
    """The addresses of one world: torch's rendezvous and the three channels (tcp://host:port)."""

    rendezvous: str
    commands: str
    replies: str
    nodes: str

    @classmethod
    def from_master(cls, master_addr: str, master_port: int) -> EndpointPlan:
        """The ports derived from master_port (see the module docstring)."""
        base = f"tcp://{master_addr}:"
        return cls(base + str(master_port), base + str(master_port + 1), base + str(master_port + 2),
                   base + str(master_port + 3))

    @classmethod
    def local(cls) -> EndpointPlan:
        """Free ports on 127.0.0.1 (one node; the nodes channel is unused)."""
        base, taken = "tcp://127.0.0.1:", set()
        return cls(*(base + str(free_port(taken=taken)) for _ in range(4)))


def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop: a busy rank queues its steps, not loses them
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)  # a last message (an error, shutdown) still leaves on close
    return sock


class EngineChannels:
    """The engine's ends of commands and replies (runs in the head's engine process, one thread)."""

    def __init__(self, endpoints: EndpointPlan) -> None:
        self.endpoints = endpoints
        self.ctx = zmq.Context()
        self.commands = _socket(self.ctx, zmq.PUB)
        self.replies = _socket(self.ctx, zmq.PULL)
        try:
            self.commands.bind(endpoints.commands)
            self.replies.bind(endpoints.replies)
        except zmq.ZMQError as e:
            self.close()
            raise ValueError(f"cannot listen on {endpoints.commands} and {endpoints.replies} ({e}); choose another "
                             "master_port (it and the next three ports must be free on master_addr)") from None

    def broadcast(self, message: tuple) -> None:
        """Send `message` to every rank (pickled once)."""
        self.commands.send(dumps(message), copy=False)

    def receive(self) -> tuple[int, str, tuple] | None:
        """(rank, kind, payload) of the next reply if one is waiting, else None."""
        try:
            data = self.replies.recv(zmq.NOBLOCK)
        except zmq.Again:
            return None
        rank, kind, *payload = pickle.loads(data)
        return rank, kind, tuple(payload)

    def close(self, linger_ms: int = 1000) -> None:
        for sock in (self.commands, self.replies):
            sock.close(linger=linger_ms)
        self.ctx.term()


class RankChannels:
    """A rank's ends: the SUB (read by the rank's inbox thread only) and the PUSH (the main thread)."""

    def __init__(self, endpoints: EndpointPlan, rank: int) -> None:
        self.endpoints, self.rank = endpoints, rank
        # two contexts: closing the PUSH's waits for its queue without touching the SUB, which the
        # inbox thread may be polling
        self.ctx, self.sub_ctx = zmq.Context(), zmq.Context()
        self.to_engine = _socket(self.ctx, zmq.PUSH)
        self.to_engine.connect(endpoints.replies)

    def subscribe(self) -> zmq.Socket:
        """A SUB on the commands channel; create it in the thread that reads it."""
        sub = _socket(self.sub_ctx, zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoints.commands)
        return sub

    def send(self, kind: str, *payload: Any) -> None:
        self.to_engine.send(dumps((self.rank, kind, *payload)), copy=False)

    def close(self) -> None:
        """Close the PUSH, waiting up to its linger for what is still queued (an error), then the context."""
        self.to_engine.close()
        self.ctx.term()
