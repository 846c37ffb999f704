"""How the model is split over ranks: tensor-parallel (heads, intermediate sizes) inside a pipeline
stage, pipeline-parallel (contiguous layer ranges) across stages, and, with expert parallelism, the
MoE's routed experts placed whole over the TP ranks of a stage instead of split along their
intermediate size."""

from __future__ import annotations

from dataclasses import dataclass


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator` (a size split over `denominator` tensor-parallel ranks), refusing a
    split that does not come out even."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}; "
                         "choose a tensor_parallel_size that divides it")
    return numerator // denominator


@dataclass(frozen=True)
class ParallelConfig:
    """This rank's place in the tensor- and pipeline-parallel grid."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    pipeline_parallel_rank: int = 0
    # decode context parallelism: groups of this many consecutive TP ranks split each request's MLA
    # latents (it divides tensor_parallel_size and adds no ranks)
    decode_context_parallel_size: int = 1
    # expert parallelism (vLLM's name): each TP rank of a stage holds num_experts / tensor_parallel_size
    # whole routed experts; at tensor_parallel_size=1 it changes nothing (vLLM ignores it there too)
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_rank={self.tensor_parallel_rank} out of range")
        if not 0 <= self.pipeline_parallel_rank < self.pipeline_parallel_size:
            raise ValueError(f"pipeline_parallel_rank={self.pipeline_parallel_rank} out of range")
        dcp = self.decode_context_parallel_size
        if dcp < 1 or self.tensor_parallel_size % dcp:
            raise ValueError(f"decode_context_parallel_size={dcp} must be a positive divisor of "
                             f"tensor_parallel_size={self.tensor_parallel_size} (DCP reuses the TP ranks)")

    @property
    def decode_context_parallel_rank(self) -> int:
        """This rank's place in its DCP group (TP ranks [k * dcp, (k + 1) * dcp) form group k)."""
        return self.tensor_parallel_rank % self.decode_context_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are placed over: the TP group with enable_expert_parallel, else 1
        (every TP rank holds a slice of every expert)."""
        return self.tensor_parallel_size if self.enable_expert_parallel else 1

    @property
    def expert_parallel_rank(self) -> int:
        return self.tensor_parallel_rank if self.enable_expert_parallel else 0

    @property
    def uses_expert_parallel(self) -> bool:
        """Whether the experts are placed over more than one rank (enable_expert_parallel at TP > 1)."""
        return self.expert_parallel_size > 1

    def local_expert_range(self, num_experts: int) -> tuple[int, int]:
        """The contiguous [start, end) of global expert ids this rank holds (vLLM's linear placement):
        all of them without expert parallelism. Refuses a num_experts the EP ranks cannot share evenly."""
        ep = self.expert_parallel_size
        if num_experts % ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by tensor_parallel_size={ep}: with "
                "enable_expert_parallel each TP rank holds num_experts / tensor_parallel_size whole experts; "
                "choose a tensor_parallel_size that divides num_experts, or turn enable_expert_parallel off"
            )
        per_rank = num_experts // ep
        start = self.expert_parallel_rank * per_rank
        return start, start + per_rank

    def describe_expert_placement(self, num_experts: int) -> str:
        """One line for the startup log, e.g. 'ep=2 (8 experts, 4 per TP rank: [0, 4), [4, 8))'."""
        if not self.uses_expert_parallel:
            reason = " (tensor_parallel_size=1)" if self.enable_expert_parallel else ""
            return f"ep=off{reason}"
        self.local_expert_range(num_experts)  # refuses an uneven split
        per_rank = num_experts // self.expert_parallel_size
        ranges = ", ".join(f"[{r * per_rank}, {(r + 1) * per_rank})" for r in range(self.expert_parallel_size))
        return f"ep={self.expert_parallel_size} ({num_experts} experts, {per_rank} per TP rank: {ranges})"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    def stage_layer_range(self, num_layers: int) -> tuple[int, int]:
        """The contiguous [start, end) of decoder layers this pipeline stage owns."""
        per_stage, extra = divmod(num_layers, self.pipeline_parallel_size)
        rank = self.pipeline_parallel_rank
        start = rank * per_stage + min(rank, extra)
        return start, start + per_stage + (1 if rank < extra else 0)
