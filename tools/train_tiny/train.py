"""`train`: next-token training of a Kimi Linear model (target or draft) on the prepared streams.

AdamW (fp32 master weights, bf16 autocast on CUDA) with decay on matrices only, the schedule and
budgets of loop.py, gradient clipping, MoE load balancing (routing.py), held-out loss
every eval_every steps (the best weights are kept), checkpoints every ckpt_every steps and at the
end of every command. When the budget is done, <out>/export gets the bf16 `save_pretrained` model
with the tokenizer (checkpoint.export_pretrained), ready for transformers and deltaserve.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tools.train_tiny import checkpoint as ckpt
from tools.train_tiny.data import BatchSampler, load_tokens
from tools.train_tiny.loop import LoopOptions, LoopState, run_loop, step_budget
from tools.train_tiny.metrics import heldout_loss
from tools.train_tiny.models import build_model, parameter_count, settle_experts_implementation, shape_config
from tools.train_tiny.prepare import load_meta
from tools.train_tiny.routing import RouterBalancer
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

RESUME_MUST_MATCH = ("model", "batch_size", "seq_len", "seed")
NO_DECAY = ("A_log", "dt_bias", "norm", "bias")


@dataclass(kw_only=True)
class TrainArgs(LoopOptions):
    """Every option of `train`; README.md lists the values used on the GPU."""

    data: str
    out: str
    model: str = "target"  # a shape of models.SHAPES
    batch_size: int = 16
    seq_len: int = 512
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_windows: int | None = None  # None: the whole held-out stream
    seed: int = 1234
    resume: bool = False
    device: str | None = None
    precision: str = "bf16"
    experts_implementation: str | None = None  # None: transformers' default (grouped_mm where it can)
    bias_update_rate: float = 1e-2
    aux_loss_coef: float = 1e-3
    threads: int | None = None
    export: bool = True
    export_weights: str = "best"  # "best" (lowest held-out loss) or "last"


def make_optimizer(model: torch.nn.Module, args: TrainArgs, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases, A_log, dt_bias)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 or any(k in name for k in NO_DECAY) else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), fused=device.type == "cuda")


def check_resume_args(saved: dict[str, Any], args: Any, names: tuple[str, ...], out: str) -> None:
    """A ValueError naming the first option that differs from the checkpoint's."""
    for name in names:
        if saved[name] != getattr(args, name):
            raise ValueError(
                f"resume: --{name.replace('_', '-')}={getattr(args, name)!r} but the checkpoint in {out} was "
                f"made with {saved[name]!r}; pass the same value"
            )


class LMTrainer:
    """The state of one LM run: model, optimizer, sampler, balancer and the loop's own state."""

    def __init__(self, args: TrainArgs) -> None:
        self.args = args
        self.device = pick_device(args.device)
        configure_cpu_threads(self.device, args.threads)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        self.meta = load_meta(args.data)
        self.val_tokens = load_tokens(args.data, "val")
        self.sampler = BatchSampler(load_tokens(args.data, "train"), args.batch_size, args.seq_len, args.seed)
        saved = ckpt.load_state(args.out) if args.resume and ckpt.has_state(args.out) else None
        if saved is None and ckpt.has_state(args.out):
            raise ValueError(f"train: {args.out} already holds a checkpoint; pass --resume or another --out")
        if saved is not None:
            check_resume_args(saved["args"], args, RESUME_MUST_MATCH, args.out)
            self.hub_config = saved["hub_config"]
        else:
            m = self.meta
            self.hub_config = shape_config(
                args.model, m["vocab_size"], m["bos_token_id"], m["eos_token_id"], m["pad_token_id"]
            )
        seed_everything(args.seed)
        self.model = build_model(self.hub_config, args.seed, args.experts_implementation).to(self.device).train()
        self.experts_implementation = settle_experts_implementation(
            self.model, self.device, args.precision, backward=True, requested=args.experts_implementation
        )
        self.optimizer = make_optimizer(self.model, args, self.device)
        self.balancer = RouterBalancer(self.model, args.bias_update_rate, args.aux_loss_coef)
        self.loop = LoopState(max_steps=step_budget(args, self.sampler.batches_per_epoch()))
        if saved is not None:
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.sampler.load_state_dict(saved["sampler"])
            set_rng_state(saved["rng"])
            self.loop = LoopState.resumed(saved["loop"], self.loop.max_steps if args.max_steps is not None else None)

    def train_step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.sampler.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.balancer.reset()
        with autocast(self.device, self.args.precision):
            logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        aux = self.balancer.aux_loss()
        (loss if aux is None else loss + aux).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.update()
        return loss.detach(), grad_norm.detach()

    def evaluate(self) -> dict[str, float]:
        loss, _ = heldout_loss(self.model, self.val_tokens, self.args.seq_len, self.args.batch_size, self.device,
                               self.args.precision, self.args.eval_windows)
        if loss < self.loop.best_val:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            ckpt.save_best(self.args.out, state, self.loop.step, loss)
        return {"val_loss": loss}

    def log_extra(self) -> dict[str, Any]:
        ratio = self.balancer.max_load_ratio()
        return {} if ratio is None else {"max_expert_load": round(ratio, 3)}

    def save(self) -> None:
        ckpt.save_state(self.args.out, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(), "rng": rng_state(), "loop": self.loop.to_dict(),
            "hub_config": self.hub_config, "args": asdict(self.args),
        })

    def export(self) -> str:
        """save_pretrained the best (or last) weights into <out>/export; returns that directory."""
        model = self.model
        best = ckpt.load_best(self.args.out) if self.args.export_weights == "best" else None
        if best is not None:
            model = copy.deepcopy(self.model)
            model.load_state_dict(best["model"])
        out_dir = os.path.join(self.args.out, "export")
        ckpt.export_pretrained(model, out_dir, os.path.join(self.args.data, "tokenizer"))
        return out_dir


def train(args: TrainArgs) -> dict[str, Any]:
    """Build (or resume) the run and train; returns the summary, also written to <out>/summary.json."""
    import time

    os.makedirs(args.out, exist_ok=True)
    persist_fla_autotune(args.out)
    t0 = time.perf_counter()
    print(f"[train] building {args.model} in {args.out} (resume={args.resume})", flush=True)
    trainer = LMTrainer(args)
    print(f"[train] ready in {time.perf_counter() - t0:.1f} s on {trainer.device}, step {trainer.loop.step}, "
          f"experts {trainer.experts_implementation!r}", flush=True)
    # the build's probe step did most of fla's tuning: keep it even if a wall-clock limit kills the loop
    print(f"[train] fla autotune entries saved after the build: {save_fla_autotune(args.out)}", flush=True)
    start_step = trainer.loop.step
    bpe = trainer.sampler.batches_per_epoch()
    try:
        status = run_loop(trainer, args, args.out, args.batch_size * args.seq_len, bpe)
    finally:
        trainer.balancer.remove()
        print(f"[train] fla autotune entries saved: {save_fla_autotune(args.out)}", flush=True)
    st = trainer.loop
    counts = parameter_count(trainer.hub_config)
    summary: dict[str, Any] = {
        "status": status, "step": st.step, "max_steps": st.max_steps, "steps_this_command": st.step - start_step,
        "tokens_seen": st.step * args.batch_size * args.seq_len, "epochs": round(st.step / bpe, 3),
        "train_seconds": round(st.train_seconds_used, 2), "command_seconds": round(time.perf_counter() - t0, 2),
        "best_val_loss": st.best_val if st.best_val != float("inf") else None,
        "parameters_total": counts.total, "parameters_active": counts.active,
        "calibration": st.calibration, "device": str(trainer.device),
        "experts_implementation": trainer.experts_implementation, "args": asdict(args),
    }
    if status == "done" and args.export:
        summary["export"] = trainer.export()
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    print(f"[train] {status} at step {st.step}/{st.max_steps}; summary in {args.out}/summary.json", flush=True)
    return summary
