"""Checking CUDA-graph replays against their own padded layouts run eagerly (GPU tests)."""

from __future__ import annotations

import torch


def check_replays_against_layout(runner, graphs, layout) -> list[bool]:
    """Wrap `graphs.run` so each replay is first run as `layout` (the same sizes laid out without a
    capture, eagerly, on a copy of every KDA state, which the replay then steps) and compared bit for bit;
    returns the list the comparisons are appended to."""
    layers = list(runner.model.kda_layers())
    same, replay = [], graphs.run

    def checked_run(input_ids, context):
        saved = [(t, t.clone()) for layer in layers for t in (layer.conv_state, layer.recurrent_state)]
        with torch.inference_mode():
            eager = layout.run(input_ids, context).clone()
        for tensor, copy in saved:
            tensor.copy_(copy)
        logits = replay(input_ids, context)
        same.append(torch.equal(logits, eager))
        return logits

    graphs.run = checked_run
    return same
