"""An Eagle3 draft head: one decoder layer over the target's fused hidden states, plus its own lm_head.

Eagle3 (Li et al., 2025; vLLM's `llama_eagle3.py` and SpecForge's `LlamaForCausalLMEagle3` are the
references) drafts from several of the target's hidden states, not only the last one. With the
target's tokens x_0..x_{T-1}, and h^(i)_t the residual stream entering target layer i at position t:

    fused_t = fc([h^(a)_t ; h^(b)_t ; h^(c)_t])                  [B, T, k*Ht] -> [B, T, H]
    u_t     = [input_layernorm(embed(x_{t+1})) ; hidden_norm(fused_t)]       [B, T, 2H]
    r_t     = fused_t + o_proj(attention(q_proj(u), k_proj(u), v_proj(u)))   (RoPE on q, k)
    out_t   = r_t + mlp(post_attention_layernorm(r_t))                       [B, T, H]
    logits  = lm_head(norm(out_t))                                           predicts x_{t+2}

Alignment: draft position t pairs the target's state at t (which has already seen x_t and produced
x_{t+1}) with the embedding of x_{t+1}, and predicts x_{t+2}, the token the target predicts at
t + 1. Draft step k >= 1 at index t takes the token x_{t+1+k} (the one drafted at step k - 1),
the head's own out_t of step k - 1 as the hidden state, and the position t + k; it attends to the
step-0 entries of every index <= t and to its own entries of steps 1..k at index t (SpecForge's
training-time test). In decoding that is an ordinary KV cache: step-0 entries for every accepted
token, then one entry per drafted token.

Tap layers: ids in [0, L) name the stream entering target decoder layer i, that is
`output_hidden_states[i]` in transformers (index 0 is the embedding output) and vLLM's
"aux hidden state layers"; vLLM's default for an L-layer target is (2, L // 2, L - 3).

Weight names follow vLLM / SpecForge Eagle3 checkpoints (`fc`, `midlayer.*`, `norm`, `lm_head`,
`embed_tokens`) with the full target vocabulary (no d2t / t2d maps).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from deltaserve.model.layers.linear import fuse_weights

# SDPA with a mask, left to choose, takes cuDNN on an H100, which builds a plan for every new shape (34 ms
# of host time per call, and the head's key lengths change every step): the memory-efficient kernel (or the
# math one) instead
MASKED_ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "Eagle3Head"


@dataclass(frozen=True)
class Eagle3Config:
    """The head's sizes, and which target layers it reads."""

    vocab_size: int
    hidden_size: int
    target_hidden_size: int
    tap_layer_ids: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target_num_hidden_layers: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tap_layer_ids", tuple(int(i) for i in self.tap_layer_ids))
        if not self.tap_layer_ids:
            raise ValueError("eagle3: tap_layer_ids is empty; name at least one target layer")
        n = self.target_num_hidden_layers
        for i in self.tap_layer_ids:
            if i < 0 or (n is not None and i >= n):
                raise ValueError(f"eagle3: tap layer {i} is outside the target's layers [0, {n})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"eagle3: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"eagle3: head_dim={self.head_dim} must be even for RoPE")

    @property
    def num_taps(self) -> int:
        return len(self.tap_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tap_layer_ids"] = list(self.tap_layer_ids)
        return {"architectures": [ARCHITECTURE], **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Eagle3Config:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known - {"architectures"})
        if unknown:
            raise ValueError(f"eagle3: config has unknown field(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in d.items() if k in known})


def default_tap_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default taps (2, L // 2, L - 3), clamped to [0, L) and deduplicated, in order."""
    taps = [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]
    return tuple(sorted(set(taps)))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or as it is when already float32 / float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32: [..., D] -> [..., D] in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _wide(x)  # torch's rms_norm: one fused kernel on a GPU, where the head's calls are launch-bound
        return F.rms_norm(xf, (xf.shape[-1],), self.weight.to(xf.dtype), self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary angles' cos and sin for positions [B, T]: [B, 1, T, head_dim / 2] each, in `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim))
    angles = positions.to(dtype)[:, None, :, None] * inv_freq
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split (Llama) layout: x [B, N, T, D] with rope_cos_sin's cos, sin -> [B, N, T, D]."""
    d = x.shape[-1]
    xf = _wide(x)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split (Llama) layout. x: [B, N, T, D], positions: [B, T] -> [B, N, T, D]."""
    return rotate(x, *rope_cos_sin(positions, x.shape[-1], theta, _wide(x).dtype))


class Eagle3Attention(nn.Module):
    """Attention whose q, k, v read the 2H-wide [token embedding ; hidden] input."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.qkv_weight: torch.Tensor | None = None  # q, k and v's weights in one, after fuse_projections

    def fuse_projections(self) -> None:
        """For inference: q, k and v's weights become views of one [(Nq + 2 Nkv) D, 2H] tensor, multiplied
        in one GEMM (the checkpoint's names and the state dict stay as they are)."""
        self.qkv_weight = fuse_weights([self.q_proj, self.k_proj, self.v_proj])

    def qkv(self, u: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """u: [B, T, 2H], positions: [B, T] -> q [B, Nq, T, D], k and v [B, Nq, T, D] (kv heads repeated)."""
        b, t, _ = u.shape
        c = self.c
        nq, nkv = c.num_attention_heads, c.num_key_value_heads
        if self.qkv_weight is not None:
            mixed = F.linear(u, self.qkv_weight)
        else:
            mixed = torch.cat([self.q_proj(u), self.k_proj(u), self.v_proj(u)], dim=-1)
        mixed = mixed.view(b, t, nq + 2 * nkv, c.head_dim).transpose(1, 2)  # [B, Nq + 2 Nkv, T, D]
        # RoPE on q and k together: one set of angles, one rotation
        qk = rotate(mixed[:, : nq + nkv], *rope_cos_sin(positions, c.head_dim, c.rope_theta, _wide(u).dtype))
        (q, k), v = qk.split([nq, nkv], dim=1), mixed[:, nq + nkv :]
        rep = nq // nkv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return q, k, v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn: [B, Nq, T, D] -> [B, T, H]."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # after fuse_projections

    def fuse_projections(self) -> None:
        """For inference: gate and up in one GEMM (their weights become views of one tensor)."""
        self.gate_up_weight = fuse_weights([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The one decoder layer (named `midlayer` as in vLLM / SpecForge checkpoints)."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Eagle3MLP(c.hidden_size, c.intermediate_size)


@dataclass
class Eagle3KVCache:
    """The head's keys and values so far, [B, Nq, S, D] each (None before the first call)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


class Eagle3Head(nn.Module):
    """fc + one decoder layer + norm + lm_head; `embed_tokens` is a (frozen) copy of the target's."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(c.num_taps * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.scale = c.head_dim**-0.5

    def fuse_projections(self) -> Eagle3Head:
        """For inference (a drafter): q/k/v and gate/up as one GEMM each; training keeps them apart."""
        self.midlayer.self_attn.fuse_projections()
        self.midlayer.mlp.fuse_projections()
        return self

    def fuse(self, tap_hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, k * Ht] (the taps concatenated in tap_layer_ids order) -> [B, T, H]."""
        return self.fc(tap_hidden_states.to(self.fc.weight.dtype))

    def _inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        u = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        return layer.self_attn.qkv(u, positions)

    def _finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        r = hidden + layer.self_attn.out(attn)
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, T, H] -> logits [B, T, V]."""
        return self.lm_head(self.norm(out))

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
        kv_cache: Eagle3KVCache | None = None,
    ) -> torch.Tensor:
        """One call over T new entries, decoding style; returns out [B, T, H] (feed to compute_logits).

        input_ids: [B, T] the tokens x_{t+1}; hidden: [B, T, H], fused target states (step 0) or the
        head's previous out (later steps); position_ids: [B, T]. New entry i attends to every cached
        entry and to new entries <= i; the cache, when given, is extended in place.
        """
        q, k, v = self._inputs(input_ids, hidden, position_ids)
        past = 0
        if kv_cache is not None:
            past = kv_cache.length
            if past:
                k, v = torch.cat([kv_cache.k, k], dim=2), torch.cat([kv_cache.v, v], dim=2)
            kv_cache.k, kv_cache.v = k, v
        t = q.shape[2]
        if past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            allowed = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(diagonal=past)
            with sdpa_kernel(MASKED_ATTENTION_BACKENDS):
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return self._finish(hidden, attn)

    def extend(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, offset: int,
    ) -> torch.Tensor:
        """One call over T new entries for B requests whose cached entries share one padded buffer.

        input_ids: [B, T]; hidden: [B, T, H]; position_ids: [B, T]; keys, values: [B, Nq, S, D] with
        S >= offset + T, the cached entries (kv heads repeated, RoPE applied) in columns [0, offset), valid
        where valid [B, S] is True. The new entries' keys and values are written to columns
        [offset, offset + T); new entry i attends to the valid columns before `offset` and to new entries
        <= i, so a request with fewer than T new entries pads at the end (its padded rows are meaningless,
        its valid rows exact). Returns out [B, T, H]; marking the new columns valid is the caller's.
        """
        q, k, v = self._inputs(input_ids, hidden, position_ids)
        t = q.shape[2]
        keys[:, :, offset : offset + t], values[:, :, offset : offset + t] = k, v
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        allowed = torch.cat([valid[:, None, :offset].expand(-1, t, -1), causal.expand(q.shape[0], t, t)], dim=-1)
        with sdpa_kernel(MASKED_ATTENTION_BACKENDS):
            attn = F.scaled_dot_product_attention(q, keys[:, :, : offset + t], values[:, :, : offset + t],
                                                  attn_mask=allowed[:, None], scale=self.scale)
        return self._finish(hidden, attn)

    def forward_ttt(self, input_ids: torch.Tensor, fused: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
        """Training-time test over a whole sequence: the logits of draft steps 0..num_steps-1.

        input_ids: [B, T] the sequence x_0..x_{T-1}; fused: [B, T, H] = fuse(taps at 0..T-1).
        Returns num_steps tensors [B, T, V]; step k at index t predicts x_{t+2+k} (the target's
        prediction at t + 1 + k) and is meaningful for t <= T - 2 - k, where its input token
        x_{t+1+k} lies in the sequence (later indices read padding; no meaningful entry attends to them).
        """
        b, t = input_ids.shape
        base = torch.arange(t, device=input_ids.device).expand(b, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        hidden, k0, v0 = fused, None, None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        logits = []
        for step in range(num_steps):
            tokens = F.pad(input_ids[:, 1 + step :], (0, 1 + step), value=0)[:, :t]
            q, k, v = self._inputs(tokens, hidden, base + step)
            if step == 0:
                k0, v0 = k, v
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                diag_k.append(k)
                diag_v.append(v)
                scores0 = _wide(q @ k0.transpose(-1, -2)) * self.scale  # [B, N, T, T]
                scores0 = scores0.masked_fill(~causal, float("-inf"))
                diag = _wide(torch.stack([(q * kj).sum(-1) for kj in diag_k], dim=-1)) * self.scale  # [B, N, T, s]
                p = torch.softmax(torch.cat([scores0, diag], dim=-1), dim=-1)
                attn = p[..., :t].to(v0.dtype) @ v0
                for j, vj in enumerate(diag_v):
                    attn = attn + p[..., t + j, None].to(vj.dtype) * vj
            hidden = self._finish(hidden, attn)
            logits.append(self.compute_logits(hidden))
        return logits


def save_eagle3(head: Eagle3Head, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """config.json + model.safetensors (weights in `dtype`); returns the files written."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump({**head.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
        f.write("\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(state, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    return [CONFIG_FILE, WEIGHTS_FILE]


def read_eagle3_config(model_dir: str) -> Eagle3Config:
    """The config of `save_eagle3`'s directory; ValueError when there is none."""
    path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"eagle3: no {CONFIG_FILE} in {model_dir!r}; is this an Eagle3 head directory?")
    with open(path) as f:
        raw = json.load(f)
    raw.pop("torch_dtype", None)
    return Eagle3Config.from_dict(raw)


def load_eagle3(model_dir: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """An Eagle3Head from `save_eagle3`'s directory; missing or unexpected tensors are a ValueError."""
    from safetensors.torch import load_file

    head = Eagle3Head(read_eagle3_config(model_dir))
    state = load_file(os.path.join(model_dir, WEIGHTS_FILE))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"eagle3: {model_dir} has missing tensors {missing} and unexpected tensors {unexpected}")
    return head.to(device=device, dtype=dtype).eval()


def random_eagle3_head(vocab_size: int, hidden_size: int, num_target_layers: int, rms_norm_eps: float = 1e-5,
                       head_dim: int = 16, seed: int = 0) -> Eagle3Head:
    """A head of random weights (normal, std 0.02; norms at one) for a target of these sizes, tapping vLLM's
    default layers: what `deltaserve make-model --eagle3` writes, for tests and benchmarks."""
    if hidden_size % head_dim:
        raise ValueError(f"eagle3: head_dim={head_dim} does not divide the target's hidden size {hidden_size}")
    heads = hidden_size // head_dim
    config = Eagle3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, target_hidden_size=hidden_size,
        tap_layer_ids=default_tap_layers(num_target_layers), num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=head_dim, intermediate_size=3 * hidden_size, rms_norm_eps=rms_norm_eps,
        target_num_hidden_layers=num_target_layers,
    )
    head = Eagle3Head(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return head.eval()
