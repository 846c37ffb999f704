"""KDA verify steps with rollback: the state after each verified token in its own pool slot (torch
references; not wired into the model yet).

A verify step runs a request's last token and its k drafts, T = k + 1 tokens. Instead of rewinding a
recurrent state (impossible) or recomputing the accepted tokens, it keeps one state per position: the
request holds T slots, `state_indices[n, t]` receives the state (and the conv window) after token t, and
the next step starts from the slot of the last token the sampler accepted,
`state_indices[n, num_accepted[n] - 1]`. This is the contract of fla 0.6's `fused_recurrent_kda_fwd`
with a 2-D `ssm_state_indices` and `num_accepted_tokens` (the kernel vLLM's hybrid models use for
speculative decoding); the references here follow it so CPU runs and tests do the same thing, and a
GPU test compares them with fla.

Each step's arithmetic is that of plain decoding (`recurrent_kda_step`, `causal_conv1d_decode`), in
the same order, so the state after accepting j drafts is bit for bit the state plain decoding of those
j + 1 tokens leaves.
"""

from __future__ import annotations

import torch

from deltaserve.ops.conv.naive import causal_conv1d_decode
from deltaserve.ops.kda.naive import recurrent_kda_step


def _check_indices(state_indices: torch.Tensor, num_accepted: torch.Tensor, num_sequences: int,
                   num_tokens: int) -> None:
    if state_indices.shape != (num_sequences, num_tokens):
        raise ValueError(f"state_indices has shape {tuple(state_indices.shape)}; expected "
                         f"[{num_sequences}, {num_tokens}] (one slot per verified position)")
    if num_accepted.shape != (num_sequences,):
        raise ValueError(f"num_accepted has shape {tuple(num_accepted.shape)}; expected [{num_sequences}]")
    if bool(((num_accepted < 1) | (num_accepted > num_tokens)).any()):
        raise ValueError(f"num_accepted must lie in [1, {num_tokens}] (tokens the previous step accepted, "
                         "its bonus or recovered token included)")


def recurrent_kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, state_pool: torch.Tensor, state_indices: torch.Tensor,
                         num_accepted: torch.Tensor) -> torch.Tensor:
    """KDA over N sequences of T tokens each, the state after token t stored in slot state_indices[n, t].

    Args:
        q, k: [N, T, H, K] (k l2-normalised by the caller; q not yet scaled). g: [N, T, H, K] log-space
            decay. v: [N, T, H, V]. beta: [N, T, H].
        state_pool: [S, H, K, V] float32 recurrent states; row state_indices[n, num_accepted[n] - 1] is
            read, rows state_indices[n, :] are written.
        state_indices: [N, T] long, distinct within a row.
        num_accepted: [N] long in [1, T]: the previous step's accepted tokens (1 after plain decode).
    Returns:
        o: [N, T, H, V] in q's dtype.
    """
    n, t = q.shape[:2]
    _check_indices(state_indices, num_accepted, n, t)
    rows = torch.arange(n, device=state_indices.device)
    start = state_indices[rows, num_accepted.to(state_indices.device) - 1]
    state = state_pool.index_select(0, start.to(state_pool.device))
    outputs = []
    for i in range(t):
        o, state = recurrent_kda_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], scale, state)
        state_pool.index_copy_(0, state_indices[:, i].to(state_pool.device), state.to(state_pool.dtype))
        outputs.append(o.to(q.dtype))
    return torch.stack(outputs, dim=1)


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                         state_indices: torch.Tensor, num_accepted: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """The short convolution over N sequences of T tokens, the window after token t stored in slot
    state_indices[n, t] (read from state_indices[n, num_accepted[n] - 1]).

    Args:
        x: [N, T, D]. weight: [D, W] (or [D, 1, W]).
        conv_state_pool: [S, D, W - 1] windows, oldest first.
        state_indices: [N, T] long. num_accepted: [N] long in [1, T].
    Returns:
        y: [N, T, D], dtype of x.
    """
    n, t = x.shape[:2]
    _check_indices(state_indices, num_accepted, n, t)
    rows = torch.arange(n, device=state_indices.device)
    start = state_indices[rows, num_accepted.to(state_indices.device) - 1].to(conv_state_pool.device)
    first = state_indices[:, 0].to(conv_state_pool.device)
    # the window to start from, moved into the first position's slot (it is overwritten by token 0's)
    conv_state_pool.index_copy_(0, first, conv_state_pool.index_select(0, start))
    slots = state_indices.to(conv_state_pool.device)
    outputs = []
    for i in range(t):
        if i:  # token i shifts the window token i - 1 left, in slot i
            conv_state_pool.index_copy_(0, slots[:, i], conv_state_pool.index_select(0, slots[:, i - 1]))
        outputs.append(causal_conv1d_decode(x[:, i], weight, conv_state_pool, slots[:, i], activation))
    return torch.stack(outputs, dim=1)
