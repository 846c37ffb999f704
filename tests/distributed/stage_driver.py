"""Runs one rank's pipeline stage for a SchedulerOutput outside the engine, and the rank processes.

The engine's ModelRunner calls `model(input_ids)` and samples, which only a single stage can do; here
each step reuses the runner's `prepare` (block tables, forward context) and runs the stage's forward
itself: receive the previous stage's stream, run the layers, send the stream on, or (last stage)
return the logits of the rows that sample.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

from deltaserve.config.engine_config import EngineConfig
from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.core.cache_sizing import CachePlan
from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.distributed import destroy_distributed, init_distributed, recv_tensors, send_tensors
from deltaserve.model.forward_context import set_forward_context
from deltaserve.model.kimi_linear import IntermediateTensors
from deltaserve.worker.worker import Worker

PLAN = CachePlan(num_blocks=32, num_state_slots=8, kv_bytes=0, state_bytes=0)
BLOCK_SIZE = 16


def make_worker(model_dir: str, parallel: ParallelConfig) -> Worker:
    """A float32 CPU worker of this rank's stage and shards, caches bound per PLAN."""
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", block_size=BLOCK_SIZE,
                          enable_prefix_caching=False)
    worker = Worker(config, KimiLinearConfig.from_pretrained(model_dir), model_dir, parallel=parallel)
    worker.load_model()
    worker.initialize_cache(PLAN)
    return worker


@torch.inference_mode()
def run_stage(worker: Worker, scheduler_output: SchedulerOutput) -> tuple[list[str], torch.Tensor] | None:
    """One step of this rank's stage (every rank of the world runs it, in step order).

    Returns, on the last stage, (request ids that sample, their float32 logits [N, vocab]); else None.
    """
    runner, parallel = worker.runner, worker.parallel
    assert runner is not None
    runner.block_tables.drop(scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids)
    if not scheduler_output.chunks:
        return None
    step = runner.prepare(scheduler_output)
    model = runner.model
    with set_forward_context(step.context):
        if parallel.is_first_stage:
            out = model(step.input_ids)
        else:
            out = model(intermediate=IntermediateTensors.from_dict(recv_tensors()))
    if not parallel.is_last_stage:
        assert isinstance(out, IntermediateTensors)
        send_tensors(out.to_dict())
        return None
    return [c.request_id for c in step.sample_chunks], model.compute_logits(out[step.sample_rows])


def routed_experts(worker: Worker) -> dict[int, tuple[Any, Any]]:
    """{layer id: (w13, w2) as numpy arrays} of this rank's MoE layers: its shard of the routed experts."""
    from deltaserve.model.layers.moe import SparseMoE

    assert worker.runner is not None
    return {layer.layer_id: (layer.mlp.w13.numpy(), layer.mlp.w2.numpy())
            for layer in worker.runner.model.layers.values() if isinstance(layer.mlp, SparseMoE)}


def rank_main(rank: int, tp: int, pp: int, init_method: str, model_dir: str, inbox: Any, outbox: Any,
              use_runner: bool = False, enable_expert_parallel: bool = False) -> None:
    """A rank process: join the world, load its shard, report ("ready", its `routed_experts`), then run
    every SchedulerOutput from `inbox` (None ends) and put (rank, result) on `outbox`; an exception
    goes to `outbox` as text.

    use_runner (one stage only): run the step through the engine's own path, `Worker.execute_model`,
    and report (request ids, sampled token ids) instead of logits.
    enable_expert_parallel: each TP rank holds whole experts (see SparseMoE).
    """
    sys.modules["fla"] = None  # as tests/conftest.py: the CPU path, not fla's Triton kernels
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        parallel = init_distributed(tp, pp, rank, tp * pp, init_method, backend="gloo",
                                    enable_expert_parallel=enable_expert_parallel)
        worker = make_worker(model_dir, parallel)
        outbox.put((rank, ("ready", routed_experts(worker))))
        while (scheduler_output := inbox.get()) is not None:
            if use_runner:
                out = worker.execute_model(scheduler_output)
                outbox.put((rank, (out.request_ids, out.sampled_token_ids) if out.request_ids else None))
                continue
            result = run_stage(worker, scheduler_output)
            outbox.put((rank, None if result is None else (result[0], result[1].numpy())))
    except BaseException:  # report, so the parent fails with the rank's traceback instead of a timeout
        outbox.put((rank, "error:\n" + traceback.format_exc()))
    finally:
        destroy_distributed()
