"""Which backend of a role (prefill or decode) takes the next leg: a pool of backends, each counting
the legs it has in flight through this proxy, and the policies that choose among them by name."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


@dataclass
class Backend:
    """One deltaserve server of a role, and the legs this proxy has open on it."""

    url: str
    role: str  # "prefill" | "decode"
    in_flight: int = 0


class RoundRobin:
    """Each backend in turn."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, backends: Sequence[Backend]) -> Backend:
        return backends[next(self._next) % len(backends)]


class LeastLoaded:
    """The backend with the fewest legs in flight through this proxy; ties go round robin, so an idle
    group is spread evenly rather than always hitting the first."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, backends: Sequence[Backend]) -> Backend:
        fewest = min(b.in_flight for b in backends)
        idle = [b for b in backends if b.in_flight == fewest]
        return idle[next(self._next) % len(idle)]


POLICIES: dict[str, Callable[[], RoundRobin | LeastLoaded]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
}


class BackendPool:
    """The backends of one role behind one policy. `lease()` picks one and counts the leg in flight
    until the block ends; `on_change(backend)` is told whenever a count moves (for the gauge)."""

    def __init__(self, role: str, urls: Sequence[str], policy: str,
                 on_change: Callable[[Backend], None] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {', '.join(sorted(POLICIES))}")
        self.role = role
        self.backends = [Backend(url, role) for url in urls]
        self.policy = POLICIES[policy]()
        self._on_change = on_change or (lambda backend: None)
        for backend in self.backends:
            self._on_change(backend)

    def acquire(self) -> Backend:
        """Pick a backend by the policy and count a leg in flight on it until `release`; picking and
        counting happen with no await between them, so concurrent legs see each other."""
        backend = self.policy.choose(self.backends)
        backend.in_flight += 1
        self._on_change(backend)
        return backend

    def release(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self._on_change(backend)

    @contextlib.contextmanager
    def lease(self) -> Iterator[Backend]:
        """`acquire` for the length of a block."""
        backend = self.acquire()
        try:
            yield backend
        finally:
            self.release(backend)
