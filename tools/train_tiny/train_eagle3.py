"""`eagle3`: train an Eagle3 head (deltaserve.model.eagle3) over a frozen, exported target.

Each batch runs the target once (no grad) for its hidden states at the tap layers and its logits,
then unrolls the head for ttt_steps draft steps (training-time test, see Eagle3Head.forward_ttt).
Step k at index t is trained against the target's distribution at position t + 1 + k ("soft",
forward KL up to a constant, as SpecForge) or its argmax ("hard"), weighted step_weight ** k.

The held-out acceptance proxy: acc_k = the fraction of positions where the head's argmax at step k
equals the target's argmax, with the data's tokens as the head's inputs (teacher forcing, so a
proxy for greedy verification, where the inputs would be the drafted tokens). chain_k = the fraction
of positions whose steps 0..k all agree; expected_accepted = sum_k chain_k, the mean number of
drafted tokens a greedy verifier would keep per round of ttt_steps drafts (the bonus token aside).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from deltaserve.model.eagle3 import Eagle3Config, Eagle3Head, default_tap_layers, save_eagle3
from tools.train_tiny import checkpoint as ckpt
from tools.train_tiny.data import BatchSampler, eval_batches, load_tokens
from tools.train_tiny.loop import LoopOptions, LoopState, run_loop, step_budget
from tools.train_tiny.models import load_model, settle_experts_implementation
from tools.train_tiny.runtime import (
    autocast,
    configure_cpu_threads,
    persist_fla_autotune,
    pick_device,
    rng_state,
    save_fla_autotune,
    seed_everything,
    set_rng_state,
)
from tools.train_tiny.train import check_resume_args

RESUME_MUST_MATCH = ("batch_size", "seq_len", "seed", "ttt_steps")


@dataclass(kw_only=True)
class Eagle3Args(LoopOptions):
    """Every option of `eagle3`; README.md lists the values used on the GPU."""

    data: str
    target: str  # the target's export directory
    out: str
    batch_size: int = 16
    seq_len: int = 512
    ttt_steps: int = 3
    step_weight: float = 0.8
    labels: str = "soft"  # "soft": the target's distribution, "hard": its argmax
    tap_layers: str | None = None  # comma-separated target layer ids; None: vLLM's (2, L // 2, L - 3)
    head_dim: int = 64
    intermediate_size: int | None = None  # None: 3 * hidden
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.5
    eval_windows: int | None = None
    seed: int = 1234
    resume: bool = False
    device: str | None = None
    precision: str = "bf16"
    experts_implementation: str | None = None
    threads: int | None = None
    export: bool = True


def head_config_for(target_config: Any, args: Eagle3Args) -> Eagle3Config:
    """The head's config for a transformers KimiLinear config."""
    n, h = target_config.num_hidden_layers, target_config.hidden_size
    taps = default_tap_layers(n) if not args.tap_layers else tuple(int(i) for i in args.tap_layers.split(","))
    if h % args.head_dim:
        raise ValueError(f"eagle3: --head-dim={args.head_dim} does not divide the target's hidden size {h}")
    return Eagle3Config(
        vocab_size=target_config.vocab_size, hidden_size=h, target_hidden_size=h, tap_layer_ids=taps,
        num_attention_heads=h // args.head_dim, num_key_value_heads=h // args.head_dim, head_dim=args.head_dim,
        intermediate_size=args.intermediate_size or 3 * h, rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=int(getattr(target_config, "model_max_length", 8192) or 8192),
        target_num_hidden_layers=n,
    )


def init_head(head: Eagle3Head, target: torch.nn.Module, seed: int) -> None:
    """Normal(0, 0.02) matrices; embed_tokens (frozen), lm_head and the final norm from the target."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
        head.norm.weight.copy_(target.model.norm.weight)
    head.embed_tokens.weight.requires_grad_(False)


class HeadTrainer:
    """The state of one head run; the target is frozen and only read."""

    def __init__(self, args: Eagle3Args) -> None:
        if args.labels not in ("soft", "hard"):
            raise ValueError(f"eagle3: --labels={args.labels!r} is not supported; choose soft or hard")
        self.args = args
        self.device = pick_device(args.device)
        configure_cpu_threads(self.device, args.threads)
        self.val_tokens = load_tokens(args.data, "val")
        self.sampler = BatchSampler(load_tokens(args.data, "train"), args.batch_size, args.seq_len, args.seed)
        self.target = load_model(args.target, args.experts_implementation).to(self.device).requires_grad_(False)
        settle_experts_implementation(self.target, self.device, args.precision, backward=False,
                                      requested=args.experts_implementation)
        saved = ckpt.load_state(args.out) if args.resume and ckpt.has_state(args.out) else None
        if saved is None and ckpt.has_state(args.out):
            raise ValueError(f"eagle3: {args.out} already holds a checkpoint; pass --resume or another --out")
        seed_everything(args.seed)
        if saved is not None:
            check_resume_args(saved["args"], args, RESUME_MUST_MATCH, args.out)
            self.config = Eagle3Config.from_dict(saved["head_config"])
        else:
            self.config = head_config_for(self.target.config, args)
        self.head = Eagle3Head(self.config)
        init_head(self.head, self.target, args.seed)
        self.head.to(self.device).train()
        params = [p for p in self.head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(args.beta1, args.beta2),
                                           weight_decay=args.weight_decay, fused=self.device.type == "cuda")
        self.loop = LoopState(max_steps=step_budget(args, self.sampler.batches_per_epoch()))
        if saved is not None:
            self.head.load_state_dict(saved["head"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.sampler.load_state_dict(saved["sampler"])
            set_rng_state(saved["rng"])
            self.loop = LoopState.resumed(saved["loop"], self.loop.max_steps if args.max_steps is not None else None)

    @torch.no_grad()
    def target_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T] -> (taps [B, T, k*H] concatenated in tap order, target logits [B, T, V] float32)."""
        with autocast(self.device, self.args.precision):
            out = self.target(input_ids=x, output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i] for i in self.config.tap_layer_ids], dim=-1)
        return taps, out.logits.float()

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Weighted loss over the draft steps, and per step {loss, agree [B, T-1-k] bool}."""
        taps, tlogits = self.target_outputs(x)
        with autocast(self.device, self.args.precision):
            step_logits = self.head.forward_ttt(x, self.head.fuse(taps), self.args.ttt_steps)
        t = x.shape[1]
        total = torch.zeros((), device=x.device)
        per_step = []
        for k, logits in enumerate(step_logits):
            n = t - 1 - k  # indices 0..T-2-k have their input token and label in the sequence
            if n <= 0:
                break
            lp = torch.log_softmax(logits[:, :n].float(), dim=-1)
            ref = tlogits[:, 1 + k : 1 + k + n]
            if self.args.labels == "soft":
                loss = -(torch.softmax(ref, dim=-1) * lp).sum(-1).mean()
            else:
                loss = F.nll_loss(lp.reshape(-1, lp.shape[-1]), ref.argmax(-1).reshape(-1))
            total = total + self.args.step_weight**k * loss
            per_step.append({"loss": loss.detach(), "agree": lp.argmax(-1) == ref.argmax(-1)})
        return total, per_step

    def train_step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = self.sampler.next_batch()
        loss, _ = self.losses(x.to(self.device, non_blocking=True))
        loss.backward()
        params = [p for p in self.head.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.args.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), grad_norm.detach()

    @torch.no_grad()
    def acceptance(self, max_windows: int | None = None) -> dict[str, float]:
        """Held-out val_loss, acc_k, chain_k and expected_accepted (module docstring)."""
        self.head.eval()
        k_steps = self.args.ttt_steps
        loss_sum, n_batches = 0.0, 0
        agree_sum = [0] * k_steps
        agree_n = [0] * k_steps
        chain_sum = [0] * k_steps
        chain_n = 0
        for x, _ in eval_batches(self.val_tokens, self.args.seq_len, self.args.batch_size, max_windows):
            if x.shape[1] < k_steps + 2:
                continue
            loss, per_step = self.losses(x.to(self.device))
            loss_sum += float(loss)
            n_batches += 1
            for k, s in enumerate(per_step):
                agree_sum[k] += int(s["agree"].sum())
                agree_n[k] += s["agree"].numel()
            m = x.shape[1] - k_steps  # start indices where every step is meaningful
            chain = torch.ones_like(per_step[0]["agree"][:, :m])
            for k, s in enumerate(per_step):
                chain = chain & s["agree"][:, :m]
                chain_sum[k] += int(chain.sum())
            chain_n += chain.numel()
        self.head.train()
        out = {"val_loss": loss_sum / max(n_batches, 1)}
        for k in range(k_steps):
            out[f"acc_{k}"] = agree_sum[k] / max(agree_n[k], 1)
        for k in range(k_steps):
            out[f"chain_{k}"] = chain_sum[k] / max(chain_n, 1)
        out["expected_accepted"] = sum(out[f"chain_{k}"] for k in range(k_steps))
        return out

    def evaluate(self) -> dict[str, float]:
        metrics = self.acceptance(self.args.eval_windows)
        if metrics["val_loss"] < self.loop.best_val:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.head.state_dict().items()}
            ckpt.save_best(self.args.out, state, self.loop.step, metrics["val_loss"])
        return metrics

    def log_extra(self) -> dict[str, Any]:
        return {}

    def save(self) -> None:
        ckpt.save_state(self.args.out, {
            "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(), "rng": rng_state(), "loop": self.loop.to_dict(),
            "head_config": self.config.to_dict(), "args": asdict(self.args),
        })


def train_eagle3(args: Eagle3Args) -> dict[str, Any]:
    """Train (or resume) the head; on completion export the best head to <out>/export with its eval."""
    os.makedirs(args.out, exist_ok=True)
    persist_fla_autotune(args.out)
    print(f"[eagle3] building the head over {args.target} in {args.out} (resume={args.resume})", flush=True)
    trainer = HeadTrainer(args)
    start_step = trainer.loop.step
    bpe = trainer.sampler.batches_per_epoch()
    try:
        status = run_loop(trainer, args, args.out, args.batch_size * args.seq_len, bpe)
    finally:
        print(f"[eagle3] fla autotune entries saved: {save_fla_autotune(args.out)}", flush=True)
    st = trainer.loop
    summary: dict[str, Any] = {
        "status": status, "step": st.step, "max_steps": st.max_steps, "steps_this_command": st.step - start_step,
        "epochs": round(st.step / bpe, 3), "train_seconds": round(st.train_seconds_used, 2),
        "best_val_loss": st.best_val if st.best_val != float("inf") else None,
        "parameters_total": sum(p.numel() for p in trainer.head.parameters()),
        "parameters_trainable": sum(p.numel() for p in trainer.head.parameters() if p.requires_grad),
        "head_config": trainer.config.to_dict(), "calibration": st.calibration, "args": asdict(args),
    }
    if status == "done" and args.export:
        best = ckpt.load_best(args.out)
        if best is not None:
            trainer.head.load_state_dict(best["model"])
        summary["heldout"] = trainer.acceptance(args.eval_windows)
        out_dir = os.path.join(args.out, "export")
        save_eagle3(trainer.head, out_dir)
        with open(os.path.join(out_dir, "eval.json"), "w") as f:
            json.dump(summary["heldout"], f, indent=2)
            f.write("\n")
        summary["export"] = out_dir
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    print(f"[eagle3] {status} at step {st.step}/{st.max_steps}; summary in {args.out}/summary.json", flush=True)
    return summary
