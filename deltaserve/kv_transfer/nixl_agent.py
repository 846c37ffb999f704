"""The NIXL backend: a `nixl_agent` with the UCX backend over registered DRAM or CUDA memory (VRAM).

A transfer is one NIXL request over two descriptor lists built from (N, 3) arrays (address, length,
device id) by `get_xfer_descs`, each side in the memory type its agent registered (the peer's comes
with its metadata): `initialize_xfer` + `transfer`, then `check_xfer_state` until "DONE"; the request
handle is released when it completes, fails or is abandoned. The library is the wheel of the CUDA
major version installed (`nixl_cu12` or `nixl_cu13`); both run on CPU-only machines over DRAM.

Progress: NIXL's own progress thread polls UCX with no pause here (nixl 1.5.1 hard-codes a delay of
0, which spins a whole core even when idle), so the agent runs without it and a daemon thread of
ours drives UCX every `PROGRESS_INTERVAL_S` (`get_new_notifs` progresses the workers when no
progress thread runs). The target side of a READ must progress too (UCX wire-up and, over TCP,
emulated RMA need it), which that thread does. `NIXL_THREAD_SYNC_STRICT` makes the two threads'
calls into the agent safe.
"""

from __future__ import annotations

import threading

import numpy as np

try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # the CUDA 13 wheel
    from nixl_cu13._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from deltaserve.kv_transfer.transfer_engine import (
    MemoryRegion,
    TransferAgent,
    TransferError,
    TransferHandle,
    TransferOp,
    decode_metadata,
    encode_metadata,
)

PROGRESS_INTERVAL_S = 1e-3  # about 5% of a core per idle agent; lower costs more idle CPU


class NixlAgent(TransferAgent):
    """A TransferAgent over NIXL/UCX. `host` is unused: UCX picks its own interfaces."""

    backend = "nixl"

    def __init__(self, name: str, host: str = "127.0.0.1") -> None:
        self.name = name
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError(f"NIXL agent {name!r} has no UCX backend (plugins: {self._agent.get_plugin_list()})")
        self._registrations: list[object] = []
        self._device: int | None = None  # the CUDA device of the registered memory; None: DRAM
        self._peers: dict[str, int | None] = {}  # peer name -> the CUDA device of its memory (None: DRAM)
        self._open_handles: list[TransferHandle] = []
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._drive_progress, name=f"nixl-progress-{name}", daemon=True)
        self._progress.start()

    def _drive_progress(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            # notifications are not part of the interface; reading them is what progresses UCX
            self._agent.get_new_notifs()

    def register(self, regions: list[MemoryRegion], device: int | None = None) -> None:
        """Registers DRAM regions (or, with `device`, that CUDA device's memory) with UCX; call
        before `metadata()`. One agent registers one kind of memory."""
        if self._registrations and device != self._device:
            raise ValueError(f"NIXL agent {self.name!r} registered memory of device {self._device}; one agent "
                             f"registers one kind of memory, not also device {device}")
        descs = [(address, nbytes, device or 0, "") for address, nbytes in regions]
        self._registrations.append(self._agent.register_memory(descs, "DRAM" if device is None else "VRAM"))
        self._device = device

    def metadata(self) -> bytes:
        """The agent's NIXL metadata (UCX worker address and the rkeys of what is registered)."""
        return encode_metadata(self.backend, self.name, self._agent.get_agent_metadata(), self._device)

    def add_peer(self, peer_metadata: bytes) -> str:
        """Loads the peer's NIXL metadata; the peer name is its agent name."""
        _, payload, device = decode_metadata(self.backend, peer_metadata)
        peer = self._agent.add_remote_agent(payload)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        self._peers[peer] = device
        return peer

    def _knows(self, peer: str) -> bool:
        return peer in self._peers

    def _submit(self, handle: TransferHandle, ops: list[TransferOp]) -> None:
        """One NIXL request over all ops."""
        table = np.asarray(ops, dtype=np.uint64)  # [N, 3]: local_addr, remote_addr, nbytes
        sides = []
        for column, device in ((0, self._device), (1, self._peers[handle.peer])):
            ids = np.full(len(ops), device or 0, dtype=np.uint64)
            sides.append(self._agent.get_xfer_descs(np.stack([table[:, column], table[:, 2], ids], axis=1),
                                                    "DRAM" if device is None else "VRAM"))
        local, remote = sides
        try:
            handle.backend_handle = self._agent.initialize_xfer(handle.opcode, local, remote, handle.peer)
            state = self._agent.transfer(handle.backend_handle)
        except Exception as e:  # nixl raises its own classes (e.g. nixlRemoteDisconnectError)
            self._release(handle)
            raise TransferError(f"{handle.describe()} failed to post: {type(e).__name__}: {e}") from e
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"{handle.describe()} failed to post (state ERR)")
        handle.done = state == "DONE"
        if handle.done:
            self._release(handle)
        else:
            self._open_handles.append(handle)

    def poll(self, handle: TransferHandle) -> bool:
        """Checks the request's state; releases it once done or failed."""
        if handle.done:
            return True
        try:
            state = self._agent.check_xfer_state(handle.backend_handle)
        except Exception as e:
            self._release(handle)
            raise TransferError(f"{handle.describe()} failed: {type(e).__name__}: {e}") from e
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"{handle.describe()} failed (state ERR)")
        if state == "DONE":
            handle.done = True
            self._release(handle)
        return handle.done

    def _abandon(self, handle: TransferHandle) -> None:
        self._release(handle)  # NIXL cancels an active request on release, where the backend can

    def _release(self, handle: TransferHandle) -> None:
        if handle in self._open_handles:
            self._open_handles.remove(handle)
        xfer, handle.backend_handle = handle.backend_handle, None
        if xfer is None:
            return
        try:
            xfer.release()
        except Exception:
            pass  # a request that cannot be cancelled is kept on nixl's leak list and freed with the agent

    def close(self) -> None:
        """Stops the progress thread, releases open requests, forgets peers, deregisters memory."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._progress.join()
        for handle in list(self._open_handles):
            self._release(handle)
        for peer in self._peers:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:
                pass  # a peer that already disconnected
        self._peers.clear()
        for registration in self._registrations:
            self._agent.deregister_memory(registration)
        self._registrations.clear()
