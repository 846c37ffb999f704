"""The single-process executor: one worker, in the engine's own process."""

from __future__ import annotations

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.core.stage_specs import JointCheckpointSpec
from deltaserve.executor.base import Executor, register_executor
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from deltaserve.worker.worker import Worker


@register_executor("uniproc")
class UniProcExecutor(Executor):
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: KimiLinearConfig,
        model_dir: str,
        model: KimiLinearForCausalLM | None = None,
    ) -> None:
        self.worker = Worker(engine_config, model_config, model_dir)
        self.worker.load_model(model)

    def stage_cache_specs(self) -> list[tuple[MLALatentSpec, KDAStateSpec]]:
        return [self.worker.cache_specs()]

    def stage_cache_bytes(self) -> list[int]:
        return [self.worker.available_cache_bytes()]

    def initialize_cache(self, plan: CachePlan, checkpoint_spec: JointCheckpointSpec | None = None) -> None:
        self.worker.initialize_cache(plan)

    @property
    def device_name(self) -> str:
        return str(self.worker.device)

    @property
    def dtype_name(self) -> str:
        return str(self.worker.dtype).removeprefix("torch.")

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False,
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self.worker.execute_model(scheduler_output, non_block)

    def kv_layouts(self) -> list:
        layout = self.worker.kv_layout()
        return [] if layout is None else [layout]

    def shutdown(self) -> None:
        self.worker.shutdown()
