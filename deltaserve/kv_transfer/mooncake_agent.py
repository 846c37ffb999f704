"""The Mooncake backend: Mooncake's TransferEngine over TCP with P2P handshake (no metadata server).

The engine is initialised with `initialize(host, "P2PHANDSHAKE", "tcp", "")`; a peer is addressed by
its `host:rpc_port`. A transfer goes out through `batch_transfer_sync_read/write`, many ops per call,
on a worker thread so that `read`/`write` return at once and `poll` only checks a future.

Two limits of the TCP transport of mooncake-transfer-engine 0.3.13 shape this:
- It fails a batch outright (status FAILED, "TCP lane queue-full rejection") when more than about
  1024 slices of 64 KiB are queued for one peer (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`,
  `MC_TCP_SLICE_SIZE`). So ops are split into chunks of at most `MAX_SLICES_PER_CALL` slices, sent
  one after another, and transfers to one peer take turns.
- Its wait for a batch is a loop in C++ without a pause (the GIL is released): a worker thread
  keeps one core busy while its chunk is in flight. An idle agent costs nothing.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from mooncake.engine import TransferEngine

from deltaserve.kv_transfer.transfer_engine import (
    MemoryRegion,
    TransferAgent,
    TransferError,
    TransferHandle,
    TransferOp,
    decode_metadata,
    encode_metadata,
)

SLICE_BYTES = int(os.environ.get("MC_TCP_SLICE_SIZE", 64 << 10))
MAX_SLICES_PER_CALL = 512  # half the transport's per-peer queue, leaving room for the peer's own pushes
TRANSFER_THREADS = 2


def chunk_ops(ops: list[TransferOp], max_slices: int = MAX_SLICES_PER_CALL) -> list[list[TransferOp]]:
    """Splits ops, in order, into runs of at most `max_slices` transport slices (at least one op each)."""
    chunks: list[list[TransferOp]] = [[]]
    slices_in_chunk = 0
    for op in ops:
        slices = -(-op[2] // SLICE_BYTES)
        if chunks[-1] and slices_in_chunk + slices > max_slices:
            chunks.append([])
            slices_in_chunk = 0
        chunks[-1].append(op)
        slices_in_chunk += slices
    return chunks


class MooncakeAgent(TransferAgent):
    """A TransferAgent over Mooncake's TCP transport; `host` is the address peers connect to."""

    backend = "mooncake"

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name = name
        self._engine = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', 'tcp', '') failed")
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._peers: dict[str, threading.Lock] = {}
        self._executor = ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix=f"mooncake-{name}")

    def register(self, regions: list[MemoryRegion], device: int | None = None) -> None:
        """Registers host regions with the engine (one batched call). Device memory is refused: the
        TCP transport of this build copies with the CPU."""
        if device is not None:
            raise ValueError("kv_transfer_config: MooncakeConnector here runs Mooncake's TCP transport over host "
                             "memory and cannot reach CUDA memory; use NixlConnector (UCX) for caches on a GPU, or "
                             "run the P/D pair with --device cpu")
        addresses = [address for address, _ in regions]
        rc = self._engine.batch_register_memory(addresses, [nbytes for _, nbytes in regions])
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")
        self._registered.extend(addresses)

    def metadata(self) -> bytes:
        """The agent's `host:rpc_port`; the engine's handshake tells the peer about its memory."""
        return encode_metadata(self.backend, self.name, self.endpoint.encode())

    def add_peer(self, peer_metadata: bytes) -> str:
        """Returns the peer's `host:rpc_port`; the engine opens the connection on the first transfer."""
        _, payload, _ = decode_metadata(self.backend, peer_metadata)
        peer = payload.decode()
        self._peers.setdefault(peer, threading.Lock())
        return peer

    def _knows(self, peer: str) -> bool:
        return peer in self._peers

    def _submit(self, handle: TransferHandle, ops: list[TransferOp]) -> None:
        """Runs the transfer on a worker thread (batched, chunked by `chunk_ops`)."""
        handle.backend_handle = self._executor.submit(self._run, handle, list(ops))

    def _run(self, handle: TransferHandle, ops: list[TransferOp]) -> None:
        """Worker thread: sends the chunks in order, one peer's transfers taking turns."""
        engine = self._engine
        send = engine.batch_transfer_sync_read if handle.opcode == "READ" else engine.batch_transfer_sync_write
        with self._peers[handle.peer]:
            for i, chunk in enumerate(chunk_ops(ops)):
                local, remote, lengths = (list(column) for column in zip(*chunk, strict=True))
                rc = send(handle.peer, local, remote, lengths)
                if rc != 0:
                    raise TransferError(f"{handle.describe()} failed: chunk {i} of {len(chunk)} ops returned {rc}")

    def poll(self, handle: TransferHandle) -> bool:
        """True once the worker finished; re-raises its TransferError."""
        if handle.done:
            return True
        future: Future = handle.backend_handle
        if not future.done():
            return False
        error = future.exception()
        if error is not None:
            if isinstance(error, TransferError):
                raise error
            raise TransferError(f"{handle.describe()} failed: {type(error).__name__}: {error}") from error
        handle.done = True
        return True

    def _abandon(self, handle: TransferHandle) -> None:
        handle.backend_handle.cancel()  # stops it only if not started: the engine cannot cancel a running batch

    def close(self) -> None:
        """Waits for running transfers (the engine cannot cancel one), then unregisters and drops the engine."""
        if self._engine is None:
            return
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered.clear()
        self._engine = None
