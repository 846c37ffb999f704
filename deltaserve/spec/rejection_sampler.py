"""Lossless verification of draft tokens (speculative sampling, Leviathan et al. 2023), as vLLM v1 does it.

Layout of one step, for a batch of B requests where request r brings n_r >= 0 draft tokens (D = sum n_r,
K = max n_r):
  draft_token_ids  [D]          the drafts of request 0, then of request 1, ...
  draft_probs      [D, V]       the distribution each draft was drawn from; None for an n-gram drafter
                                (a point mass on the drafted token)
  target_logits    [D + B, V]   per request, contiguous: the logits that verify its n_r drafts, then its
                                bonus position (the logits after its last draft). Request r's rows start
                                at sum_{s<r} (n_s + 1).
Position j of request r (0 <= j <= n_r) emits the request's output token number num_output_tokens[r] + j.

Per position the target logits are turned into a distribution p exactly as the plain Sampler does
(temperature -> top-k -> top-p -> min-p -> softmax). Greedy rows accept a draft iff it equals the argmax
of the raw logits, and emit that argmax at the first mismatch or the bonus position: token for token what
plain greedy decoding produces. Random rows accept draft d with probability min(1, p(d) / q(d)) (u < p/q,
u uniform in [0, 1), so a token of target probability 0 is never accepted); at the first rejection they
draw from max(p - q, 0) renormalised (for an n-gram draft: p without d), and when every draft is accepted
they draw the bonus token from p. The emitted tokens are then distributed exactly as tokens drawn from p
one at a time. Draws use the same exponential race as the Sampler.

Seeded random requests: position j draws from a torch.Generator seeded with
step_seed(seed, num_output_tokens[r] + j), first the V exponentials of the race (for the recovered or
bonus token), then, at a draft position, the one uniform of the acceptance test. A seeded request's
tokens therefore do not depend on what it is batched with, and with no drafts it draws exactly the token
the plain Sampler draws. Unseeded rows use the global RNG.

Nothing reads a tensor back to the host except `RejectionOutput.tolist()`, which the caller runs once it
needs the ids (the scheduler must know how many tokens each request got).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.sample.sampler import apply_min_p, apply_temperature, apply_top_k_top_p, step_seed
from deltaserve.sampling_params import SamplingParams
from deltaserve.worker.host_transfer import to_device

PLACEHOLDER_TOKEN_ID = -1


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    # pinned: the copy is asynchronous and the host never waits for it
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


@dataclass
class RejectionMetadata:
    """Where each request's drafts and positions sit, and per-row sampling parameters; built on the host.

    R = D + B rows of target logits, K = max_num_draft.
    num_draft_per_request: [B] host ints n_r.
    draft_rows: [D] int64, the target-logits row that verifies each draft.
    position_rows: [B, K + 1] int64, the target-logits row of (request, position j); for j > n_r it repeats
        the request's bonus row (those slots are never emitted).
    draft_index: [B, K] int64, the index into draft_token_ids of (request, j); 0 where j >= n_r.
    draft_valid: [B, K] bool, j < n_r.
    temperature / top_k / top_p / min_p: [R], each request's values repeated over its rows; temperature
        is 0 on greedy rows, top_k 0 = off, top_p 1 = off, min_p 0 = off.
    generators: row -> (generator, whether the row is a draft row and so also draws an acceptance
        uniform) for the rows of seeded random requests.
    all_greedy / all_random / no_top_k / no_top_p / no_min_p: host flags that skip unused work; False is
        always safe.
    """

    num_draft_per_request: list[int]
    draft_rows: torch.Tensor
    position_rows: torch.Tensor
    draft_index: torch.Tensor
    draft_valid: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: dict[int, tuple[torch.Generator, bool]] = field(default_factory=dict)
    all_greedy: bool = False
    all_random: bool = False
    no_top_k: bool = False
    no_top_p: bool = False
    no_min_p: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_per_request)

    @property
    def num_draft_tokens(self) -> int:
        return sum(self.num_draft_per_request)

    @property
    def max_num_draft(self) -> int:
        return max(self.num_draft_per_request, default=0)

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        num_draft_per_request: list[int],
        num_output_tokens: list[int],
        device: torch.device | str,
    ) -> RejectionMetadata:
        """params[r], n_r = num_draft_per_request[r], and num_output_tokens[r] = the output tokens request r
        had before this step (its first position's step index for `step_seed`)."""
        if len(num_draft_per_request) != len(params) or len(num_output_tokens) != len(params):
            raise ValueError(
                f"num_draft_per_request has {len(num_draft_per_request)} entries and num_output_tokens "
                f"{len(num_output_tokens)} for {len(params)} requests; give one of each per request"
            )
        counts = {"num_draft_per_request": num_draft_per_request, "num_output_tokens": num_output_tokens}
        for name, values in counts.items():
            if any(v < 0 for v in values):
                raise ValueError(f"{name}={values}: every entry must be >= 0")
        device = torch.device(device)
        num_requests = len(params)
        max_draft = max(num_draft_per_request, default=0)
        draft_rows, position_rows, draft_index, draft_valid = [], [], [], []
        temperature, top_k, top_p, min_p = [], [], [], []
        generators: dict[int, tuple[torch.Generator, bool]] = {}
        row = draft = 0
        for p, n, done in zip(params, num_draft_per_request, num_output_tokens, strict=True):
            draft_rows.extend(range(row, row + n))
            bonus_row = row + n
            position_rows.append([min(row + j, bonus_row) for j in range(max_draft + 1)])
            draft_index.append([draft + j if j < n else 0 for j in range(max_draft)])
            draft_valid.append([j < n for j in range(max_draft)])
            temperature += [0.0 if p.greedy else p.temperature] * (n + 1)
            top_k += [max(p.top_k, 0)] * (n + 1)
            top_p += [p.top_p] * (n + 1)
            min_p += [p.min_p] * (n + 1)
            if p.seed is not None and not p.greedy:
                for j in range(n + 1):
                    generator = torch.Generator(device=device).manual_seed(step_seed(p.seed, done + j))
                    generators[row + j] = (generator, j < n)
            row += n + 1
            draft += n
        greedy = [p.greedy for p in params]
        # two host-to-device copies for the whole step: the integer arrays packed into one, the floats into another
        ints = to_device(device, {"draft_rows": draft_rows, "position_rows": [r for row in position_rows for r in row],
                                  "draft_index": [i for row in draft_index for i in row], "top_k": top_k,
                                  "draft_valid": [int(v) for row in draft_valid for v in row]})
        floats = _to_device([temperature, top_p, min_p], torch.float32, device)  # [3, R]
        return cls(
            num_draft_per_request=list(num_draft_per_request),
            draft_rows=ints["draft_rows"],
            position_rows=ints["position_rows"].view(num_requests, max_draft + 1),
            draft_index=ints["draft_index"].view(num_requests, max_draft),
            draft_valid=ints["draft_valid"].bool().view(num_requests, max_draft),
            temperature=floats[0],
            top_k=ints["top_k"],
            top_p=floats[1],
            min_p=floats[2],
            generators=generators,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(k == 0 for k in top_k),
            no_top_p=all(v >= 1.0 for v in top_p),
            no_min_p=all(v <= 0.0 for v in min_p),
        )


@dataclass
class RejectionOutput:
    """token_ids: [B, K + 1] int64; row r holds its accepted drafts, then the recovered token (first
        rejection) or the bonus token (all accepted), then PLACEHOLDER_TOKEN_ID (-1).
    num_tokens: [B] int64, the valid tokens of each row (accepted drafts + 1, so 1 .. n_r + 1).
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor

    def tolist(self) -> list[list[int]]:
        """The valid tokens of each request. Reads the ids back to the host (the one sync of a step)."""
        rows = self.token_ids.tolist()
        counts = self.num_tokens.tolist()
        return [row[:count] for row, count in zip(rows, counts, strict=True)]


def target_probs(logits: torch.Tensor, metadata: RejectionMetadata) -> torch.Tensor:
    """logits [R, V] float32 -> p [R, V]: temperature, top-k, top-p, min-p, softmax (the Sampler's order)."""
    x = apply_temperature(logits, metadata.temperature)
    if not (metadata.no_top_k and metadata.no_top_p):
        x = apply_top_k_top_p(x, metadata.top_k, metadata.top_p)
    if not metadata.no_min_p:
        x = apply_min_p(x, metadata.min_p)
    return x.softmax(dim=-1)


def draw_noise(
    num_rows: int, vocab_size: int, metadata: RejectionMetadata, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (exponential race noise [R, V], acceptance uniforms [R]; bonus rows' uniforms are unused).

    Seeded rows redraw theirs from their own generator: exponentials first, then the uniform."""
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    uniform = torch.empty(num_rows, dtype=torch.float32, device=device)
    if len(metadata.generators) < num_rows:
        noise.exponential_()
        uniform.uniform_()
    for row, (generator, is_draft_row) in metadata.generators.items():
        noise[row].exponential_(generator=generator)
        if is_draft_row:
            uniform[row : row + 1].uniform_(generator=generator)
    # q may be exactly 0; 0/0 would be NaN, which argmax would pick
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny), uniform


def random_verify(
    probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    noise: torch.Tensor,
    uniform: torch.Tensor,
    draft_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The random rows' decisions -> (accepted [D] bool, token [R] int64).

    token[row] is what the position emits if it is reached and its draft (if any) is rejected: at a draft
    row a draw from max(p - q, 0) renormalised, at a bonus row a draw from p.
    probs [R, V]; draft_token_ids [D]; draft_probs [D, V] or None; noise [R, V]; uniform [R]; draft_rows [D].
    """
    p_draft_rows = probs.index_select(0, draft_rows)
    p_at_draft = p_draft_rows.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
    if draft_probs is None:
        accepted = uniform[draft_rows] < p_at_draft
        residual = p_draft_rows.scatter_(1, draft_token_ids.unsqueeze(1), 0.0)
    else:
        draft_probs = draft_probs.float()
        q_at_draft = draft_probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
        # u < p/q without the division: q = 0 with p > 0 accepts (ratio inf), p = 0 never does
        accepted = uniform[draft_rows] * q_at_draft < p_at_draft
        residual = p_draft_rows.sub_(draft_probs).clamp_(min=0.0)
    # p <= q everywhere only by rounding (a rejection is then near impossible); draw from p, never token 0
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    residual = torch.where(empty, probs.index_select(0, draft_rows), residual)
    dist = probs.index_copy(0, draft_rows, residual)
    return accepted, dist.div_(noise).argmax(dim=-1)


def assemble(
    accepted: torch.Tensor, fallback: torch.Tensor, draft_token_ids: torch.Tensor, metadata: RejectionMetadata
) -> RejectionOutput:
    """accepted [D] bool, fallback [R] int64 (the token a position emits when it ends the row) -> output."""
    num_requests, max_draft = metadata.batch_size, metadata.max_num_draft
    device = fallback.device
    if max_draft == 0:
        num_accepted = torch.zeros(num_requests, dtype=torch.int64, device=device)
        drafts = torch.empty(num_requests, 0, dtype=torch.int64, device=device)
    else:
        accepted_pad = accepted[metadata.draft_index] & metadata.draft_valid
        # accepted drafts are the leading run of accepts: cumprod zeroes everything after the first reject
        num_accepted = accepted_pad.long().cumprod(dim=1).sum(dim=1)
        drafts = draft_token_ids[metadata.draft_index]
    drafts = torch.cat([drafts, drafts.new_full((num_requests, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    position = torch.arange(max_draft + 1, device=device).unsqueeze(0)
    end = num_accepted.unsqueeze(1)
    last = fallback[metadata.position_rows]
    token_ids = torch.where(
        position < end, drafts, torch.where(position == end, last, torch.full_like(last, PLACEHOLDER_TOKEN_ID))
    )
    return RejectionOutput(token_ids=token_ids, num_tokens=num_accepted + 1)


class RejectionSampler:
    """Verifies one step's drafts: target logits + drafts (+ draft probs) + RejectionMetadata -> RejectionOutput."""

    def __call__(
        self,
        target_logits: torch.Tensor,
        draft_token_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        metadata: RejectionMetadata,
    ) -> RejectionOutput:
        """target_logits [D + B, V] (any float dtype; sampled in float32); draft_token_ids [D] int64;
        draft_probs [D, V] or None (n-gram). Layout in the module docstring."""
        num_draft, num_rows = metadata.num_draft_tokens, metadata.num_draft_tokens + metadata.batch_size
        if target_logits.ndim != 2 or target_logits.shape[0] != num_rows:
            raise ValueError(
                f"target_logits has shape {tuple(target_logits.shape)}; expected [{num_rows}, vocab] = "
                f"[num_draft_tokens + batch, vocab] for num_draft_per_request={metadata.num_draft_per_request}"
            )
        if tuple(draft_token_ids.shape) != (num_draft,):
            raise ValueError(
                f"draft_token_ids has shape {tuple(draft_token_ids.shape)}; expected [{num_draft}] "
                f"(sum of num_draft_per_request={metadata.num_draft_per_request})"
            )
        vocab_size = target_logits.shape[1]
        if draft_probs is not None and tuple(draft_probs.shape) != (num_draft, vocab_size):
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}; expected [{num_draft}, {vocab_size}] "
                "(one distribution per draft token), or None for an n-gram drafter"
            )
        draft_token_ids = draft_token_ids.long()
        logits = target_logits.float()
        greedy_ids = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            accepted = draft_token_ids == greedy_ids[metadata.draft_rows]
            return assemble(accepted, greedy_ids, draft_token_ids, metadata)

        probs = target_probs(logits, metadata)
        noise, uniform = draw_noise(num_rows, vocab_size, metadata, logits.device)
        accepted, fallback = random_verify(probs, draft_token_ids, draft_probs, noise, uniform, metadata.draft_rows)
        if greedy_ids is not None:
            greedy_row = metadata.temperature == 0.0
            greedy_accepted = draft_token_ids == greedy_ids[metadata.draft_rows]
            accepted = torch.where(greedy_row[metadata.draft_rows], greedy_accepted, accepted)
            fallback = torch.where(greedy_row, greedy_ids, fallback)
        return assemble(accepted, fallback, draft_token_ids, metadata)
