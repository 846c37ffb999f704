"""Node-local device index, NUMA list parsing and CPU binding (fake sysfs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deltaserve.distributed.placement import (
    apply_numa_binding,
    cpus_of_numa_node,
    local_device_index,
    parse_cpulist,
    parse_numa_bind,
)


def test_tp_by_pp_grid_on_one_node() -> None:
    indices = {(pp, tp): local_device_index(pp, tp, tp_size=2, gpus_on_node=8) for pp in range(4) for tp in range(2)}
    assert indices == {(pp, tp): pp * 2 + tp for pp in range(4) for tp in range(2)}
    assert sorted(indices.values()) == list(range(8))


def test_pp_ranks_get_distinct_indices() -> None:
    # the reference bug: leaving pp_rank out put all 8 stages on GPU 0 (and its NUMA node)
    assert len({local_device_index(pp, 0, tp_size=1) for pp in range(8)}) == 8


def test_multi_node_restarts_per_node() -> None:
    # PP=4 x TP=4 over two nodes of 8 GPUs: two stages per node
    got = [local_device_index(pp, tp, tp_size=4, stages_per_node=2, gpus_on_node=8)
           for pp in range(4) for tp in range(4)]
    assert got == list(range(8)) * 2


def test_index_beyond_node_refused() -> None:
    with pytest.raises(ValueError, match="needs local GPU 8 but the node has 8 GPUs"):
        local_device_index(4, 0, tp_size=2, gpus_on_node=8)
    with pytest.raises(ValueError, match="tensor_parallel_rank=2 out of range"):
        local_device_index(0, 2, tp_size=2)


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8-11\n") == {0, 1, 2, 3, 8, 9, 10, 11}
    assert parse_cpulist("5") == {5}
    assert parse_cpulist("\n") == set()
    with pytest.raises(ValueError, match="'a-b'"):
        parse_cpulist("a-b")
    with pytest.raises(ValueError, match="ends before it starts"):
        parse_cpulist("4-2")


def test_parse_numa_bind() -> None:
    assert parse_numa_bind("0,0,0,0,1,1,1,1") == [0, 0, 0, 0, 1, 1, 1, 1]
    assert parse_numa_bind(" 1, 0 ") == [1, 0]
    for bad, match in (("", "empty entry"), ("0,,1", "empty entry"), ("0,x", "entry 1"), ("0,-1", "entry 1")):
        with pytest.raises(ValueError, match=match):
            parse_numa_bind(bad)


def _fake_sysfs(root: Path, cpulists: dict[int, str]) -> str:
    for node, text in cpulists.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(text + "\n")
    return str(root)


def test_cpus_of_numa_node(tmp_path: Path) -> None:
    root = _fake_sysfs(tmp_path, {0: "0-1,4", 1: "2-3"})
    assert cpus_of_numa_node(0, root) == {0, 1, 4}
    with pytest.raises(ValueError, match="NUMA node 7 does not exist"):
        cpus_of_numa_node(7, root)


def test_apply_numa_binding_sets_affinity(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    target = min(before)
    other = max(before)
    root = _fake_sysfs(tmp_path, {0: str(other), 1: str(target)})
    numa_nodes = parse_numa_bind("0,0,1,1")
    try:
        index = local_device_index(1, 0, tp_size=2)  # stage 1 -> local GPU 2 -> node 1
        assert apply_numa_binding(index, numa_nodes, root) == {target}
        assert os.sched_getaffinity(0) == {target}
        with pytest.raises(ValueError, match="local GPU 4 has no entry"):
            apply_numa_binding(4, numa_nodes, root)
    finally:
        os.sched_setaffinity(0, before)
    assert os.sched_getaffinity(0) == before
