"""A transfer agent in a child process, for tests and benchmarks of the transfer engines on one host.

`LoopbackPeer(backend, nbytes)` spawns a process that builds an agent, registers one CPU tensor of
`nbytes` random bytes (seeded) and then serves commands over a pipe: its metadata and region
address, add a peer, return bytes of its region, push ops to a peer, or exit without closing its
agent (as a crashed engine would). The parent stops it on `close()` / leaving the `with` block.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection

import torch

from deltaserve.kv_transfer.transfer_engine import TransferOp, make_agent


def region_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """The bytes a peer's region starts with: uint8 [nbytes], reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def _serve(backend: str, name: str, nbytes: int, seed: int, conn: Connection) -> None:
    """Child process: the agent and its region live here until "close" or "exit_abruptly"."""
    torch.set_num_threads(1)
    region = region_bytes(nbytes, seed)
    agent = make_agent(backend, name)
    agent.register([(region.data_ptr(), nbytes)])
    conn.send((agent.metadata(), region.data_ptr()))
    while True:
        command, *args = conn.recv()
        if command == "add_peer":
            conn.send(agent.add_peer(args[0]))
        elif command == "bytes":
            offset, length = args
            conn.send(region[offset : offset + length].numpy().tobytes())
        elif command == "push":
            peer, ops, timeout_s = args
            try:
                agent.wait(agent.write(peer, ops), timeout_s)
                conn.send(None)
            except Exception as e:  # reported to the parent, which raises it
                conn.send(f"{type(e).__name__}: {e}")
        elif command == "exit_abruptly":
            conn.send(None)
            os._exit(0)
        else:  # "close"
            agent.close()
            conn.send(None)
            return


class LoopbackPeer:
    """The parent's side of a peer process: its metadata, its region's address, and its commands."""

    def __init__(self, backend: str, nbytes: int, name: str = "loopback-peer", seed: int = 0,
                 start_timeout_s: float = 60.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=_serve, args=(backend, name, nbytes, seed, child_conn), daemon=True)
        self.process.start()
        child_conn.close()
        self.expected = region_bytes(nbytes, seed)
        if not self._conn.poll(start_timeout_s):
            self.close()
            raise RuntimeError(f"{backend} loopback peer did not start within {start_timeout_s} s")
        self.metadata, self.region_addr = self._conn.recv()

    def _call(self, *message: object, timeout_s: float = 30.0) -> object:
        self._conn.send(message)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"loopback peer gave no answer to {message[0]!r} within {timeout_s} s")
        return self._conn.recv()

    def add_peer(self, metadata: bytes) -> str:
        """Has the peer connect to the agent that made `metadata`; returns the name it knows it by."""
        return self._call("add_peer", metadata)

    def read_region(self, offset: int, length: int) -> bytes:
        """The peer's region bytes [offset, offset + length) as they are now."""
        return self._call("bytes", offset, length)

    def push(self, peer: str, ops: list[TransferOp], timeout_s: float = 20.0) -> None:
        """Has the peer WRITE its ranges into ours; RuntimeError with its message if that failed."""
        error = self._call("push", peer, ops, timeout_s, timeout_s=timeout_s + 10)
        if error is not None:
            raise RuntimeError(f"loopback peer's push failed: {error}")

    def exit_abruptly(self) -> None:
        """Makes the peer exit without closing its agent, and waits until it has."""
        self._call("exit_abruptly")
        self.process.join(30)

    def close(self) -> None:
        """Closes the peer's agent and stops the process (killing it if it does not stop)."""
        if self.process.is_alive():
            try:
                self._call("close", timeout_s=10)
            except (OSError, EOFError, TimeoutError):
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()

    def __enter__(self) -> LoopbackPeer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
