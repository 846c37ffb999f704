"""The executor interface: the engine talks to its ranks only through this.

Today one executor exists (everything in this process). A multi-process executor (one process per
rank, talking over a message layer) implements the same methods; the scheduler output it forwards
is plain data for that reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput

_REGISTRY: dict[str, type[Executor]] = {}


class Executor(ABC):
    """Drives the workers of all ranks."""

    @abstractmethod
    def cache_specs(self) -> tuple[MLALatentSpec, KDAStateSpec]:
        """The cache layout of one rank (every rank of a stage holds the same shapes)."""

    @abstractmethod
    def available_cache_bytes(self) -> int:
        """The smallest cache budget over all ranks."""

    @abstractmethod
    def initialize_cache(self, plan: CachePlan) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step. With non_block, return once the step is queued: its output comes with
        `get_output()` (async scheduling schedules the next step meanwhile)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


def register_executor(name: str):
    def wrap(cls: type[Executor]) -> type[Executor]:
        _REGISTRY[name] = cls
        return cls

    return wrap


def executor_class(name: str) -> type[Executor]:
    if name not in _REGISTRY:
        raise ValueError(f"executor={name!r} is unknown; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
