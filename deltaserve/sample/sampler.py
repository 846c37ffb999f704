"""Turns one step's logits into token ids (and logprobs), on whatever device the logits live.

Order of operations, per row, as vLLM v1 does it:
  logprobs  = log_softmax(raw logits)                      (fp32, before any processing)
  greedy    = argmax(raw logits)
  random    = logits / temperature -> top-k -> top-p -> min-p -> softmax -> draw
Draws use the exponential race, argmax(probs / q) with q ~ Exponential(1), which samples exactly
from `probs`; a seeded row draws its q with its own torch.Generator, so its token does not depend
on which other rows share the batch. Nothing here reads a tensor back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step_index: int) -> int:
    """The seed for a request's `step_index`-th output token (0-based), in [0, 2**63).

    A stable integer mix (splitmix64), identical across processes and runs, so a seeded request
    draws the same tokens when it is preempted and recomputed or batched differently.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step_index & _MASK64)) >> 1


@dataclass
class SamplingMetadata:
    """One row per sequence being sampled this step; built by the model runner.

    temperature: [N] float32, 0 for greedy rows.
    top_k: [N] int64, 0 = off.
    top_p: [N] float32, 1 = off.
    min_p: [N] float32, 0 = off.
    generators: row -> generator (on the logits' device) for seeded random rows; other rows use the
        global RNG.
    max_num_logprobs: the largest `logprobs` among rows; None when no row asked.
    all_greedy / all_random: every row greedy / no row greedy.
    no_top_k / no_top_p / no_min_p: host-side flags that let the sampler skip a filter nobody uses;
        False is always safe.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    all_greedy: bool = False
    all_random: bool = False
    no_top_k: bool = False
    no_top_p: bool = False
    no_min_p: bool = False

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        seeds_for_step: list[int | None],
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build the step's metadata. A row is seeded iff its `seeds_for_step` entry is not None
        (the runner passes `step_seed(params.seed, num_output_tokens)` for seeded requests)."""
        if len(seeds_for_step) != len(params):
            raise ValueError(f"seeds_for_step: {len(seeds_for_step)} entries for {len(params)} rows")
        device = torch.device(device)
        greedy = [p.greedy for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        generators = {}
        for row, (p, seed) in enumerate(zip(params, seeds_for_step, strict=True)):
            if seed is not None and not p.greedy:
                generators[row] = torch.Generator(device=device).manual_seed(seed)
        asked = [p.logprobs for p in params if p.logprobs is not None]

        def to_dev(values: list, dtype: torch.dtype) -> torch.Tensor:  # pinned: the host never waits
            host = torch.tensor(values, dtype=dtype)
            return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)

        return cls(
            temperature=to_dev(
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
            ),
            top_k=to_dev(top_k, torch.int64),
            top_p=to_dev([p.top_p for p in params], torch.float32),
            min_p=to_dev([p.min_p for p in params], torch.float32),
            generators=generators,
            max_num_logprobs=max(asked) if asked else None,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p <= 0.0 for p in params),
        )


@dataclass
class SamplerOutput:
    """sampled_token_ids: [N] int64.
    logprob_token_ids: [N, 1 + k] int64, the sampled token first, then the top-k ids (best first).
    logprobs: [N, 1 + k] float32, log_softmax of the raw logits at those ids.
    sampled_token_ranks: [N] int64, rank of the sampled token (1 = most likely).
    The last three are None when no row asked for logprobs; k = max_num_logprobs, and a row that
    asked for fewer uses the first 1 + its own k columns.
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[N, V] / [N] -> new [N, V]. Greedy rows (temperature 0) are divided by 1."""
    temperature = torch.where(temperature < _GREEDY_EPS, torch.ones_like(temperature), temperature)
    return logits / temperature.unsqueeze(-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p (on the renormalised top-k distribution), drop.

    logits: [N, V] float32; top_k: [N] (0 = off); top_p: [N] (1 = off). Returns a new [N, V].
    top-p keeps the smallest set of most likely tokens whose probability sums to >= top_p, and
    always the most likely token.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    position = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(position >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # the fp32 cumsum can pass 1.0 in the tail; rows with top_p = 1 must keep everything
    drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask in place the tokens whose probability is below min_p * (the most likely token's). [N, V]."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from probs [N, V] -> [N] int64 (exponential race)."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q may be exactly 0; 0/0 would be NaN, which argmax would pick
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def compute_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw_logprobs [N, V], sampled [N] -> (ids [N, 1+k], values [N, 1+k], ranks [N]).

    rank counts the tokens whose logprob is >= the sampled token's, as vLLM does (1 = the best).
    """
    top_values, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    sampled = sampled.unsqueeze(-1)
    sampled_values = raw_logprobs.gather(-1, sampled)
    ranks = (raw_logprobs >= sampled_values).sum(dim=-1)
    ids = torch.cat([sampled, top_ids], dim=-1)
    values = torch.cat([sampled_values, top_values], dim=-1)
    return ids, values, ranks


class Sampler:
    """logits [N, V] (any float dtype) + SamplingMetadata -> SamplerOutput."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            sampled = greedy_ids
        else:
            x = apply_temperature(logits, metadata.temperature)
            if not (metadata.no_top_k and metadata.no_top_p):
                x = apply_top_k_top_p(x, metadata.top_k, metadata.top_p)
            if not metadata.no_min_p:
                x = apply_min_p(x, metadata.min_p)
            random_ids = random_sample(x.softmax(dim=-1), metadata.generators)
            if greedy_ids is None:
                sampled = random_ids
            else:
                sampled = torch.where(metadata.temperature < _GREEDY_EPS, greedy_ids, random_ids)

        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled)
        raw_logprobs = logits.log_softmax(dim=-1)
        ids, values, ranks = compute_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, ids, values, ranks)
