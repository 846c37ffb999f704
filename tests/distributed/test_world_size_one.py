"""At world size 1 no process group exists and every collective returns its input."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deltaserve.config.parallel import ParallelConfig
from deltaserve.distributed import (
    destroy_distributed,
    get_distributed_state,
    init_distributed,
    is_initialized,
    send_tensors,
    tp_all_gather,
    tp_all_reduce,
)
from deltaserve.distributed.parallel_state import parallel_config_for_rank


@pytest.mark.parametrize("initialise", [False, True])
def test_collectives_are_no_ops(initialise):
    x = torch.randn(5, 7)
    try:
        if initialise:
            assert init_distributed(1, 1, rank=0, world_size=1) == ParallelConfig()
            assert get_distributed_state().tp_group is None and not dist.is_initialized()
        assert tp_all_reduce(x) is x
        assert tp_all_gather(x, dim=0) is x
        send_tensors({"hidden": x})  # one stage: nothing to send to
    finally:
        destroy_distributed()
    assert not is_initialized()


def test_rank_layout_is_tensor_parallel_innermost():
    assert [(p.pipeline_parallel_rank, p.tensor_parallel_rank)
            for p in (parallel_config_for_rank(2, 2, r) for r in range(4))] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size=3 must equal tensor_parallel_size=2"):
        init_distributed(2, 1, rank=0, world_size=3)
    assert not is_initialized()
