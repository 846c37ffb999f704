"""The transfer-engine interface that P/D disaggregation moves KV and KDA state through.

One `TransferAgent` per process: it registers memory regions (host DRAM, or with `device` the memory
of one CUDA device, where the backend reaches it), hands out `metadata()` that
a peer passes to `add_peer`, and runs batched one-sided reads and writes between its registered
memory and a peer's. A transfer is a list of ops `(local_addr, remote_addr, nbytes)`: a request's
paged MLA latent KV is one op per block per layer, so every backend takes many ops in one call.

Backends are chosen by name from `BACKENDS` (`make_agent("nixl" | "mooncake", name)`); each lives in
its own module and imports its library only when picked, so this module imports neither.
"""

from __future__ import annotations

import base64
import importlib
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

TransferOp = tuple[int, int, int]
"""(local_addr, remote_addr, nbytes): one contiguous range; both ends lie in registered memory."""

MemoryRegion = tuple[int, int]
"""(address, nbytes) of host memory, e.g. `(tensor.data_ptr(), tensor.numel() * tensor.element_size())`."""


class TransferError(RuntimeError):
    """A transfer failed or timed out; the message names the backend, the peer and the op count."""


@dataclass
class TransferHandle:
    """One posted transfer. `backend_handle` is the backend's own (a NIXL xfer handle, a future)."""

    backend: str
    peer: str
    opcode: str  # "READ" (remote -> local) | "WRITE" (local -> remote)
    num_ops: int
    nbytes: int
    backend_handle: object = None
    posted_at: float = field(default_factory=time.monotonic)
    done: bool = False

    def describe(self) -> str:
        """A phrase naming this transfer for error messages."""
        return f"{self.backend} {self.opcode} of {self.num_ops} ops ({self.nbytes} bytes) with peer {self.peer!r}"


class TransferAgent(ABC):
    """One process's endpoint: registered host memory regions, peers, batched one-sided reads/writes.

    Call `register` before `metadata`: a peer can reach only the memory registered when it read the
    metadata. Not thread-safe: one thread drives an agent.
    """

    backend: str
    name: str

    @abstractmethod
    def register(self, regions: list[MemoryRegion], device: int | None = None) -> None:
        """Registers memory regions `(address, nbytes)` as sources and targets of transfers: host
        memory, or with `device` memory of that CUDA device. ValueError when the backend cannot
        reach device memory (naming what can)."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Everything a peer needs to reach this agent (plain bytes: safe to pickle or send)."""

    @abstractmethod
    def add_peer(self, peer_metadata: bytes) -> str:
        """Connects to the agent that produced `peer_metadata`; returns the peer name for read/write."""

    def read(self, peer: str, ops: list[TransferOp]) -> TransferHandle:
        """Posts a pull of each op's remote range into its local range; returns at once."""
        return self._post("READ", peer, ops)

    def write(self, peer: str, ops: list[TransferOp]) -> TransferHandle:
        """Posts a push of each op's local range into its remote range; returns at once."""
        return self._post("WRITE", peer, ops)

    def _post(self, opcode: str, peer: str, ops: list[TransferOp]) -> TransferHandle:
        nbytes = check_ops(self.backend, peer, ops)
        if not self._knows(peer):
            raise ValueError(f"{self.backend} peer {peer!r} is unknown to agent {self.name!r}; add_peer() its "
                             "metadata first")
        handle = TransferHandle(self.backend, peer, opcode, len(ops), nbytes)
        self._submit(handle, ops)
        return handle

    @abstractmethod
    def _knows(self, peer: str) -> bool:
        """Whether `peer` was added with add_peer."""

    @abstractmethod
    def _submit(self, handle: TransferHandle, ops: list[TransferOp]) -> None:
        """Starts the backend's transfer of the checked ops, setting handle.backend_handle (and
        handle.done if it completed at once); TransferError if it cannot be posted."""

    @abstractmethod
    def poll(self, handle: TransferHandle) -> bool:
        """True once the transfer is done (and stays True); raises TransferError if it failed."""

    @abstractmethod
    def close(self) -> None:
        """Releases handles, peers and registrations; the agent is unusable afterwards."""

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Polls until done, sleeping between polls; TransferError on failure or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        pause_s = 20e-6
        while not self.poll(handle):
            if time.monotonic() > deadline:
                self._abandon(handle)
                raise TransferError(f"{handle.describe()} not done after {timeout_s:.1f} s")
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 1e-3)  # short transfers finish in microseconds; long ones cost no core

    @abstractmethod
    def _abandon(self, handle: TransferHandle) -> None:
        """Called by `wait` on a timed-out transfer: release or cancel what the backend allows."""

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def check_ops(backend: str, peer: str, ops: list[TransferOp]) -> int:
    """Validates ops and returns their total bytes; ValueError names the first bad op."""
    if not ops:
        raise ValueError(f"{backend} transfer with peer {peer!r}: ops is empty; pass at least one op")
    total = 0
    for i, (local_addr, remote_addr, nbytes) in enumerate(ops):
        if nbytes <= 0 or local_addr <= 0 or remote_addr <= 0:
            raise ValueError(
                f"{backend} transfer with peer {peer!r}: op {i} = {(local_addr, remote_addr, nbytes)} needs "
                "positive addresses and nbytes > 0"
            )
        total += nbytes
    return total


def encode_metadata(backend: str, name: str, payload: bytes, device: int | None = None) -> bytes:
    """Wraps a backend's connection payload with its backend, agent name and the CUDA device its
    registered memory lives on (None: host memory), as JSON, never pickle."""
    return json.dumps({"backend": backend, "name": name, "payload": base64.b64encode(payload).decode(),
                       "device": device}).encode()


def decode_metadata(backend: str, metadata: bytes) -> tuple[str, bytes, int | None]:
    """Inverse of `encode_metadata`: (agent name, payload, device); ValueError if made by another backend."""
    try:
        fields = json.loads(metadata)
        peer_backend, name, payload = fields["backend"], fields["name"], base64.b64decode(fields["payload"])
        device = fields.get("device")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"peer metadata is not a deltaserve transfer agent's metadata(): {e}") from e
    if peer_backend != backend:
        raise ValueError(f"peer metadata is from backend {peer_backend!r}; this agent is {backend!r}: use one backend")
    return name, payload, None if device is None else int(device)


@dataclass(frozen=True)
class BackendSpec:
    """Where a backend lives and how to install the library it needs."""

    module: str  # the deltaserve module holding the agent class
    agent_class: str
    libraries: tuple[str, ...]  # the third-party modules it can import (any one will do)
    install: str


BACKENDS: dict[str, BackendSpec] = {
    "nixl": BackendSpec(
        "deltaserve.kv_transfer.nixl_agent", "NixlAgent", ("nixl_cu12._api", "nixl_cu13._api"),
        "pip install --no-deps nixl-cu12==1.5.1 (or nixl-cu13 beside a CUDA 13 torch)"
    ),
    "mooncake": BackendSpec(
        "deltaserve.kv_transfer.mooncake_agent",
        "MooncakeAgent",
        ("mooncake.engine",),
        'pip install -e ".[pd]" (mooncake-transfer-engine-non-cuda; its engine.so also needs libibverbs1 from apt)',
    ),
}


def _import_library(backend: str) -> None:
    spec = BACKENDS[backend]
    errors = []
    for library in spec.libraries:
        try:
            importlib.import_module(library)
            return
        except (ImportError, OSError) as e:  # OSError: a shared library the wheel links against is missing
            errors.append(f"{library}: {e}")
    raise ImportError(f"transfer backend {backend!r} needs one of {', '.join(spec.libraries)}, which failed to "
                      f"import ({'; '.join(errors)}); install it with: {spec.install}")


def available_backends() -> list[str]:
    """The backends whose library imports in this process, in `BACKENDS` order."""
    available = []
    for backend in BACKENDS:
        try:
            _import_library(backend)
        except ImportError:
            continue
        available.append(backend)
    return available


def make_agent(backend: str, name: str, host: str = "127.0.0.1") -> TransferAgent:
    """Builds the agent of `backend` named `name` (unique among peers), listening on `host`.

    ValueError for an unknown backend; ImportError naming the package and pip command when the
    backend's library is not installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"transfer backend {backend!r} is unknown; choose one of {sorted(BACKENDS)}")
    _import_library(backend)
    spec = BACKENDS[backend]
    agent_class = getattr(importlib.import_module(spec.module), spec.agent_class)
    return agent_class(name, host)
