"""Chunked KDA in plain PyTorch: the same recurrence as `naive.py`, a chunk of tokens at a time.

Within a chunk of C tokens starting from state S0, let G_t be the cumulative log-decay from the chunk
start up to and including token t. Unrolling the recurrence gives the state after token t as

    S_t = diag(exp(G_t)) S0 + sum_{j <= t} diag(exp(G_t - G_j)) k_j u_j^T

where u_j is the value actually written by token j. The u_j depend on each other through a unit
lower-triangular system (the WY / UT form of the delta rule):

    (I + diag(beta) A_kk) U = diag(beta) (V - (K * exp(G)) S0)
    A_kk[t, j] = k_t^T diag(exp(G_t - G_j)) k_j   for j < t, else 0

so U = u_hat - w S0 with u_hat, w from one triangular solve. Outputs and the next state follow with
matrix products. Every exponent used is G_t - G_j with j <= t, G_t, or G_last - G_t: all <= 0 for
decays g <= 0, so nothing overflows however strong the decay; the pairwise differences are masked
above the diagonal before `exp` for the same reason.
"""

from __future__ import annotations

import torch

from deltaserve.ops.kda.naive import compute_dtype


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA over one sequence, `chunk_size` tokens at a time; same contract as `naive_recurrent_kda`.

    Args:
        q, k: [T, H, K] (k l2-normalised by the caller; q not yet scaled).
        v: [T, H, V].
        g: [T, H, K] log-space per-channel decay (<= 0).
        beta: [T, H].
        scale: multiplies q.
        initial_state: [H, K, V] or None for zeros; not modified.
        chunk_size: tokens per chunk. Memory per chunk is H * chunk_size^2 * K elements.
    Returns:
        o: [T, H, V] float32 (float64 for float64 inputs).
        final_state: [H, K, V], same dtype as o.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    T, H, K = k.shape
    V = v.shape[-1]
    dt = torch.promote_types(compute_dtype(q), v.dtype)
    # Head-major layout [H, T, ...] so every per-chunk product is a batched matmul over heads.
    q = (q.to(dt) * scale).transpose(0, 1)
    k, v, g = (t.to(dt).transpose(0, 1) for t in (k, v, g))
    beta = beta.to(dt).transpose(0, 1)
    state = q.new_zeros(H, K, V) if initial_state is None else initial_state.to(dt).clone()
    o = q.new_empty(H, T, V)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()

    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        c = end - start
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        G = g[:, start:end].cumsum(dim=1)  # [H, c, K]
        mask = causal[:c, :c, None]
        # [H, c(t), c(j), K]; -inf above the diagonal so exp never sees a positive difference.
        pair = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~mask, float("-inf")).exp()
        a_qk = (qc.unsqueeze(2) * pair * kc.unsqueeze(1)).sum(-1)  # [H, c, c], lower incl. diagonal
        a_kk = (kc.unsqueeze(2) * pair * kc.unsqueeze(1)).sum(-1).tril(-1) * bc.unsqueeze(-1)

        decay_in = G.exp()  # decay from chunk start to token t, inclusive
        rhs = bc.unsqueeze(-1) * torch.cat([vc, kc * decay_in], dim=-1)
        # unitriangular=True: the implicit unit diagonal supplies the I in (I + diag(beta) A_kk).
        sol = torch.linalg.solve_triangular(a_kk, rhs, upper=False, unitriangular=True)
        u_hat, w = sol[..., :V], sol[..., V:]

        u = u_hat - w @ state  # [H, c, V]
        o[:, start:end] = (qc * decay_in) @ state + a_qk @ u
        g_last = G[:, -1]  # [H, K]
        decay_out = (g_last.unsqueeze(1) - G).exp()  # decay from token t to chunk end, exclusive of t
        state = g_last.exp().unsqueeze(-1) * state + (kc * decay_out).transpose(1, 2) @ u

    return o.transpose(0, 1), state
