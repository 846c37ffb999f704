"""The producer fence of the offload tier: a save must never read a block, state slot or checkpoint
unit before the step that writes it has run.

A step is dispatched, not run: on a GPU its kernels are queued on the compute stream and return at
once, and on a pipeline stage the copy that fills a unit can run a pipeline depth after the
scheduler asked for the save. The saver thread therefore waits on a fence recorded when the step was
dispatched, and only then copies the unit to the host.

One class, two ways to be done:
- on CUDA, a torch.cuda.Event recorded on the compute stream (`Fence.record(stream)`): done once
  every kernel queued on that stream before the record has finished;
- on the host, a marker (`Fence.ready()` / `Fence.pending()` + `signal()`): a CPU step runs
  synchronously, so the fence of a CPU step is done when it is recorded; a pending marker stands
  for work that another host thread finishes and signals (the tests' stand-in for a stream).
"""

from __future__ import annotations

import threading
import time

import torch

CUDA_POLL_S = 1e-4  # how often a bounded wait on a CUDA event asks whether it has completed


class Fence:
    """Done once the work it was recorded behind has run. Build it with `record`, `ready` or `pending`."""

    def __init__(self, event: torch.cuda.Event | None = None, done: bool = False) -> None:
        self._event = event
        self._done = threading.Event()
        if done:
            self._done.set()

    @classmethod
    def record(cls, stream: torch.cuda.Stream | None = None) -> Fence:
        """A fence behind everything queued so far on `stream` (the compute stream that ran the
        step's copies); without a stream the step ran on the host, synchronously, so it is done."""
        if stream is None:
            return cls.ready()
        event = torch.cuda.Event()
        event.record(stream)
        return cls(event=event)

    @classmethod
    def ready(cls) -> Fence:
        """A fence that is already done (a CPU step, or data no step writes)."""
        return cls(done=True)

    @classmethod
    def pending(cls) -> Fence:
        """A host fence that is done once some thread calls `signal()`."""
        return cls()

    @property
    def is_cuda(self) -> bool:
        return self._event is not None

    def signal(self) -> None:
        """Marks a host fence done, waking its waiters (the producing thread calls this after it wrote)."""
        if self._event is not None:
            raise ValueError("signal(): a CUDA fence is done when its stream reaches it, not when signalled")
        self._done.set()

    def query(self) -> bool:
        """Whether the fenced work has run, without waiting."""
        if self._done.is_set():
            return True
        if self._event is not None and self._event.query():
            self._done.set()
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the fenced work has run, or `timeout_s` seconds passed (None: no limit);
        returns whether it has run. A CUDA fence without a limit synchronizes on its event."""
        if self._event is None:
            return self._done.wait(timeout_s)
        if self._done.is_set():
            return True
        if timeout_s is None:
            self._event.synchronize()
            self._done.set()
            return True
        deadline = time.monotonic() + timeout_s
        while not self.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(CUDA_POLL_S)
        return True
