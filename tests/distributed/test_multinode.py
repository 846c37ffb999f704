"""Two nodes on 127.0.0.1: the head (`LLM(..., nnodes=2, node_rank=0)` in this process, with its
ranks) and a worker node (`deltaserve serve ... --nnodes 2 --node-rank 1`, a process group of its
own), meeting at master_addr:master_port over gloo and ZeroMQ.

- TP=2 x PP=2 over two nodes gives the single-process engine's tokens (the multi-process scenarios of
  test_multiproc_engine); each rank binds its CPUs by --numa-bind through its node-local index (a
  fake sysfs maps NUMA node 0 and 1 to one CPU each), and the stages report their busy time; when the
  head shuts down, the worker node exits 0.
- PP=2 over two nodes: SIGKILL to the worker node's process group makes the head raise
  RankFailedError naming the node and its ranks, and the head's ranks are stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_reference import checkpoint_dir, random_prompts, tiny_hub_config

from deltaserve import LLM, SamplingParams
from deltaserve.executor.multiproc import RankFailedError
from distributed.test_multiproc_engine import COMMON, _alive, _assert_same, run_scenarios


def _free_base_port() -> int:
    """A port p with p .. p + 3 free on 127.0.0.1 (torch's rendezvous and the three channels)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 3 >= 65535:
            continue
        try:
            for port in range(base, base + 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no four consecutive free ports on 127.0.0.1")


class WorkerNode:
    """`deltaserve serve ... --node-rank 1` in a process group of its own, logging to a file."""

    def __init__(self, log_path: Path, model: str, port: int, *args: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.log_file = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deltaserve.cli", "serve", "--model", model, "--nnodes", "2", "--node-rank", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--dtype", "float32", "--device", "cpu",
             *args],
            stdout=self.log_file, stderr=subprocess.STDOUT, env=dict(env or os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_group()
        self.proc.wait(30)
        self.kill_group()  # its ranks, if any outlived it
        self.log_file.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path, _ = checkpoint_dir(tmp_path_factory, "multinode", tiny_hub_config(), seed=31)
    return path


@pytest.fixture(scope="module")
def fake_numa(tmp_path_factory) -> tuple[str, dict[int, set[int]]]:
    """A sysfs node root: NUMA node 0 holds this process's first CPU, node 1 its last."""
    root = tmp_path_factory.mktemp("sysfs-node")
    cpus = sorted(os.sched_getaffinity(0))
    nodes = {0: {cpus[0]}, 1: {cpus[-1]}}
    for node, members in nodes.items():
        (root / f"node{node}").mkdir()
        (root / f"node{node}" / "cpulist").write_text(",".join(map(str, sorted(members))) + "\n")
    return str(root), nodes


@pytest.fixture(scope="module")
def two_node_world(model_dir, fake_numa, tmp_path_factory) -> Iterator[dict]:
    """TP=2 x PP=2 over two nodes; yields what the tests compare, after the head shut down."""
    sysfs_root, _ = fake_numa
    port = _free_base_port()
    env = dict(os.environ, DELTASERVE_SYSFS_NODE_ROOT=sysfs_root)
    node = WorkerNode(tmp_path_factory.mktemp("node1") / "log.txt", model_dir, port, "-tp", "2", "-pp", "2",
                      "--numa-bind", "0,1", env=env)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DELTASERVE_SYSFS_NODE_ROOT", sysfs_root)  # the head's ranks read it at spawn
            llm = LLM(model=model_dir, **COMMON, tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                      node_rank=0, master_addr="127.0.0.1", master_port=port, numa_bind="0,1")
        try:
            executor = llm.llm_engine.executor
            world = {"ready": list(executor.ready), "pids": executor.rank_pids(), "results": run_scenarios(llm),
                     "metrics": llm.get_metrics()["executor"]}
        finally:
            llm.shutdown()
        world["node_exit"] = node.wait(60)
        world["node_log"] = node.log
        yield world
    finally:
        node.stop()


def test_two_nodes_equal_single_process(two_node_world, model_dir):
    want = run_scenarios(LLM(model=model_dir, **COMMON))
    got = two_node_world["results"]
    for i, (g, w) in enumerate(zip(got["batch"], want["batch"], strict=True)):
        _assert_same(g, w, f"batch request {i}")
    _assert_same(got["turn1"], want["turn1"], "first turn")
    _assert_same(got["turn2"], want["turn2"], "second turn")
    assert got["turn2_cached"] > 0
    assert got["abort"]["abort0"] == want["abort"]["abort0"]
    assert got["max_in_flight"] == 2
    # ranks 0, 1 on the head, 2, 3 on the worker node: the local index restarts on each node
    assert [(r.rank, r.node_rank, r.local_index) for r in two_node_world["ready"]] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert two_node_world["node_exit"] == 0, two_node_world["node_log"]
    assert not any(_alive(pid) for pid in two_node_world["pids"]), "every rank of both nodes is stopped"


def test_each_rank_binds_the_numa_node_of_its_local_index(two_node_world, fake_numa):
    _, nodes = fake_numa
    for ready in two_node_world["ready"]:
        # numa_bind "0,1": local GPU 0 -> NUMA node 0, local GPU 1 -> NUMA node 1, on both nodes
        assert set(ready.cpu_affinity) == nodes[ready.local_index], ready


def test_stage_busy_time_and_batches_in_flight(two_node_world):
    metrics = two_node_world["metrics"]
    assert metrics["nnodes"] == 2
    assert len(metrics["stage_busy_seconds"]) == 2 and all(b > 0 for b in metrics["stage_busy_seconds"])
    assert len(metrics["stage_steps"]) == 2 and all(n > 0 for n in metrics["stage_steps"])
    assert metrics["batches_in_flight"] == 0 and metrics["max_batches_in_flight"] == 2


def test_numa_bind_shorter_than_the_ranks_per_node_is_refused():
    from deltaserve.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match=r"numa_bind='0' has 1 entries but each node runs 2 ranks"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                     master_port=29600, numa_bind="0")
    with pytest.raises(ValueError, match=r"node_rank=2 must be below nnodes=2"):
        EngineConfig(pipeline_parallel_size=2, nnodes=2, node_rank=2, master_addr="h", master_port=29600)
    with pytest.raises(ValueError, match=r"nnodes=2 must divide tensor_parallel_size=2 x pipeline_parallel_size=1"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, master_addr="h", master_port=29600)
    with pytest.raises(ValueError, match=r"nnodes=2 needs master_addr and master_port"):
        EngineConfig(pipeline_parallel_size=2, nnodes=2)


def test_killed_worker_node_stops_the_head_naming_its_ranks(model_dir, tmp_path):
    port = _free_base_port()
    node = WorkerNode(tmp_path / "log.txt", model_dir, port, "-pp", "2")
    try:
        llm = LLM(model=model_dir, **COMMON, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                  master_addr="127.0.0.1", master_port=port)
        pids = llm.llm_engine.executor.rank_pids()
        try:
            engine = llm.llm_engine
            for i, p in enumerate(random_prompts([60, 45], 320, seed=2)):
                engine.add_request(f"k{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=50))
            engine.step()
            node.kill_group()
            with pytest.raises(RankFailedError, match=r"node 1 \(rank 1\) is gone"):
                for _ in range(200):
                    engine.step()
            assert not _alive(pids[0]), "the head's rank is stopped with it"
        finally:
            llm.shutdown()
    finally:
        node.stop()
