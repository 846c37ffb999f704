"""Depthwise causal short convolution over packed variable-length sequences, with a cached window.

Each channel d has its own W taps: y_t[d] = act(sum_j weight[d, j] * x_{t - (W - 1) + j}[d]), no bias
(Kimi's q/k/v convolution has none). Inputs before a sequence's first token come from its cached
window (the last W - 1 inputs seen so far, oldest first) or are zeros for a fresh sequence. After
the call the window holds the last W - 1 inputs of old window + new tokens, so a sequence can be
fed in any number of pieces and gives the same outputs as all at once.

Computed in float32 and returned in the input dtype. The window stores raw inputs, so with a pool in
the model dtype it round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str | None, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    None: lambda t: t,
}


def _activation(name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; use one of {list(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _taps(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """[D, W] float32 taps; accepts nn.Conv1d's [D, 1, W] layout too."""
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if weight.dim() != 2 or weight.shape[0] != dim:
        raise ValueError(f"conv weight must be [D={dim}, W] or [D, 1, W], got {list(weight.shape)}")
    return weight.float()


def initial_windows(conv_state_pool: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor,
                    ) -> torch.Tensor:
    """The windows prefill continues from: pool [S, D, W - 1], slots [N] long, has_initial_state [N] bool
    -> [N, D, W - 1] on the pool's device, zeros for sequences without one."""
    windows = conv_state_pool.index_select(0, slots)
    keep = has_initial_state.to(device=windows.device, dtype=torch.bool).view(-1, 1, 1)
    # `where`, not a multiply: NaN / inf garbage in a fresh sequence's slot must not leak in
    return torch.where(keep, windows, torch.zeros((), dtype=windows.dtype, device=windows.device))


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv over N packed sequences, continuing from and updating pooled windows.

    Args:
        x: [T, D] inputs, sequences back to back.
        weight: [D, W] (or [D, 1, W]).
        cu_seqlens: [N + 1] long, sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1].
        conv_state_pool: [S, D, W - 1] windows, oldest input first. Slot state_slots[i] is read when
            has_initial_state[i] and overwritten in place with the sequence's new window; other slots
            are untouched.
        state_slots: [N] long, distinct.
        has_initial_state: [N] bool; False means zeros before the first token (the slot is not read).
        activation: "silu" or None.
    Returns:
        y: [T, D], dtype of x.
    """
    act = _activation(activation)
    T, D = x.shape
    taps = _taps(weight, D)
    W = taps.shape[1]
    P = W - 1
    device = x.device
    slots = state_slots.to(device=conv_state_pool.device, dtype=torch.long)
    N = slots.numel()
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if N == 0:
        return x.new_zeros(x.shape)

    windows = initial_windows(conv_state_pool, slots, has_initial_state).to(device)  # [N, D, P]
    # One table of every input a tap can see: the new tokens, then each sequence's window.
    table = torch.cat([x.float(), windows.float().transpose(1, 2).reshape(N * P, D)])

    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    seq_ids = torch.arange(N, device=device)

    def rows(seq: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        # Local position p >= 0 is token starts[seq] + p; p in [-P, 0) is window column P + p.
        return torch.where(local >= 0, starts[seq] + local, T + seq * P + P + local)

    token_seq = torch.repeat_interleave(seq_ids, lengths, output_size=T)  # [T]
    token_pos = torch.arange(T, device=device) - starts[token_seq]
    y = torch.zeros(T, D, dtype=torch.float32, device=device)
    for j in range(W):  # W is 2..4: a loop over taps, not tokens
        y += taps[:, j] * table[rows(token_seq, token_pos - P + j)]

    if P:
        window_pos = lengths.unsqueeze(1) - P + torch.arange(P, device=device)  # [N, P]
        new_windows = table[rows(seq_ids.unsqueeze(1).expand(N, P), window_pos)]  # [N, P, D]
        new_windows = new_windows.transpose(1, 2).to(
            device=conv_state_pool.device, dtype=conv_state_pool.dtype
        )
        conv_state_pool.index_copy_(0, slots, new_windows)
    return act(y).to(x.dtype)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new token for each of B sequences; shifts each pooled window by one in place.

    Args:
        x: [B, D].
        weight: [D, W] (or [D, 1, W]).
        conv_state_pool: [S, D, W - 1] windows, oldest first; slots state_slots are read and
            overwritten, others untouched.
        state_slots: [B] long, distinct.
        activation: "silu" or None.
    Returns:
        y: [B, D], dtype of x.
    """
    act = _activation(activation)
    taps = _taps(weight, x.shape[1])
    slots = state_slots.to(device=conv_state_pool.device, dtype=torch.long)
    if slots.numel() == 0:
        return x.new_zeros(x.shape)
    windows = conv_state_pool.index_select(0, slots).to(x.device)  # [B, D, W - 1]
    full = torch.cat([windows.float(), x.float().unsqueeze(-1)], dim=-1)  # [B, D, W]
    y = (full * taps).sum(-1)
    conv_state_pool.index_copy_(
        0, slots, full[..., 1:].to(device=conv_state_pool.device, dtype=conv_state_pool.dtype)
    )
    return act(y).to(x.dtype)
