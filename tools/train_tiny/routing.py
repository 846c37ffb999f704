"""MoE load balancing for training: DeepSeek-V3's bias update (as Kimi uses) plus a small aux loss.

Kimi Linear routes on sigmoid(router logits) + e_score_correction_bias and weights the chosen experts
by the sigmoid scores alone, so the bias steers the choice without entering the loss. transformers
keeps the bias as a frozen buffer; here, after every optimizer step, each router's bias moves by
`rate` up for the experts that got fewer than the mean number of tokens and down for the others.

A run of a few thousand steps is too short for the bias alone: in the first steps the router's own
weights move faster than a 1e-3 bias step, and one expert ends up in every token's top-k. So a
balance loss (DeepSeek-V3's complementary one, over the batch) is added with weight aux_coef:
    aux = E / K * sum_i f_i * P_i,  f_i = share of tokens that chose expert i (sums to K),
    P_i = mean over tokens of s_i / sum_j s_j (sigmoid scores s); aux = 1 when balanced.
"""

from __future__ import annotations

import torch


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias") and hasattr(m, "top_k")]


class RouterBalancer:
    """Records each router's choices and logits between `reset` and `update` through forward hooks."""

    def __init__(self, model: torch.nn.Module, rate: float, aux_coef: float = 0.0) -> None:
        self.rate = rate
        self.aux_coef = aux_coef
        self.routers = _routers(model)
        self.counts: list[torch.Tensor | None] = [None] * len(self.routers)
        self.aux_terms: list[torch.Tensor] = []
        self.recording = False
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(module: torch.nn.Module, args, output) -> None:
            if not self.recording:
                return
            # transformers 5's router returns (logits [N, E], weights [N, K], indices [N, K])
            logits = output[0]
            indices = next(t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point())
            n_experts = module.e_score_correction_bias.numel()
            c = torch.bincount(indices.reshape(-1), minlength=n_experts)
            self.counts[i] = c if self.counts[i] is None else self.counts[i] + c
            if self.aux_coef > 0 and logits.requires_grad:
                scores = torch.sigmoid(logits.float())
                p = (scores / scores.sum(-1, keepdim=True)).mean(0)  # [E]
                f = c.float() / indices.shape[0]  # [E], sums to K
                self.aux_terms.append(n_experts / indices.shape[-1] * (f * p).sum())

        return hook

    def reset(self) -> None:
        """Start recording one training step."""
        self.counts = [None] * len(self.routers)
        self.aux_terms = []
        self.recording = True

    def aux_loss(self) -> torch.Tensor | None:
        """aux_coef * the mean balance loss over routers of this step's forward, or None."""
        if not self.aux_terms:
            return None
        return self.aux_coef * torch.stack(self.aux_terms).mean()

    @torch.no_grad()
    def update(self) -> None:
        """Move every bias by `rate` towards balance; stop recording."""
        self.recording = False
        self.aux_terms = []
        if self.rate <= 0:
            return
        for router, c in zip(self.routers, self.counts, strict=True):
            if c is not None:
                load = c.float()
                router.e_score_correction_bias.add_(self.rate * torch.sign(load.mean() - load))

    def max_load_ratio(self) -> float | None:
        """The largest (tokens of the busiest expert / mean tokens per expert) over routers, last step;
        1 is balanced, E / K means one expert is in every token's top-k."""
        ratios = [float(c.max() / c.float().mean().clamp_min(1e-9)) for c in self.counts if c is not None]
        return max(ratios) if ratios else None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
