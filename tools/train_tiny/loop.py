"""The budgeted, resumable training loop shared by `train` (LM) and `eagle3` (the draft head).

Learning rate: linear warmup over warmup_steps, then cosine decay to min_lr_ratio * lr at max_steps.
The step budget is fixed once per run and saved with it: --max-steps, or --max-epochs, or
--train-seconds (the step count that fits that many seconds of training, timed on steps
CALIB_START..CALIB_END of the command that starts the run, i.e. during the warmup; capped by
--max-epochs when both are given). --stop-after-seconds / --stop-after-steps end one command early
with a checkpoint, and --resume goes on from it (or starts afresh when there is none, so one
command line serves the first call and every later one). Evaluation, logging and checkpoint time
is not counted as training time.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from tools.train_tiny import checkpoint as ckpt
from tools.train_tiny.runtime import synchronize

CALIB_START, CALIB_END = 5, 25  # steps of a command timed to size a --train-seconds run (the first compile)
FIRST_STEPS_TIMED = 5  # steps of each command printed one by one, with their time


@dataclass(kw_only=True)
class LoopOptions:
    """Schedule, budget and cadence options common to every trainer."""

    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    max_steps: int | None = None
    max_epochs: float | None = None
    train_seconds: float | None = None
    stop_after_seconds: float | None = None
    stop_after_steps: int | None = None
    eval_every: int = 200
    ckpt_every: int = 500
    log_every: int = 20


@dataclass
class LoopState:
    """What the loop itself saves in a checkpoint."""

    step: int = 0
    max_steps: int | None = None
    train_seconds_used: float = 0.0
    best_val: float = math.inf
    history: list[dict[str, Any]] = field(default_factory=list)
    calibration: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def resumed(cls, saved: dict[str, Any], max_steps_given: int | None) -> LoopState:
        """The saved loop state; a --max-steps given on the resuming command overrides its budget."""
        state = cls(**saved)
        if max_steps_given is not None:
            state.max_steps = max_steps_given
        return state


class Trainer(Protocol):
    device: torch.device
    loop: LoopState

    def train_step(self, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step at `lr`; (loss, grad norm) as device tensors."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics; must hold "val_loss" (lower is better: the best weights are kept)."""

    def log_extra(self) -> dict[str, Any]:
        """Extra numbers for a log row."""

    def save(self) -> None:
        """Checkpoint everything, self.loop included."""


def lr_at(step: int, o: LoopOptions, max_steps: int | None) -> float:
    """Learning rate of optimizer step `step` (0-based).

    A budget shorter than five warmups shortens the warmup to a fifth of it (at least CALIB_END steps
    when a --train-seconds run is still being timed), so that every run decays.
    """
    warmup = o.warmup_steps if max_steps is None else min(o.warmup_steps, max(1, max_steps // 5))
    if step < warmup:
        return o.lr * (step + 1) / warmup
    if max_steps is None:
        return o.lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _epoch_cap(o: LoopOptions, batches_per_epoch: int) -> int | None:
    return None if o.max_epochs is None else max(1, math.ceil(o.max_epochs * batches_per_epoch))


def step_budget(o: LoopOptions, batches_per_epoch: int) -> int | None:
    """The fixed step count, or None while a --train-seconds run waits for its calibration."""
    cap = _epoch_cap(o, batches_per_epoch)
    if o.max_steps is not None:
        return o.max_steps if cap is None else min(o.max_steps, cap)
    if o.train_seconds is not None:
        if o.warmup_steps < CALIB_END:
            raise ValueError(
                f"train: --train-seconds times steps {CALIB_START}..{CALIB_END} during the warmup, so "
                f"--warmup-steps must be at least {CALIB_END} (got {o.warmup_steps})"
            )
        return None
    if cap is not None:
        return cap
    raise ValueError("train: give a step budget: --max-steps, --max-epochs or --train-seconds")


def _calibrate(st: LoopState, o: LoopOptions, seconds: float, batches_per_epoch: int) -> None:
    rate = (CALIB_END - CALIB_START) / seconds
    budget = st.step + int(max(0.0, o.train_seconds - st.train_seconds_used) * rate)
    cap = _epoch_cap(o, batches_per_epoch)
    st.max_steps = max(st.step + 1, budget if cap is None else min(budget, cap))
    st.calibration = {"steps_per_second": round(rate, 3), "at_step": st.step, "max_steps": st.max_steps}
    print(f"[train] calibrated: {rate:.2f} steps/s -> max_steps={st.max_steps}", flush=True)


def run_loop(
    trainer: Trainer, o: LoopOptions, out_dir: str, tokens_per_step: int, batches_per_epoch: int
) -> str:
    """Train until the budget ("done") or a stop condition ("paused"); always ends with a checkpoint."""
    st, device = trainer.loop, trainer.device
    t_start = time.perf_counter()
    start_step = st.step
    loss_sum = torch.zeros((), device=device)
    loss_n, status = 0, "paused"
    calib_t0: float | None = None
    seg_start = last_log_t = time.perf_counter()
    last_log_step = st.step
    grad_norm = torch.zeros(())
    while True:
        if st.max_steps is not None and st.step >= st.max_steps:
            status = "done"
            break
        if o.stop_after_steps is not None and st.step - start_step >= o.stop_after_steps:
            break
        if o.stop_after_seconds is not None and time.perf_counter() - t_start >= o.stop_after_seconds:
            break
        if st.max_steps is None and st.step == start_step + CALIB_START:
            synchronize(device)
            calib_t0 = time.perf_counter()
        if st.step - start_step < FIRST_STEPS_TIMED:  # a fresh process compiles and autotunes: show it
            synchronize(device)
            t_step = time.perf_counter()
        loss, grad_norm = trainer.train_step(lr_at(st.step, o, st.max_steps))
        if st.step - start_step < FIRST_STEPS_TIMED:
            synchronize(device)
            print(f"[train] step {st.step + 1}: {time.perf_counter() - t_step:.2f} s, loss {float(loss):.4f}",
                  flush=True)
        st.step += 1
        loss_sum += loss
        loss_n += 1
        if st.max_steps is None and calib_t0 is not None and st.step == start_step + CALIB_END:
            synchronize(device)
            _calibrate(st, o, time.perf_counter() - calib_t0, batches_per_epoch)
        last = st.step == st.max_steps
        do_log, do_eval = st.step % o.log_every == 0 or last, st.step % o.eval_every == 0 or last
        do_ckpt = st.step % o.ckpt_every == 0
        if not (do_log or do_eval or do_ckpt):
            continue
        synchronize(device)
        now = time.perf_counter()
        st.train_seconds_used += now - seg_start
        row: dict[str, Any] = {"step": st.step, "tokens": st.step * tokens_per_step,
                               "epoch": round(st.step / batches_per_epoch, 3)}
        if do_log or do_eval:
            row.update(
                train_loss=round(float(loss_sum) / max(loss_n, 1), 4), grad_norm=round(float(grad_norm), 3),
                lr=lr_at(st.step - 1, o, st.max_steps), train_seconds=round(st.train_seconds_used, 2),
                tokens_per_s=round((st.step - last_log_step) * tokens_per_step / max(now - last_log_t, 1e-9), 1),
                **trainer.log_extra(),
            )
            loss_sum.zero_()
            loss_n = 0
        if do_eval:
            metrics = trainer.evaluate()
            row.update({k: round(v, 4) for k, v in metrics.items()})
            st.best_val = min(st.best_val, metrics["val_loss"])
        st.history.append(row)
        ckpt.write_history(out_dir, st.history)
        print(f"[train] {json.dumps(row)}", flush=True)
        if do_ckpt:
            trainer.save()
        seg_start = last_log_t = time.perf_counter()
        last_log_step = st.step
    synchronize(device)
    st.train_seconds_used += time.perf_counter() - seg_start
    trainer.save()
    return status
