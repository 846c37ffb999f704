"""Prefill chunks that capture KDA checkpoints inside them: the recurrent parts of a layer (the short
convolution, the delta rule) run in rounds cut at the capture points, the rest of the model once.

A chunk of n tokens with capture points 0 < o_1 < ... < o_m < n runs as pieces [0, o_1), [o_1, o_2), ...,
[o_m, n); round r runs the r-th piece of every chunk that has one, as one varlen batch, each piece
starting from the state the previous one left in the chunk's slot; after a piece that ends at a capture
point the layer hands the slot to its capture function, which writes that part of the checkpoint image.
The pieces do the arithmetic chunked prefill did when chunks ended at checkpoints, without a forward
pass of the whole model per checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (rows [R, ...] of each input, cu_seqlens [N' + 1] on the device and on the host, slots [N'],
#  has_initial_state [N']) -> output rows [R, ...]
RecurrentRun = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Capture = Callable[[int, tuple[int, ...]], None]  # (slot, unit ids)


def run_in_rounds(run: RecurrentRun, inputs: list[torch.Tensor], cu_seqlens_cpu: list[int], slots: torch.Tensor,
                  has_initial_state: torch.Tensor, captures: tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...],
                  capture: Capture | None, out: torch.Tensor) -> torch.Tensor:
    """Fill `out` (rows of all chunks, as `run` would return them in one call) piece by piece; captures[i]
    holds chunk i's (offset, slot, unit ids) in order."""
    device = inputs[0].device
    pieces = []  # per chunk: its piece bounds, in rows
    for i in range(len(cu_seqlens_cpu) - 1):
        bos, eos = cu_seqlens_cpu[i], cu_seqlens_cpu[i + 1]
        cuts = [bos + offset for offset, _, _ in captures[i]] if i < len(captures) else []
        bounds = [bos, *cuts, eos]
        pieces.append(list(zip(bounds[:-1], bounds[1:], strict=True)))
    for r in range(max(len(p) for p in pieces)):
        members = [i for i, p in enumerate(pieces) if r < len(p)]
        rows, cu = [], [0]
        for i in members:
            start, stop = pieces[i][r]
            rows += range(start, stop)
            cu.append(len(rows))
        index = torch.tensor(rows, dtype=torch.long, device=device)
        pick = torch.tensor(members, dtype=torch.long, device=slots.device)
        initial = has_initial_state.index_select(0, pick) if r == 0 else torch.ones_like(pick, dtype=torch.bool)
        cu_host = torch.tensor(cu, dtype=torch.long)
        result = run([x.index_select(0, index) for x in inputs], cu_host.to(device), cu_host,
                     slots.index_select(0, pick), initial)
        out.index_copy_(0, index, result.to(out.dtype))
        if capture is not None:
            for i in members:
                if r < len(captures[i]):
                    _, slot, unit_ids = captures[i][r]
                    capture(slot, unit_ids)
    return out
