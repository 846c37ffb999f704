"""Readable references for Kimi Delta Attention (KDA): the token-by-token gated delta rule.

KDA keeps, per head, a state S [K, V]. Each token first decays every key channel of the state by
its own factor exp(g_t) (the per-channel forget gate), then writes the part of v_t that the decayed
state does not already predict for k_t (the delta rule, with step size beta_t), then reads out with
the query:

    S   <- diag(exp(g_t)) S
    S   <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t  = S^T (scale * q_t)

Everything here runs in float32 (or float64 if given float64), whatever the inputs' dtype.
"""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 when the input already is: references may be run in double precision."""
    return torch.promote_types(x.dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise the last dimension the way fla's kernels (and transformers' Kimi KDA) do.

    y = x / sqrt(sum(x^2) + eps): eps is added under the root, unlike `F.normalize`, which clamps
    the norm from below. Computed in float32.

    Args:
        x: [..., K].
    Returns:
        [..., K], dtype of x.
    """
    xf = x.to(compute_dtype(x))
    return (xf / torch.sqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The log-space per-channel decay g = -exp(A_log) * softplus(raw + dt_bias), in float32.

    Args:
        raw: [T, H, K], the forget-gate projection f_b(f_a(x)) before its bias.
        A_log: [H] (or any shape holding H values), one decay rate per head.
        dt_bias: [H * K].
    Returns:
        [T, H, K] float32.
    """
    T, H, K = raw.shape
    shifted = raw.float() + dt_bias.float().view(1, H, K)
    decay_rate = A_log.float().reshape(1, H, 1).exp()
    return -decay_rate * torch.nn.functional.softplus(shifted, beta=1.0, threshold=20.0)


def recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence for a batch of independent states.

    Args:
        q, k: [B, H, K]. g: [B, H, K] log-space decay. v: [B, H, V]. beta: [B, H].
        state: [B, H, K, V], not modified.
    Returns:
        (o [B, H, V], new_state [B, H, K, V]), in the compute dtype.
    """
    dt = torch.promote_types(compute_dtype(state), q.dtype)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    s = state.to(dt) * g.exp().unsqueeze(-1)
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = beta.unsqueeze(-1) * (v - predicted)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q * scale, s)
    return o, s


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over one sequence, one token at a time.

    Args:
        q, k: [T, H, K] (k l2-normalised by the caller; q not yet scaled).
        v: [T, H, V].
        g: [T, H, K] log-space per-channel decay (<= 0).
        beta: [T, H] delta-rule step size.
        scale: multiplies q, usually K ** -0.5.
        initial_state: [H, K, V] or None for zeros; not modified.
    Returns:
        o: [T, H, V] float32 (float64 for float64 inputs).
        final_state: [H, K, V], same dtype as o.
    """
    T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(compute_dtype(q), v.dtype)
    state = q.new_zeros(1, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)[None]
    o = q.new_empty(T, H, V, dtype=dt)
    for t in range(T):
        o_t, state = recurrent_kda_step(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], scale, state
        )
        o[t] = o_t[0]
    return o, state[0]
