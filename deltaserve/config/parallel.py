"""How the model is split over ranks: tensor-parallel (heads, intermediate sizes) inside a pipeline
stage, pipeline-parallel (contiguous layer ranges) across stages."""

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
