"""Process groups of this process and the collectives the model runs over them.

`init_distributed` builds the tensor- and pipeline-parallel groups once per process; the layers call
`tp_all_reduce` / `tp_all_gather`, a pipeline stage `send_tensors` / `recv_tensors`. At world size 1
nothing is initialised and every collective returns its input.
"""

from deltaserve.distributed.communication import (
    dcp_all_gather,
    recv_tensors,
    send_tensors,
    tp_all_gather,
    tp_all_reduce,
)
from deltaserve.distributed.parallel_state import (
    DistributedState,
    destroy_distributed,
    get_distributed_state,
    init_distributed,
    is_initialized,
)

__all__ = [
    "DistributedState",
    "dcp_all_gather",
    "destroy_distributed",
    "get_distributed_state",
    "init_distributed",
    "is_initialized",
    "recv_tensors",
    "send_tensors",
    "tp_all_gather",
    "tp_all_reduce",
]
