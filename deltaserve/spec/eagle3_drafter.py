"""The Eagle3 drafter (vLLM's "eagle3" method): a one-layer head that drafts from the target's hidden states.

The target captures the stream entering each tap layer for every token it computes (`tap_layer_ids` on
the model; under pipeline parallelism the taps of earlier stages travel with the stream, so the last
stage holds them all). The head (`model/eagle3.py`) runs on the output rank after the step is sampled,
as one model on one rank, with a key/value cache per request:
- step 0 adds one entry per position the target computed and kept this step (a verify window's accepted
  positions only): the fused taps at position t with the embedding of token t + 1, at RoPE position t;
- from the last such entry it drafts greedily: the argmax is draft 1; each later draft feeds the previous
  one with the head's own output as the hidden state, one position further; those entries live only in
  the step's padded copy of the caches, so a rejected draft leaves nothing behind.
The requests of a step go through each head call together (padded to the longest, with a validity mask;
requests of very different cache lengths in separate groups), and the drafts reach the host in one copy
per group: k + 1 head calls and one sync per group and step, whatever the batch.
Positions the target did not compute here (a prefix hit, a P/D import) have no taps: the head's cache
then starts at the first position it has taps for (its drafts see less context; outputs are unchanged,
since every draft is verified).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.model.eagle3 import Eagle3Config, Eagle3Head, load_eagle3, read_eagle3_config
from deltaserve.spec.known_tokens import KnownTokens
from deltaserve.worker.host_transfer import to_device
from deltaserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


def eagle3_tap_layers(model_dir: str, target_config: Any) -> tuple[int, ...]:
    """The target layers whose input stream the head reads (its config only: what every stage needs)."""
    return _checked_config(model_dir, target_config).tap_layer_ids


def load_eagle3_head(model_dir: str, target_config: Any, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head, refused (ValueError naming the field) when it does not fit the target."""
    _checked_config(model_dir, target_config)
    return load_eagle3(model_dir, device=device, dtype=dtype).fuse_projections()


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


# a full head cache grows to this many times what it must hold
GROWTH = 1.25
# a group's padded cache copy holds at most this many times its caches' entries (plus PADDING_SLACK)
PADDING_LIMIT = 1.5
PADDING_SLACK = 256


def padding_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` (cache lengths) in groups, shortest first, such that padding a group to its
    longest keeps its copy within PADDING_LIMIT times its entries plus PADDING_SLACK (a request at 1M
    tokens beside many short ones is not padded into every one of them)."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and lengths[i] * (len(groups[-1]) + 1) <= PADDING_LIMIT * (total + lengths[i]) + PADDING_SLACK:
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


class HeadCache:
    """One request's step-0 entries: k and v [Nq, capacity, D] with the first `length` filled, grown by a
    quarter when full (appends copy only the new entries); entry 0 stands for target position
    `first_position`."""

    def __init__(self, first_position: int) -> None:
        self.first_position = first_position
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [Nq, n, D], the entries of the next n positions."""
        n = k.shape[1]
        if self.k is None or self.length + n > self.k.shape[1]:
            capacity = max(int(GROWTH * (self.length + n)), 64)
            grown_k = k.new_empty(k.shape[0], capacity, k.shape[2])
            grown_v = v.new_empty(v.shape[0], capacity, v.shape[2])
            if self.k is not None:
                grown_k[:, : self.length] = self.k[:, : self.length]
                grown_v[:, : self.length] = self.v[:, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, self.length : self.length + n] = k
        self.v[:, self.length : self.length + n] = v
        self.length += n


class Eagle3Drafter:
    """Runs the head for every request of a step at once: one padded call adds the step-0 entries, one
    call per draft position drafts for all sampled requests, and the drafts reach the host in one copy."""

    def __init__(self, head: Eagle3Head, k: int, max_model_len: int) -> None:
        self.head = head
        self.k = k
        self.max_model_len = max_model_len
        self.known = KnownTokens()
        self.caches: dict[str, HeadCache] = {}

    @torch.inference_mode()
    def propose(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput,
                runner: Any) -> dict[str, list[int]]:
        """After the target's step: extend each request's cache with the positions computed this step,
        then draft for those the step sampled for. `runner`: the model runner, holding this step's taps
        (`model.captured_taps`, [T, n * hidden]) and each chunk's first flat row (`step_rows`)."""
        self.known.note_step(scheduler_output)
        for request_id in scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids:
            self.caches.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.caches.pop(new.request_id, None)
        self.known.note_output(output)
        taps = runner.model.captured_taps
        if taps is None or not scheduler_output.chunks:
            return {}
        accepted = {r: 1 + len(output.extra_token_ids.get(r, [])) for r in output.request_ids}
        entries = []  # (request id, first new position, new entries, first tap row)
        for chunk in scheduler_output.chunks:
            request_id, start = chunk.request_id, chunk.num_computed_tokens
            count = accepted.get(request_id, 0) if chunk.is_verify else chunk.num_tokens
            if count:
                entries.append((request_id, start, count, runner.step_rows[request_id]))
        if not entries:
            return {}
        fused = self.head.fuse(taps)
        lengths = [self._cache_for(request_id, start).length for request_id, start, _, _ in entries]
        drafts: dict[str, list[int]] = {}
        sampled = set(accepted)
        for group in padding_groups(lengths):  # requests of similar cache lengths share the padded calls
            drafts.update(self._run_group([entries[i] for i in group], fused, sampled))
        return drafts

    def _cache_for(self, request_id: str, start: int) -> HeadCache:
        """The request's cache, started over at `start` when its entries do not reach there (a prefix hit,
        a P/D import, a preemption)."""
        cache = self.caches.get(request_id)
        if cache is None or cache.first_position + cache.length != start:
            cache = self.caches[request_id] = HeadCache(start)
        return cache

    def _run_group(self, entries: list[tuple[str, int, int, int]], fused: torch.Tensor,
                   sampled: set[str]) -> dict[str, list[int]]:
        """One group's head calls: the new step-0 entries of every request (fused [T, H], the step's fused
        taps), padded to the longest and appended to each cache, then greedy drafts for the requests in
        `sampled`. One buffer holds the group's keys and values, [B, Nq, S + n + k - 1, D]: the caches
        (padded to the longest, S), the new entries (n) and the draft entries, which never reach a cache."""
        device = fused.device
        caches = [self.caches[request_id] for request_id, _, _, _ in entries]
        width = max(count for _, _, count, _ in entries)
        rows, tokens = [], []
        for request_id, start, count, row in entries:
            rows += [row + min(i, count - 1) for i in range(width)]
            following = self.known[request_id][start + 1 : start + 1 + count]
            tokens += following + [0] * (width - len(following))
        past = max(c.length for c in caches)
        counts = [max(0, min(self.k, self.max_model_len - len(self.known[e[0]]))) if e[0] in sampled else 0
                  for e in entries]
        steps = max(counts)
        dev = to_device(device, {"rows": rows, "tokens": tokens, "starts": [e[1] for e in entries],
                                 "new": [e[2] for e in entries], "cached": [cache.length for cache in caches]})
        c = self.head.config
        shape = (len(entries), c.num_attention_heads, past + width + max(steps - 1, 0), c.head_dim)
        keys = fused.new_zeros(shape, dtype=self.head.fc.weight.dtype)
        values = torch.zeros_like(keys)
        for b, cache in enumerate(caches):
            if cache.length:
                keys[b, :, : cache.length] = cache.k[:, : cache.length]
                values[b, :, : cache.length] = cache.v[:, : cache.length]
        starts, new = dev["starts"][:, None], dev["new"][:, None]  # [B, 1] each
        valid = torch.arange(shape[2], device=device) < dev["cached"][:, None]
        out = self.head.extend(dev["tokens"].view(-1, width), fused[dev["rows"].view(-1, width)],
                               starts + torch.arange(width, device=device), keys, values, valid, past)
        valid[:, past : past + width] = torch.arange(width, device=device) < new
        for b, (cache, (_, _, count, _)) in enumerate(zip(caches, entries, strict=True)):
            cache.append(keys[b, :, past : past + count], values[b, :, past : past + count])
        if steps == 0:
            return {e[0]: [] for e in entries if e[0] in sampled}
        hidden = out[torch.arange(len(entries), device=device), new[:, 0] - 1][:, None]  # [B, 1, H]: the last entries
        position = starts + new - 1  # [B, 1]: where each request's last step-0 entry stands
        column = past + width
        drafted = []
        for step in range(steps):
            token = self.head.compute_logits(hidden)[:, 0].argmax(-1)  # [B]
            drafted.append(token)
            if step + 1 == steps:
                break
            hidden = self.head.extend(token[:, None], hidden, position + step + 1, keys, values, valid, column + step)
            valid[:, column + step] = True
        drafts = torch.stack(drafted, dim=1).tolist()  # the one host copy
        return {e[0]: drafts[i][: counts[i]] for i, e in enumerate(entries) if e[0] in sampled}
