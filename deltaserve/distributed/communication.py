"""Tensor-parallel collectives and pipeline-parallel activation transfer.

Every function here runs on every rank of the group it names, and each call is matched on all of
them (a rank that skips one hangs the rest). Without process groups (world size 1, or a group of
one) the collectives return their input unchanged and cost one attribute read.

Ranks that share one GPU cannot use NCCL (it refuses two ranks on one device), so they run gloo and
their CUDA tensors are staged through host memory here: correct, and slow; for tests only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltaserve.distributed import parallel_state


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` (any shape) over this rank's tensor-parallel group; returns the sum, same shape.

    Runs on every rank of the TP group. The reduction is in place on `x` when there is a group.
    """
    state = parallel_state._state
    if state is None or state.tp_group is None:
        return x
    x = x.contiguous()
    if _staged(state, x):
        host = x.cpu()
        dist.all_reduce(host, group=state.tp_group)
        return x.copy_(host)
    dist.all_reduce(x, group=state.tp_group)
    return x


def _staged(state: parallel_state.DistributedState, x: torch.Tensor) -> bool:
    """Whether `x` must go through host memory: a device tensor over gloo (ranks sharing a GPU)."""
    return state.backend == "gloo" and x.device.type != "cpu"


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's `x` along `dim`, in TP-rank order: [..., n, ...] -> [..., tp * n, ...].

    Runs on every rank of the TP group; every rank's `x` must have the same shape.
    """
    state = parallel_state._state
    if state is None or state.tp_group is None:
        return x
    x = x.contiguous()
    staged = _staged(state, x)
    src = x.cpu() if staged else x
    parts = [torch.empty_like(src) for _ in state.tp_ranks]
    dist.all_gather(parts, src, group=state.tp_group)
    out = torch.cat(parts, dim=dim)
    return out.to(x.device) if staged else out


def dcp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every DCP rank's `x` along `dim`, in DCP-rank order: [..., n, ...] -> [..., dcp * n, ...].

    Runs on every rank of this rank's decode-context-parallel group (consecutive TP ranks); every
    rank's `x` must have the same shape. Without a DCP group it returns `x`.
    """
    state = parallel_state._state
    group = getattr(state, "dcp_group", None)
    if state is None or group is None:
        return x
    x = x.contiguous()
    staged = _staged(state, x)
    src = x.cpu() if staged else x
    parts = [torch.empty_like(src) for _ in range(state.parallel.decode_context_parallel_size)]
    dist.all_gather(parts, src, group=group)
    out = torch.cat(parts, dim=dim)
    return out.to(x.device) if staged else out


def send_tensors(tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
    """Send named tensors to global rank `dst` (default: the same TP rank of the next stage).

    Runs on the sending stage; the receiver calls `recv_tensors` once per call. The metadata (names,
    shapes, dtypes) goes first as one object over the pipeline's CPU group, then each tensor over the
    device group, in name order; so the receiver allocates before the data arrives (NCCL needs that).
    Without a pipeline group (one stage) it does nothing.
    """
    state = parallel_state._state
    if state is None or state.pp_group is None:
        return
    dst = state.next_stage_rank if dst is None else dst
    names = sorted(tensors)
    meta = [(name, tuple(tensors[name].shape), tensors[name].dtype) for name in names]
    dist.send_object_list([meta], dst=dst, group=state.pp_cpu_group)
    for name in names:
        t = tensors[name].contiguous()
        dist.send(t.cpu() if _staged(state, t) else t, dst=dst, group=state.pp_group)


def recv_tensors(src: int | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Receive what one `send_tensors` call on global rank `src` sent (default: the same TP rank of the
    previous stage): name -> tensor on `device`, with the sender's shapes and dtypes.

    Runs on the receiving stage. Refused (RuntimeError) without a pipeline group or on the first stage.
    """
    state = parallel_state.get_distributed_state()
    if state.pp_group is None:
        raise RuntimeError("recv_tensors needs pipeline_parallel_size > 1: a single stage has nothing to receive")
    src = state.prev_stage_rank if src is None else src
    box: list[object] = [None]
    dist.recv_object_list(box, src=src, group=state.pp_cpu_group)
    out = {}
    staged = state.backend == "gloo" and torch.device(device).type != "cpu"
    for name, shape, dtype in box[0]:  # type: ignore[union-attr]
        t = torch.empty(shape, dtype=dtype, device="cpu" if staged else device)
        dist.recv(t, src=src, group=state.pp_group)
        out[name] = t.to(device) if staged else t
    return out
