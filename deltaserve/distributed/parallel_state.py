"""This process's place in the world and its tensor- and pipeline-parallel process groups.

Global ranks are laid out tensor-parallel innermost, as in vLLM and Megatron:
`rank = pipeline_parallel_rank * tensor_parallel_size + tensor_parallel_rank`. A TP group holds the
ranks of one pipeline stage; a PP group holds the ranks with the same TP rank, one per stage, so each
TP rank of stage k sends its (replicated) activations to the same TP rank of stage k + 1.
A decode-context-parallel (DCP) group holds `decode_context_parallel_size` consecutive TP ranks of
one stage; its ranks split each request's MLA latents (`dcp_layout.py`).

Every rank creates every group, in the same order (torch.distributed requires it), and keeps the ones
it belongs to. Besides the device group, each rank keeps a CPU (gloo) group for the pipeline so that
activation metadata (names, shapes, dtypes) can travel as Python objects when the device backend is
NCCL; on gloo the two are the same group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from deltaserve.config.parallel import ParallelConfig


@dataclass(frozen=True)
class DistributedState:
    """The groups of this process. `*_ranks` are global ranks, in group order."""

    parallel: ParallelConfig  # this rank's sizes and ranks
    rank: int
    world_size: int
    backend: str
    tp_group: dist.ProcessGroup | None  # None when tensor_parallel_size == 1
    tp_ranks: tuple[int, ...]
    pp_group: dist.ProcessGroup | None  # None when pipeline_parallel_size == 1
    pp_cpu_group: dist.ProcessGroup | None  # gloo twin of pp_group, for metadata
    pp_ranks: tuple[int, ...]
    # decode context parallelism: this rank's group of consecutive TP ranks (None without DCP)
    dcp_group: dist.ProcessGroup | None = None
    dcp_ranks: tuple[int, ...] = ()

    @property
    def prev_stage_rank(self) -> int:
        """Global rank of the same TP rank in the previous pipeline stage (first stage: refused)."""
        if self.parallel.is_first_stage:
            raise RuntimeError("the first pipeline stage has no previous stage")
        return self.pp_ranks[self.parallel.pipeline_parallel_rank - 1]

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the same TP rank in the next pipeline stage (last stage: refused)."""
        if self.parallel.is_last_stage:
            raise RuntimeError("the last pipeline stage has no next stage")
        return self.pp_ranks[self.parallel.pipeline_parallel_rank + 1]


_state: DistributedState | None = None


def parallel_config_for_rank(tensor_parallel_size: int, pipeline_parallel_size: int, rank: int,
                             decode_context_parallel_size: int = 1,
                             enable_expert_parallel: bool = False) -> ParallelConfig:
    """The ParallelConfig of global `rank` under the TP-innermost layout (expert parallelism places the
    routed experts over each stage's TP group: it adds no ranks and no process group)."""
    world = tensor_parallel_size * pipeline_parallel_size
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} out of range for a world of {world} "
                         f"(tensor_parallel_size={tensor_parallel_size} x pipeline_parallel_size="
                         f"{pipeline_parallel_size})")
    return ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        tensor_parallel_rank=rank % tensor_parallel_size,
        pipeline_parallel_rank=rank // tensor_parallel_size,
        decode_context_parallel_size=decode_context_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
    )


def init_distributed(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    rank: int,
    world_size: int,
    init_method: str | None = None,
    backend: str = "gloo",
    decode_context_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> ParallelConfig:
    """Join the world and build this rank's groups; returns this rank's ParallelConfig.

    Runs on every rank, once per process (a second call without `destroy_distributed` is refused).
    `init_method`: e.g. "tcp://127.0.0.1:29500" or "file:///tmp/x"; `backend`: "gloo" (CPU tensors) or
    "nccl" (CUDA tensors; set the device before calling). World size 1 creates no process group.
    """
    global _state
    if _state is not None:
        raise RuntimeError("init_distributed was already called in this process; call destroy_distributed first")
    if world_size != tensor_parallel_size * pipeline_parallel_size:
        raise ValueError(
            f"world_size={world_size} must equal tensor_parallel_size={tensor_parallel_size} x "
            f"pipeline_parallel_size={pipeline_parallel_size}"
        )
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported; choose 'gloo' (CPU) or 'nccl' (CUDA)")
    parallel = parallel_config_for_rank(tensor_parallel_size, pipeline_parallel_size, rank,
                                        decode_context_parallel_size, enable_expert_parallel)
    tp, pp, dcp = tensor_parallel_size, pipeline_parallel_size, decode_context_parallel_size
    tp_ranks = tuple(parallel.pipeline_parallel_rank * tp + t for t in range(tp))
    pp_ranks = tuple(p * tp + parallel.tensor_parallel_rank for p in range(pp))
    tp_group = pp_group = pp_cpu_group = dcp_group = None
    dcp_start = rank - parallel.decode_context_parallel_rank
    dcp_ranks = tuple(range(dcp_start, dcp_start + dcp))
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        if tp > 1:
            for p in range(pp):
                group = dist.new_group([p * tp + t for t in range(tp)], backend=backend)
                if p == parallel.pipeline_parallel_rank:
                    tp_group = group
        if pp > 1:
            for t in range(tp):
                ranks = [p * tp + t for p in range(pp)]
                group = dist.new_group(ranks, backend=backend)
                cpu_group = group if backend == "gloo" else dist.new_group(ranks, backend="gloo")
                if t == parallel.tensor_parallel_rank:
                    pp_group, pp_cpu_group = group, cpu_group
        if dcp > 1:  # after the TP and PP groups: every rank creates every group in one order
            for start in range(0, world_size, dcp):
                group = dist.new_group(list(range(start, start + dcp)), backend=backend)
                if start == dcp_start:
                    dcp_group = group
    _state = DistributedState(parallel, rank, world_size, backend, tp_group, tp_ranks, pp_group, pp_cpu_group,
                              pp_ranks, dcp_group, dcp_ranks)
    return parallel


def is_initialized() -> bool:
    return _state is not None


def get_distributed_state() -> DistributedState:
    if _state is None:
        raise RuntimeError("distributed state is not initialised: call init_distributed(...) on every rank first")
    return _state


def destroy_distributed() -> None:
    """Leave the world and forget the groups (every rank calls it); harmless when not initialised."""
    global _state
    if _state is not None and _state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _state = None


@contextmanager
def without_groups() -> Iterator[None]:
    """Run a single-rank model inside a multi-rank process (a draft model on the output rank): its layers'
    collectives (`tp_all_reduce`, ...) see no groups and return their input."""
    global _state
    saved, _state = _state, None
    try:
        yield
    finally:
        _state = saved
