"""The executor interface: the engine talks to its ranks only through this.

Two executors exist: "uniproc" (one worker in the engine's own process) and "mp" (one process per
rank of the tensor x pipeline grid, `executor/multiproc.py`). Everything that crosses this interface
(specs, plans, the scheduler output, the runner output) is plain data for that reason.

Cache specs and budgets are reported per pipeline stage (stages hold different layers); the engine
plans what every stage can hold (`core/stage_specs.plan_stage_caches`) and hands the one plan and the
joint checkpoint spec back to every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.core.stage_specs import JointCheckpointSpec
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput

_REGISTRY: dict[str, type[Executor]] = {}


class Executor(ABC):
    """Drives the workers of all ranks."""

    @abstractmethod
    def stage_cache_specs(self) -> list[tuple[MLALatentSpec, KDAStateSpec]]:
        """The cache layout of each pipeline stage, in pp_rank order (every TP rank of a stage holds
        the same shapes)."""

    @abstractmethod
    def stage_cache_bytes(self) -> list[int]:
        """Each stage's cache budget, the smallest over its TP ranks, in pp_rank order."""

    @abstractmethod
    def initialize_cache(self, plan: CachePlan, checkpoint_spec: JointCheckpointSpec | None = None) -> None:
        """Allocate `plan` on every rank. With checkpoints, every stage checks that it agrees on
        `checkpoint_spec` (refused with ValueError otherwise)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step on every rank. With non_block, return once the step is queued: its output
        comes with `get_output()` (the engine schedules further steps meanwhile). Outputs are
        resolved in the order the steps were queued."""

    @property
    @abstractmethod
    def device_name(self) -> str:
        """The device of the rank that returns outputs, e.g. "cpu" or "cuda:0"."""

    @property
    @abstractmethod
    def dtype_name(self) -> str:
        """The model's dtype, e.g. "bfloat16"."""

    @property
    def device_type(self) -> str:
        return self.device_name.split(":")[0]

    def cache_specs(self) -> tuple[MLALatentSpec, KDAStateSpec]:
        """The cache layout of the first stage (all of the model at one stage)."""
        return self.stage_cache_specs()[0]

    def kv_layouts(self) -> list[Any]:
        """P/D: every rank's registered caches (kv_transfer.layout.RankLayout), in rank order; empty
        without a KV connector."""
        return []

    def metrics(self) -> dict[str, Any]:
        """Executor numbers for `EngineCore.get_metrics()["executor"]` (plain data; none by default)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


def register_executor(name: str):
    def wrap(cls: type[Executor]) -> type[Executor]:
        _REGISTRY[name] = cls
        return cls

    return wrap


def executor_class(name: str) -> type[Executor]:
    """The executor registered as `name` (importing the built-in ones on first use)."""
    import deltaserve.executor.multiproc  # noqa: F401 - registers "mp"
    import deltaserve.executor.uniproc  # noqa: F401 - registers "uniproc"

    if name not in _REGISTRY:
        raise ValueError(f"executor={name!r} is unknown; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]
