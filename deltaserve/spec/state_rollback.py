"""KDA verify steps with rollback: the state after each verified token in its own pool slot (torch
references, which the KDA layer runs for verify windows off fla; `ops/kda/dispatch.kda_verify`).

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

import itertools
from collections.abc import Iterator

import torch

from deltaserve.ops.conv.naive import _activation, _taps
from deltaserve.ops.kda.naive import recurrent_kda_step


def _check_indices(state_indices: torch.Tensor, num_accepted: torch.Tensor, num_sequences: int,
                   num_tokens: int, check_values: bool = True) -> None:
    """Shapes always; num_accepted's range only with check_values (it reads the device back)."""
    if state_indices.shape != (num_sequences, num_tokens):
        raise ValueError(f"state_indices has shape {tuple(state_indices.shape)}; expected "
                         f"[{num_sequences}, {num_tokens}] (one slot per verified position)")
    if num_accepted.shape != (num_sequences,):
        raise ValueError(f"num_accepted has shape {tuple(num_accepted.shape)}; expected [{num_sequences}]")
    if check_values and bool(((num_accepted < 1) | (num_accepted > num_tokens)).any()):
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
                         activation: str | None = "silu", check_values: bool = True) -> torch.Tensor:
    """The short convolution over N sequences of T tokens, the window after token t stored in slot
    state_indices[n, t] (read from state_indices[n, num_accepted[n] - 1]). Every position at once: the
    window followed by the T inputs, cut into T frames of W taps (token t's output, and the frame's last
    W - 1 inputs as the window after it), the same products and sums as `causal_conv1d_decode` per token.

    Args:
        x: [N, T, D]. weight: [D, W] (or [D, 1, W]).
        conv_state_pool: [S, D, W - 1] windows, oldest first.
        state_indices: [N, T] long. num_accepted: [N] long in [1, T].
        check_values: check num_accepted's range (a host sync; off for callers that build it, such as
            a CUDA graph's capture).
    Returns:
        y: [N, T, D], dtype of x.
    """
    n, t, d = x.shape
    _check_indices(state_indices, num_accepted, n, t, check_values)
    act = _activation(activation)
    taps = _taps(weight, d)  # [D, W] float32
    rows = torch.arange(n, device=state_indices.device)
    start = state_indices[rows, num_accepted.to(state_indices.device) - 1].to(conv_state_pool.device)
    windows = conv_state_pool.index_select(0, start).to(x.device).float()  # [N, D, W - 1]
    full = torch.cat([windows, x.float().transpose(1, 2)], dim=-1)  # [N, D, W - 1 + T]
    frames = full.unfold(-1, taps.shape[1], 1).contiguous()  # [N, D, T, W]: token t's inputs
    y = (frames * taps[:, None, :]).sum(-1)  # [N, D, T]
    after = frames[..., 1:].transpose(1, 2).reshape(n * t, d, -1)  # [N * T, D, W - 1]: the window after t
    conv_state_pool.index_copy_(0, state_indices.reshape(-1).to(conv_state_pool.device),
                                after.to(device=conv_state_pool.device, dtype=conv_state_pool.dtype))
    return act(y).transpose(1, 2).to(x.dtype)


def _groups_by_length(seq_lens: list[int]) -> dict[int, list[int]]:
    """Sequence indices grouped by their length (each group runs as one [N, T] batch)."""
    groups: dict[int, list[int]] = {}
    for index, length in enumerate(seq_lens):
        groups.setdefault(length, []).append(index)
    return groups


def _window_groups(seq_lens: list[int], state_indices: torch.Tensor, device: torch.device,
                   ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per group of equal-length windows: (count, length, their flat rows [count * length] sequence-major,
    their slots [count, length], num_accepted [count] of ones: each starts from its first slot)."""
    starts = [0, *itertools.accumulate(seq_lens)]
    for length, members in _groups_by_length(seq_lens).items():
        rows = torch.tensor([starts[m] + t for m in members for t in range(length)], dtype=torch.long, device=device)
        pick = torch.tensor(members, dtype=torch.long, device=state_indices.device)
        indices = state_indices.index_select(0, pick)[:, :length]
        ones = torch.ones(len(members), dtype=torch.long, device=state_indices.device)
        yield len(members), length, rows, indices, ones


def recurrent_kda_verify_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, scale: float, state_pool: torch.Tensor,
                                seq_lens: list[int], state_indices: torch.Tensor) -> torch.Tensor:
    """`recurrent_kda_verify` over verify windows packed back to back, each starting from its first slot.

    Args:
        q, k, g: [T, H, K] (activated as for `recurrent_kda_verify`). v: [T, H, V]. beta: [T, H].
        seq_lens: the N windows' lengths on the host (they sum to T).
        state_indices: [N, max(seq_lens)] long; row n's first seq_lens[n] entries are its slots.
    Returns:
        o: [T, H, V] in q's dtype.
    """
    o = q.new_empty(v.shape)
    for count, length, rows, indices, ones in _window_groups(seq_lens, state_indices, q.device):
        shaped = [t.index_select(0, rows).view(count, length, *t.shape[1:]) for t in (q, k, v, g, beta)]
        out = recurrent_kda_verify(*shaped, scale, state_pool, indices, ones)
        o.index_copy_(0, rows, out.reshape(-1, *o.shape[1:]).to(o.dtype))
    return o


def causal_conv1d_verify_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state_pool: torch.Tensor,
                                seq_lens: list[int], state_indices: torch.Tensor,
                                activation: str | None = "silu") -> torch.Tensor:
    """`causal_conv1d_verify` over verify windows packed back to back: x [T, D] -> y [T, D]; seq_lens
    and state_indices as for `recurrent_kda_verify_varlen`. Windows of one length need no gather and no
    host sync (a verify CUDA graph's step)."""
    if len(set(seq_lens)) == 1:
        count, length = len(seq_lens), seq_lens[0]
        ones = torch.ones(count, dtype=torch.long, device=state_indices.device)
        out = causal_conv1d_verify(x.view(count, length, -1), weight, conv_state_pool, state_indices[:, :length],
                                   ones, activation, check_values=False)
        return out.reshape(x.shape)
    y = x.new_empty(x.shape)
    for count, length, rows, indices, ones in _window_groups(seq_lens, state_indices, x.device):
        out = causal_conv1d_verify(x.index_select(0, rows).view(count, length, -1), weight,
                                   conv_state_pool, indices, ones, activation, check_values=False)
        y.index_copy_(0, rows, out.reshape(-1, x.shape[1]))
    return y
