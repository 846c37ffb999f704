"""Linear layers built for one tensor-parallel rank.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies this rank's slice of a
checkpoint tensor into it, so the model's loader never needs to know how a layer is split. With a
parallel size of 1 every slice is the whole tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.config.parallel import ParallelConfig, divide


def copy_shard(
    param: torch.Tensor,
    loaded: torch.Tensor,
    dim: int,
    rank: int,
    world: int,
    param_offset: int = 0,
) -> None:
    """Copy rank `rank`'s 1/`world` slice of `loaded` along `dim` into `param[..., param_offset:...]`."""
    size = divide(loaded.shape[dim], world, f"dimension {dim} of a tensor of shape {tuple(loaded.shape)}")
    piece = loaded.narrow(dim, rank * size, size)
    target = param.data.narrow(dim, param_offset, size)
    if target.shape != piece.shape:
        raise ValueError(f"shape mismatch: parameter slice {tuple(target.shape)} vs checkpoint {tuple(piece.shape)}")
    target.copy_(piece)


def replicated_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def sharded_param(
    shape: Sequence[int],
    dtype: torch.dtype,
    dim: int | None,
    parallel: ParallelConfig,
    piece_sizes: Sequence[int] | None = None,
) -> nn.Parameter:
    """A parameter of this rank's `shape`, split along `dim` (None = replicated).

    `piece_sizes` (full, unsplit sizes along `dim`) describe a parameter fused from several
    checkpoint tensors; the loader's `shard_id` is then the piece's index.
    """
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    world, rank = parallel.tensor_parallel_size, parallel.tensor_parallel_rank
    if dim is None:
        param.weight_loader = replicated_loader
        return param
    offsets = [0]
    for size in piece_sizes or ():
        offsets.append(offsets[-1] + divide(size, world, "fused piece size"))

    def loader(p: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            offset, full = 0, p.shape[dim] * world
        else:
            offset, full = offsets[shard_id], piece_sizes[shard_id]
        expected = list(p.shape)
        expected[dim] = full
        if list(loaded.shape) != expected:
            raise ValueError(
                f"shape mismatch: expected {tuple(expected)} from the checkpoint, got {tuple(loaded.shape)}"
            )
        copy_shard(p, loaded, dim, rank, world, offset)

    param.weight_loader = loader
    return param


class Linear(nn.Module):
    """y = x W^T (+ b) where W is this rank's shard.

    split: "column" splits the output features over ranks, "row" the input features (its output is
    this rank's partial sum: the block that owns it all-reduces once, after everything it sums, see
    KimiDeltaAttention, MultiheadLatentAttention, DenseMLP and SparseMoE), None keeps the whole matrix
    on every rank.
    output_sizes: for a column-split layer fused from several checkpoint matrices, their output sizes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        split: str | None = None,
        bias: bool = False,
        output_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        world = parallel.tensor_parallel_size
        if split not in (None, "column", "row"):
            raise ValueError(f"split={split!r} must be 'column', 'row' or None")
        local_out = divide(out_features, world, "out_features") if split == "column" else out_features
        local_in = divide(in_features, world, "in_features") if split == "row" else in_features
        dim = {"column": 0, "row": 1, None: None}[split]
        self.weight = sharded_param((local_out, local_in), dtype, dim, parallel, output_sizes)
        self.bias = sharded_param((local_out,), dtype, 0 if split == "column" else None, parallel) if bias else None
        self.in_features, self.out_features = local_in, local_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features]."""
        return F.linear(x, self.weight, self.bias)


def fuse_weights(linears: Sequence[Linear | nn.Linear]) -> torch.Tensor:
    """One weight [sum of their out_features, in_features] for layers (ours or torch's) that read the same
    input, so one GEMM computes all their outputs (side by side, in order). Each layer's weight becomes a
    view of it: the layers still load and run on their own, and no memory is added."""
    if any(layer.bias is not None for layer in linears) or len({layer.in_features for layer in linears}) != 1:
        raise ValueError("only bias-free layers of one input size fuse")
    fused = torch.cat([layer.weight.data for layer in linears])
    offset = 0
    for layer in linears:
        rows = layer.weight.shape[0]
        layer.weight.data = fused[offset : offset + rows]
        offset += rows
    return fused
