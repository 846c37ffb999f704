"""The Eagle3 drafter (vLLM's "eagle3" method): a one-layer head that drafts from the target's hidden states.

The target captures the stream entering each tap layer for every token it computes (`tap_layer_ids` on
the model; under pipeline parallelism the taps of earlier stages travel with the stream, so the last
stage holds them all). The head (`model/eagle3.py`) runs on the output rank after the step is sampled,
as one model on one rank, with a key/value cache per request:
- step 0 adds one entry per position the target computed and kept this step (a verify window's accepted
  positions only): the fused taps at position t with the embedding of token t + 1, at RoPE position t;
- from the last such entry it drafts greedily: the argmax is draft 1; each later draft feeds the previous
  one with the head's own output as the hidden state, one position further; those entries are dropped
  from the cache afterwards, so a rejected draft leaves nothing behind.
Positions the target did not compute here (a prefix hit, a P/D import) have no taps: the head's cache
then starts at the first position it has taps for (its drafts see less context; outputs are unchanged,
since every draft is verified).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.model.eagle3 import Eagle3Config, Eagle3Head, Eagle3KVCache, load_eagle3, read_eagle3_config
from deltaserve.spec.known_tokens import KnownTokens
from deltaserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


def eagle3_tap_layers(model_dir: str, target_config: Any) -> tuple[int, ...]:
    """The target layers whose input stream the head reads (its config only: what every stage needs)."""
    return _checked_config(model_dir, target_config).tap_layer_ids


def load_eagle3_head(model_dir: str, target_config: Any, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head, refused (ValueError naming the field) when it does not fit the target."""
    _checked_config(model_dir, target_config)
    return load_eagle3(model_dir, device=device, dtype=dtype)


def _checked_config(model_dir: str, target_config: Any) -> Eagle3Config:
    c = read_eagle3_config(model_dir)
    if c.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config: the eagle3 head {model_dir!r} has vocab_size={c.vocab_size}, the "
                         f"target {target_config.vocab_size}")
    if c.target_hidden_size != target_config.hidden_size:
        raise ValueError(f"speculative_config: the eagle3 head {model_dir!r} reads target_hidden_size="
                         f"{c.target_hidden_size}, the target's hidden_size is {target_config.hidden_size}")
    layers = target_config.num_hidden_layers
    if any(i >= layers for i in c.tap_layer_ids):
        raise ValueError(f"speculative_config: the eagle3 head {model_dir!r} taps layers {list(c.tap_layer_ids)}, "
                         f"but the target has {layers} layers")
    return c


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, k: int, max_model_len: int) -> None:
        self.head = head
        self.k = k
        self.max_model_len = max_model_len
        self.known = KnownTokens()
        # per request: the head's cache of step-0 entries, and the position its first entry stands for
        self.caches: dict[str, Eagle3KVCache] = {}
        self.first_position: dict[str, int] = {}

    def _forget(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
        self.first_position.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput,
                runner: Any) -> dict[str, list[int]]:
        """After the target's step: extend each request's cache with the positions computed this step,
        then draft for those the step sampled for. `runner`: the model runner, holding this step's taps
        (`model.captured_taps`, [T, n * hidden]) and each chunk's first flat row (`step_rows`)."""
        self.known.note_step(scheduler_output)
        for request_id in scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids:
            self._forget(request_id)
        for new in scheduler_output.new_requests:
            self._forget(new.request_id)
        self.known.note_output(output)
        taps = runner.model.captured_taps
        if taps is None or not scheduler_output.chunks:
            return {}
        fused = self.head.fuse(taps)  # [T, H]
        accepted = {r: 1 + len(output.extra_token_ids.get(r, [])) for r in output.request_ids}
        sampled = set(output.request_ids)
        drafts = {}
        for chunk in scheduler_output.chunks:
            request_id, start = chunk.request_id, chunk.num_computed_tokens
            count = accepted.get(request_id, 0) if chunk.is_verify else chunk.num_tokens
            if count == 0:
                continue
            row = runner.step_rows[request_id]
            out = self._add_entries(request_id, start, fused[row : row + count])
            if request_id in sampled:
                drafts[request_id] = self._draft(request_id, out[:, -1:])
        return drafts

    def _add_entries(self, request_id: str, start: int, hidden: torch.Tensor) -> torch.Tensor:
        """Step-0 entries for positions [start, start + n), hidden [n, H]: returns the head's out [1, n, H]."""
        cache = self.caches.get(request_id)
        first = self.first_position.get(request_id, start)
        if cache is None or first + cache.length != start:  # a gap (a hit, an import, a rollback): start over
            cache, first = Eagle3KVCache(), start
            self.caches[request_id], self.first_position[request_id] = cache, first
        known = self.known[request_id]
        n = hidden.shape[0]
        device = hidden.device
        next_tokens = torch.tensor(known[start + 1 : start + 1 + n], dtype=torch.long, device=device)
        positions = torch.arange(start, start + n, device=device)
        return self.head(next_tokens.view(1, n), hidden.view(1, n, -1), positions.view(1, n), cache)

    def _draft(self, request_id: str, out: torch.Tensor) -> list[int]:
        """Greedy drafts after the request's last step-0 entry (out [1, 1, H]); the draft entries are
        dropped from its cache afterwards."""
        cache = self.caches[request_id]
        kept = cache.length
        known = self.known[request_id]
        count = min(self.k, self.max_model_len - len(known))
        drafts: list[int] = []
        position = len(known) - 2  # the index of the last step-0 entry
        for step in range(count):
            token = int(self.head.compute_logits(out)[0, -1].argmax())
            drafts.append(token)
            if step + 1 == count:
                break
            ids = torch.tensor([[token]], dtype=torch.long, device=out.device)
            pos = torch.tensor([[position + step + 1]], device=out.device)
            out = self.head(ids, out, pos, cache)
        cache.k, cache.v = cache.k[:, :, :kept], cache.v[:, :, :kept]
        return drafts
