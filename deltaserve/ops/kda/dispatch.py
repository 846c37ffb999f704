"""Varlen KDA entry points used by the model, over a pool of per-request recurrent states.

Two backends:
- "fla": fla-core 0.6's Triton kernels (`chunk_kda` for prefill, `fused_recurrent_kda` for decode),
  used on CUDA tensors when `fla` imports.
- "torch": the references in `naive.py` / `chunk.py`, used on CPU, when fla is missing, or when
  forced with DELTASERVE_KDA_BACKEND=torch.

DELTASERVE_KDA_BACKEND is read on every call: "auto" (default), "torch" or "fla" ("fla" fails
loudly if it cannot be used). fla is imported lazily, so CPU runs never import it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from deltaserve.ops.kda.chunk import chunk_kda_torch
from deltaserve.ops.kda.fla_tuning import use_shipped_configs
from deltaserve.ops.kda.naive import kda_gate, l2norm, naive_recurrent_kda, recurrent_kda_step

BACKEND_ENV = "DELTASERVE_KDA_BACKEND"
BACKENDS = ("auto", "torch", "fla")
# Below this many tokens the token loop is as cheap as setting up chunks.
CHUNK_THRESHOLD = 16


@functools.lru_cache(maxsize=1)
def _fla_kda() -> ModuleType | None:
    try:
        use_shipped_configs()  # before fla's import, which reads the variables it sets
        import fla.ops.kda as fla_kda
    except Exception:  # ImportError, or a Triton/driver failure while fla initialises
        return None
    return fla_kda


@functools.lru_cache(maxsize=1)
def _fla_fused_recurrent_fwd():
    """fla's forward with `ssm_state_indices` + `inplace_final_state`: reads and writes pool slots by index."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    return fused_recurrent_kda_fwd


@dataclass(frozen=True)
class KDAGate:
    """The layer's gate parameters, for calls that pass raw (pre-activation) inputs.

    With a KDAGate, `g` is the forget-gate projection f_b(f_a(x)) before dt_bias, `beta` is the
    b_proj logits, and q, k are not yet l2-normalised. The backend then applies
    g = -exp(A_log) * softplus(g + dt_bias), beta = sigmoid(beta) and the l2 norms itself: fused
    into fla's kernels, or through the references here.

    A_log: [H] (any float dtype), one decay rate per head. dt_bias: [H * K] float32.
    """

    A_log: torch.Tensor
    dt_bias: torch.Tensor


def _activate(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, gate: KDAGate | None
) -> tuple[torch.Tensor, ...]:
    """The reference path's view of raw inputs: l2-normalised q, k, log-space g and sigmoid beta, fp32."""
    if gate is None:
        return q, k, g, beta
    q, k = l2norm(q.float()), l2norm(k.float())
    return q, k, kda_gate(g, gate.A_log, gate.dt_bias), torch.sigmoid(beta.float())


def select_backend(device: torch.device) -> str:
    """The backend ("fla" or "torch") that serves tensors on `device`."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r} is not one of {BACKENDS}; unset it or pick one of those")
    if choice == "torch":
        return "torch"
    usable = device.type == "cuda" and _fla_kda() is not None
    if choice == "fla" and not usable:
        raise RuntimeError(
            f"{BACKEND_ENV}=fla needs CUDA tensors and an importable fla-core 0.6 "
            f"(got device {device}, fla importable: {_fla_kda() is not None}); "
            f"set {BACKEND_ENV}=torch or auto"
        )
    return "fla" if usable else "torch"


def _initial_states(
    state_pool: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """[N, H, K, V] starting states: the pool slot, or zeros where a sequence starts fresh.

    `where` (not a multiply) so that NaN/inf garbage in unused slots never leaks in.
    """
    h0 = state_pool.index_select(0, state_slots)
    keep = has_initial_state.to(device=h0.device, dtype=torch.bool).view(-1, 1, 1, 1)
    return torch.where(keep, h0, torch.zeros((), dtype=h0.dtype, device=h0.device))


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    gate: KDAGate | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """KDA over N sequences packed back to back, continuing from (and updating) pooled states.

    Args:
        q, k: [T, H, K] l2-normalised, q not yet scaled (raw when `gate` is given).
        v: [T, H, V]. g: [T, H, K] log-space decay. beta: [T, H] (raw logits when `gate` is given).
        scale: multiplies q.
        cu_seqlens: [N + 1] long, sequence i is tokens cu_seqlens[i]:cu_seqlens[i + 1].
        state_pool: [S, H, K, V] float32. state_pool[state_slots[i]] is read as the starting state
            of sequence i when has_initial_state[i], and overwritten in place with its final state.
            Other slots are left untouched.
        state_slots: [N] long, distinct.
        has_initial_state: [N] bool; False starts from zeros and never reads the slot.
        gate: the layer's gate parameters when q, k, g and beta are raw (see KDAGate).
        cu_seqlens_cpu: the same offsets on the CPU, if the caller has them (spares fla a device sync).
    Returns:
        o: [T, H, V], float32 or v's dtype.
    """
    state_slots = state_slots.to(device=state_pool.device, dtype=torch.long)
    if state_slots.numel() == 0:
        return v.new_zeros(v.shape, dtype=torch.float32)
    h0 = _initial_states(state_pool, state_slots, has_initial_state)
    if select_backend(q.device) == "fla":
        o, final = _fla_kda().chunk_kda(
            q=q.unsqueeze(0),
            k=k.unsqueeze(0),
            v=v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            scale=scale,
            initial_state=h0.float().contiguous(),
            output_final_state=True,
            cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long),
            cu_seqlens_cpu=None if cu_seqlens_cpu is None else cu_seqlens_cpu.long(),
            **_fused_activation_kwargs(gate),
        )
        state_pool.index_copy_(0, state_slots, final.to(state_pool.dtype))
        return o.squeeze(0)

    q, k, g, beta = _activate(q, k, g, beta, gate)
    o = q.new_empty(v.shape, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    finals = []
    for i in range(len(bounds) - 1):
        bos, eos = bounds[i], bounds[i + 1]
        fn = chunk_kda_torch if eos - bos > CHUNK_THRESHOLD else naive_recurrent_kda
        # float64 on the reference path: where a sequence is cut into chunks (chunked prefill, checkpoint
        # boundaries) then changes nothing visible in float32 outputs
        pieces = [t[bos:eos].double() for t in (q, k, v, g, beta)]
        o_i, final_i = fn(*pieces, scale, h0[i].double())
        o[bos:eos] = o_i
        finals.append(final_i)
    state_pool.index_copy_(0, state_slots, torch.stack(finals).to(state_pool.dtype))
    return o


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    state_slots: torch.Tensor,
    *,
    gate: KDAGate | None = None,
) -> torch.Tensor:
    """One KDA step for each of B sequences, updating their pooled states in place.

    Args:
        q, k: [B, H, K] l2-normalised, q not yet scaled (raw when `gate` is given). v: [B, H, V].
        g: [B, H, K] log-space decay. beta: [B, H] (raw logits when `gate` is given).
        scale: multiplies q.
        state_pool: [S, H, K, V] float32; slots state_slots are read and overwritten, others untouched.
        state_slots: [B] long or int32, distinct.
        gate: the layer's gate parameters when q, k, g and beta are raw (see KDAGate).
    Returns:
        o: [B, H, V], float32 or v's dtype.
    """
    state_slots = state_slots.to(device=state_pool.device)
    if state_slots.numel() == 0:
        return v.new_zeros(v.shape, dtype=torch.float32)
    if select_backend(q.device) == "fla":
        _check_pool_layout(state_pool)
        # In place by index: the kernel reads pool[slot] and writes the new state back to it, so the
        # [B, H, K, V] states are not gathered and scattered around it. Keyword arguments on purpose:
        # the forward takes A_log and dt_bias before scale.
        o, _ = _fla_fused_recurrent_fwd()(
            q=q.unsqueeze(1).contiguous(),
            k=k.unsqueeze(1).contiguous(),
            v=v.unsqueeze(1).contiguous(),
            g=g.unsqueeze(1).contiguous(),
            beta=beta.unsqueeze(1).contiguous(),
            scale=scale,
            initial_state=state_pool,
            inplace_final_state=True,
            ssm_state_indices=state_slots,
            **_fused_activation_kwargs(gate),
        )
        return o.squeeze(1)

    state_slots = state_slots.long()
    h0 = state_pool.index_select(0, state_slots)
    q, k, g, beta = _activate(q, k, g, beta, gate)
    o, final = recurrent_kda_step(q, k, v, g, beta, scale, h0)
    state_pool.index_copy_(0, state_slots, final.to(state_pool.dtype))
    return o.float()


def kda_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_lens: list[int],
    state_indices: torch.Tensor,
    *,
    gate: KDAGate | None = None,
) -> torch.Tensor:
    """Speculative decoding's verify windows: N windows packed back to back, window n starting from the
    state in slot state_indices[n, 0] and leaving the state after its token t in slot state_indices[n, t].

    Args:
        q, k: [T, H, K] l2-normalised, q not yet scaled (raw when `gate` is given). v: [T, H, V].
        g: [T, H, K] log-space decay. beta: [T, H] (raw logits when `gate` is given).
        state_pool: [S, H, K, V] float32.
        cu_seqlens: [N + 1] long on q's device; seq_lens: the same lengths on the host.
        state_indices: [N, max(seq_lens)] long, distinct slots per row (entries past a window's length unused).
    Returns:
        o: [T, H, V], float32 or v's dtype.
    """
    if not seq_lens:
        return v.new_zeros(v.shape, dtype=torch.float32)
    if select_backend(q.device) == "fla":
        _check_pool_layout(state_pool)
        # fla's spec-decoding mode: reads slot [n, num_accepted - 1] (here always the first) and writes the
        # state after each token t to slot [n, t]
        ones = torch.ones(len(seq_lens), dtype=torch.long, device=q.device)
        o, _ = _fla_fused_recurrent_fwd()(
            q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(), v=v.unsqueeze(0).contiguous(),
            g=g.unsqueeze(0).contiguous(), beta=beta.unsqueeze(0).contiguous(), scale=scale,
            initial_state=state_pool, inplace_final_state=True, cu_seqlens=cu_seqlens,
            ssm_state_indices=state_indices, num_accepted_tokens=ones, **_fused_activation_kwargs(gate),
        )
        return o.squeeze(0)

    from deltaserve.spec.state_rollback import recurrent_kda_verify_varlen

    q, k, g, beta = _activate(q, k, g, beta, gate)
    return recurrent_kda_verify_varlen(q, k, v, g, beta, scale, state_pool, seq_lens, state_indices).float()


def _fused_activation_kwargs(gate: KDAGate | None) -> dict[str, object]:
    """fla's flags and parameters for raw inputs: l2 norms, decay gate and beta sigmoid in the kernel."""
    fused = gate is not None
    kwargs: dict[str, object] = {
        "use_qk_l2norm_in_kernel": fused, "use_gate_in_kernel": fused, "use_beta_sigmoid_in_kernel": fused,
    }
    if fused:
        kwargs.update(A_log=gate.A_log.reshape(-1).contiguous(), dt_bias=gate.dt_bias.reshape(-1).contiguous())
    return kwargs


def _check_pool_layout(state_pool: torch.Tensor) -> None:
    """fla indexes slot rows as dense float32 [H, K, V] blocks (any slot stride)."""
    _, _, K, V = state_pool.shape
    if state_pool.dtype != torch.float32 or state_pool.stride()[1:] != (K * V, V, 1):
        raise ValueError(
            f"the KDA state pool must be float32 with dense [H, K, V] slots for in-place decode, got "
            f"{state_pool.dtype} with strides {state_pool.stride()}"
        )
