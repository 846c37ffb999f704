"""Which GPU and which CPUs a rank uses: one node-local index chooses both.

Every rank of a node gets a distinct local index from its place in the grid,
`(local_pp_rank * tp_size + tp_rank)` (a data-parallel term, `local_dp_rank * pp_per_node * tp_size`,
will be added in front when data parallelism arrives). The same index picks the CUDA device and the
entry of the per-GPU NUMA list, so the two cannot drift apart (a deployment that left pp_rank out of
the index bound every pipeline stage to GPU 0's NUMA node).

With several nodes every node runs `world_size / nnodes` consecutive global ranks (whole TP groups,
so a stage's TP group never spans nodes): node n holds ranks [n * ranks_per_node, (n + 1) *
ranks_per_node), and the local index restarts at 0 on each node.

Runs on every rank (and in each node's launcher), before the process group is initialised; no
collectives.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

SYSFS_NODE_ROOT = "/sys/devices/system/node"
SYSFS_NODE_ROOT_ENV = "DELTASERVE_SYSFS_NODE_ROOT"  # another sysfs node root (tests, containers)


def local_device_index(
    pp_rank: int, tp_rank: int, tp_size: int, stages_per_node: int | None = None, gpus_on_node: int | None = None,
) -> int:
    """This rank's node-local index: `(pp_rank % stages_per_node) * tp_size + tp_rank`.

    `stages_per_node` is how many pipeline stages share one node (None: all of them, one node); a
    stage's TP group never spans nodes. With `gpus_on_node` the index is checked to name a GPU there.
    """
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size} must be >= 1")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor_parallel_rank={tp_rank} out of range for tensor_parallel_size={tp_size}")
    if pp_rank < 0:
        raise ValueError(f"pipeline_parallel_rank={pp_rank} must be >= 0")
    if stages_per_node is not None and stages_per_node < 1:
        raise ValueError(f"stages_per_node={stages_per_node} must be >= 1")
    local_pp_rank = pp_rank if stages_per_node is None else pp_rank % stages_per_node
    index = local_pp_rank * tp_size + tp_rank
    if gpus_on_node is not None and index >= gpus_on_node:
        raise ValueError(
            f"pipeline_parallel_rank={pp_rank}, tensor_parallel_rank={tp_rank} needs local GPU {index} but the "
            f"node has {gpus_on_node} GPUs; lower stages_per_node (now {stages_per_node}) or tensor_parallel_size "
            f"(now {tp_size}) so that stages_per_node x tensor_parallel_size <= {gpus_on_node}"
        )
    return index


def ranks_per_node(world_size: int, nnodes: int) -> int:
    """How many global ranks each node runs (the config checks that nnodes divides the world)."""
    return world_size // nnodes


def node_of_rank(rank: int, world_size: int, nnodes: int) -> int:
    """The node that runs global `rank`."""
    return rank // ranks_per_node(world_size, nnodes)


def ranks_of_node(node_rank: int, world_size: int, nnodes: int) -> range:
    """The global ranks node `node_rank` runs."""
    per_node = ranks_per_node(world_size, nnodes)
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_local_index(rank: int, tp_size: int, pp_size: int, nnodes: int = 1, gpus_on_node: int | None = None,
                     ) -> int:
    """`local_device_index` of global `rank` (TP-innermost) when `nnodes` nodes share the world."""
    stages_per_node = ranks_per_node(tp_size * pp_size, nnodes) // tp_size
    return local_device_index(rank // tp_size, rank % tp_size, tp_size, stages_per_node, gpus_on_node)


def node_rank_devices(device: str | None, tp_size: int, pp_size: int, nnodes: int = 1, node_rank: int = 0,
                      backend: str | None = None) -> tuple[str, dict[int, str]]:
    """(backend, device of each global rank this node runs): gloo on the CPU; on CUDA NCCL with GPU
    `rank_local_index` per rank, or, with fewer GPUs on the node than ranks, gloo with every rank on
    GPU 0 (tensors staged through host memory, for tests only). `backend` is the head's choice,
    which a worker node must follow (NCCL refused there if this node has too few GPUs).

    Runs in each node's launcher (the head's executor, or `deltaserve ... --node-rank N`).
    """
    import torch

    kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
    ranks = ranks_of_node(node_rank, tp_size * pp_size, nnodes)
    if kind == "cpu":
        return "gloo", {r: "cpu" for r in ranks}
    if kind != "cuda":
        raise ValueError(f"device={device!r}: the multi-process executor runs on 'cpu' or 'cuda'")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"device={device!r} was asked for but CUDA is not available on node {node_rank}")
    if count < len(ranks) and backend != "nccl":
        logger.warning("%d ranks share %d GPU(s): NCCL refuses that, so they run gloo with tensors staged "
                       "through host memory (correct, slow: for tests only)", len(ranks), count)
        return "gloo", {r: "cuda:0" for r in ranks}
    return backend or "nccl", {r: f"cuda:{rank_local_index(r, tp_size, pp_size, nnodes, count)}" for r in ranks}


def parse_numa_bind(text: str) -> list[int]:
    """A per-GPU NUMA node list, "0,0,0,0,1,1,1,1" -> [0, 0, 0, 0, 1, 1, 1, 1]; entry i is GPU i's node."""
    entries = [e.strip() for e in text.split(",")]
    if not text.strip() or any(e == "" for e in entries):
        raise ValueError(f"numa_bind={text!r} has an empty entry; give one NUMA node per GPU, like '0,0,1,1'")
    nodes = []
    for i, entry in enumerate(entries):
        if not entry.isdigit():
            raise ValueError(
                f"numa_bind={text!r}: entry {i} ({entry!r}) is not a NUMA node number; give non-negative integers"
            )
        nodes.append(int(entry))
    return nodes


def parse_cpulist(text: str) -> set[int]:
    """A sysfs cpulist, "0-3,8-11" -> {0, 1, 2, 3, 8, 9, 10, 11}; an empty list is the empty set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"cpulist {text!r}: {part!r} is neither a CPU nor a range like '0-3'") from None
        if hi < lo:
            raise ValueError(f"cpulist {text!r}: range {part!r} ends before it starts")
        cpus.update(range(lo, hi + 1))
    return cpus


def cpus_of_numa_node(node: int, sysfs_root: str = SYSFS_NODE_ROOT) -> set[int]:
    """The CPUs of NUMA node `node`, read from `<sysfs_root>/node<node>/cpulist`."""
    path = os.path.join(sysfs_root, f"node{node}", "cpulist")
    try:
        with open(path) as f:
            return parse_cpulist(f.read())
    except FileNotFoundError:
        raise ValueError(f"NUMA node {node} does not exist ({path} is missing); check numa_bind") from None


def apply_numa_binding(local_index: int, numa_nodes: list[int], sysfs_root: str | None = None) -> set[int]:
    """Pin this process to the CPUs of the NUMA node of local GPU `local_index`; returns those CPUs.

    `local_index` must be the same index that chose the device (`local_device_index`). `sysfs_root`:
    None reads $DELTASERVE_SYSFS_NODE_ROOT, else /sys/devices/system/node.
    """
    sysfs_root = sysfs_root or os.environ.get(SYSFS_NODE_ROOT_ENV) or SYSFS_NODE_ROOT
    if not 0 <= local_index < len(numa_nodes):
        raise ValueError(
            f"local GPU {local_index} has no entry in numa_bind ({len(numa_nodes)} entries); give one NUMA node "
            "per GPU on the node"
        )
    node = numa_nodes[local_index]
    cpus = cpus_of_numa_node(node, sysfs_root)
    if not cpus:
        raise ValueError(f"NUMA node {node} (for local GPU {local_index}) has no CPUs; check numa_bind")
    os.sched_setaffinity(0, cpus)
    return cpus
