"""An asynchronous device emulated on the CPU, for executor benchmarks on a machine without a GPU.

On a GPU a step's host work (preparing inputs, launching kernels) and its device work are separate:
with `non_block` the worker returns once the step is queued, and only `get_output()` waits for the
device. On the CPU the forward is host work and the output is ready when the step returns, so an
executor that waits for each step before taking the next costs nothing there that it costs on a GPU.

`EmulatedDeviceWorker` puts the difference back: it runs the real step on the CPU (standing for the
host's share) and then treats the step as queued on a serial device that needs `device_ms` for it:
the step's output is ready `device_ms` after the later of its launch and the previous step's end.
Without `non_block` it waits for that before returning (the GPU path's host sync); with it, the
returned handle's `get_output()` waits (sleeping, so the GIL is free, like a CUDA event wait).

`emulate_device(device_ms)` installs it for the in-process executor in this process and for every
rank process the multi-process executor spawns from it. `set_rank_threads(n)` gives those rank
processes n torch threads (the executor's default is the CPU count over the ranks on the node, which
on a small machine leaves none for the engine's process).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from deltaserve.worker.worker import Worker


class EmulatedDeviceWorker(Worker):
    """A Worker whose steps also take `device_ms` on an emulated serial device (see the module docstring)."""

    device_ms = 0.0

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        output = super().execute_model(scheduler_output, non_block)
        result = output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output
        if not scheduler_output.chunks:
            return AsyncModelRunnerOutput.ready(result) if non_block else result
        now = time.perf_counter()
        done = max(now, getattr(self, "_device_free_at", now)) + self.device_ms / 1e3
        self._device_free_at = done

        def resolve() -> ModelRunnerOutput:
            time.sleep(max(0.0, done - time.perf_counter()))
            return result

        return AsyncModelRunnerOutput(resolve) if non_block else resolve()


class BenchRankMain:
    """A rank process's entry point (picklable, for spawn): installs the emulated device (unless 0 ms)
    and the thread count (unless None), then runs the real `rank_main`."""

    device_ms = 0.0
    threads: int | None = None

    def __call__(self, launch: Any) -> None:
        from deltaserve.executor.rank_process import rank_main

        if self.device_ms:
            _install(self.device_ms)
        if self.threads is not None:
            launch = dataclasses.replace(launch, num_threads=self.threads)
        rank_main(launch)


def _rank_main() -> BenchRankMain:
    """The rank entry point the multi-process executor spawns from this process, installed once."""
    import deltaserve.executor.multiproc as multiproc

    if not isinstance(multiproc.rank_main, BenchRankMain):
        multiproc.rank_main = BenchRankMain()
    return multiproc.rank_main


def _install(device_ms: float) -> None:
    import deltaserve.executor.uniproc as uniproc
    import deltaserve.worker.worker as worker

    EmulatedDeviceWorker.device_ms = device_ms
    worker.Worker = EmulatedDeviceWorker  # rank_main imports Worker from here when it runs
    uniproc.Worker = EmulatedDeviceWorker


def emulate_device(device_ms: float) -> None:
    """Every worker built from now on, in this process or in a rank process spawned from it, takes
    `device_ms` of emulated device time per step."""
    _install(device_ms)
    _rank_main().device_ms = device_ms


def set_rank_threads(threads: int) -> None:
    """Rank processes spawned from this process from now on run `threads` torch threads."""
    _rank_main().threads = threads
