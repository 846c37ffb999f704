"""The topology check of prefill/decode disaggregation: who reads what from whom, and at what cost.

A prefill engine of `pp` stages x `tp` ranks (the producer) hands each request's paged MLA latents
and KDA state to a decode engine of `tp` ranks in groups of `dcp` (the consumer). `plan_topology`
says, for every decode rank, which prefill ranks (pp_rank, tp_rank) it reads, which model layer ids
from each, which KDA heads and conv channels from which prefill TP rank's head segment, and which
tokens' latents (its DCP stripe); then the bytes and transfer descriptors of one request, and every
reason the pair cannot be served. It takes and returns plain data (no tensors), so the servers run
the same check at startup and at the handshake, and `deltaserve topology` only prints it.

Placement rules (vLLM's and ATOM's, see docs/architecture.md):
- PP splits layers into contiguous ranges (`ParallelConfig.stage_layer_range`); a decode rank pairs
  with a stage by model layer id, never by a layer's position inside its stage.
- KDA heads are split over TP ranks (state [H/tp, K, V], conv channels [q | k | v] of H/tp heads
  each). With decode tp = k x prefill tp, decode rank r holds heads [r H/tp_d, (r+1) H/tp_d), which
  lie inside prefill TP rank r // k's segment [p H/tp_p, (p+1) H/tp_p): it reads everything from that
  rank. MLA latents are replicated over TP, so the same producer rank serves them.
- Under DCP, decode TP ranks [g dcp, (g+1) dcp) form DCP group g; its rank d = tp_rank % dcp stores
  the tokens p with (p // S) % dcp == d (S the interleave), so every DCP group needs every token,
  and reads it once (`distributed/dcp_layout.DCPLayout` is the same layout on tensors).

Descriptors, counted per request and per MLA layer (one layer's latents are one registered region):
- per-token path: a descriptor is a run of the consumer's tokens contiguous on both sides, so a run
  is cut where its stripe skips a token, at every producer page (`block_size` tokens) and at every
  destination page (`decode_block_size` local tokens). At interleave 1 under DCP every token is its
  own run: one descriptor per token per MLA layer. The 48B shape (7 MLA layers) at 117,000 tokens
  under TP8 x DCP8 gives 8 ranks x 14,625 tokens x 7 layers = 819,000 descriptors, the "about 1M
  per 117K-token request" that ATOM PR 2709 measured before staging.
- staged (kv_transfer/staging.py): the producer gathers a consumer's tokens into a staging slot in
  the consumer's order, and the consumer reads one descriptor per destination page per MLA layer:
  8 x ceil(14,625 / 16) x 7 = 51,240 on the same request (when a slot's tokens are a whole number of
  destination pages). A staging slot holds `staging_chunk_pages` pages of the producer's block size
  of every MLA layer of its stage; each producer GPU holds `staging_slots` of them back from its KV
  cache, 0 bytes when staging is off (`staging_chunk_pages=0`).
- KDA state: per KDA layer one descriptor for the recurrent rows [heads, K, V] (heads outermost, so
  contiguous) and one per q, k, v block of conv channels (conv state [3 x local dim, W - 1]), merged
  into one when the consumer takes the producer's whole segment.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from deltaserve.config.model_config import KimiLinearConfig
from deltaserve.config.parallel import ParallelConfig
from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}

Span = tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class EngineTopology:
    """One engine's ranks: `pp` stages x `tp` ranks, DCP groups of `dcp` consecutive TP ranks."""

    tp: int = 1
    pp: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dcp"):
            if getattr(self, name) < 1:
                raise ValueError(f"topology: {name}={getattr(self, name)} must be >= 1")

    def __str__(self) -> str:
        parts = ([f"PP{self.pp}"] if self.pp > 1 else []) + [f"TP{self.tp}"]
        return " x ".join(parts + ([f"DCP{self.dcp}"] if self.dcp > 1 else []))


def parse_topology(text: str) -> EngineTopology:
    """"pp=8,tp=1" -> EngineTopology(tp=1, pp=8); keys pp, tp, dcp, each at most once."""
    values: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("pp", "tp", "dcp") or key in values:
            raise ValueError(f"topology: {item!r} in {text!r} is not one of pp=N, tp=N, dcp=N (each once)")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"topology: {key}={value!r} in {text!r} is not an integer") from None
    return EngineTopology(**values)


@dataclass(frozen=True)
class TransferSettings:
    """Page sizes and the request the costs are given for. block_size: the producer's page in
    tokens; decode_block_size: a decode rank's local page; dcp_interleave: consecutive tokens per
    DCP rank; staging_chunk_pages: destination pages per staging slot (0: no staging);
    staging_slots: slots per producer GPU; dtype_bytes: bytes of a latent and of a conv value;
    chunked_transfer: the producer sends each prefill chunk's KV while its prefill runs."""

    block_size: int = 16
    decode_block_size: int = 16
    dcp_interleave: int = 1
    prompt_tokens: int = 131072
    staging_chunk_pages: int = 0
    staging_slots: int = 16
    dtype_bytes: int = 2
    chunked_transfer: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "decode_block_size", "dcp_interleave", "staging_slots", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"topology: {name}={getattr(self, name)} must be >= 1")
        for name in ("prompt_tokens", "staging_chunk_pages"):
            if getattr(self, name) < 0:
                raise ValueError(f"topology: {name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class Refusal:
    """A reason the pair cannot be served: `kind` a short tag, `reason` what is wrong and what to change."""

    kind: str
    reason: str


@dataclass(frozen=True)
class StageLayers:
    """Prefill stage `pp_rank`: its model layers [start, end) and which of them are KDA and MLA."""

    pp_rank: int
    layer_range: Span
    kda_layer_ids: tuple[int, ...]
    mla_layer_ids: tuple[int, ...]
    staging_reserve_bytes: int  # held back on each of its GPUs for MLA staging slots


@dataclass(frozen=True)
class TokenStripe:
    """The tokens DCP rank `dcp_rank` of a group of `dcp` stores: p with (p // interleave) % dcp == dcp_rank."""

    dcp: int
    dcp_rank: int
    interleave: int

    def owns(self, position: int) -> bool:
        return (position // self.interleave) % self.dcp == self.dcp_rank

    def local_offset(self, position: int) -> int:
        """Where an owned token sits among the rank's tokens of its sequence."""
        return position // (self.dcp * self.interleave) * self.interleave + position % self.interleave

    def count(self, num_tokens: int) -> int:
        """How many of positions [0, num_tokens) the rank stores."""
        full_rounds, rest = divmod(num_tokens, self.dcp * self.interleave)
        return full_rounds * self.interleave + min(max(rest - self.dcp_rank * self.interleave, 0), self.interleave)

    def positions(self, num_tokens: int) -> list[int]:
        return [p for p in range(num_tokens) if self.owns(p)]


@dataclass(frozen=True)
class StageRead:
    """What one decode rank reads from prefill rank (pp_rank, tp_rank), by model layer id."""

    pp_rank: int
    tp_rank: int
    kda_layer_ids: tuple[int, ...]
    mla_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReadPlan:
    """Decode rank `tp_rank` (DCP rank `dcp_rank` of group `dcp_group`): its sources and its share of a request.

    kda_heads are global head ids; segment_heads the same heads inside prefill TP rank
    `producer_tp_rank`'s segment; conv_channels the global q, k and v channel ranges of those heads
    and segment_conv_channels where they sit in the producer's conv state [3 x H/tp_p x D, W - 1].
    """

    tp_rank: int
    dcp_rank: int
    dcp_group: int
    producer_tp_rank: int
    kda_heads: Span
    segment_heads: Span
    conv_channels: tuple[Span, Span, Span]
    segment_conv_channels: tuple[Span, Span, Span]
    stripe: TokenStripe
    reads: tuple[StageRead, ...]
    num_tokens: int  # of the request's prompt_tokens, those this rank stores
    latent_bytes: int
    state_bytes: int
    per_token_descriptors: int  # MLA, over all layers
    staged_descriptors: int  # MLA, over all layers
    state_descriptors: int  # KDA, over all layers


@dataclass(frozen=True)
class TransferCost:
    """One request of `prompt_tokens` tokens, summed over every decode rank."""

    prompt_tokens: int
    latent_bytes_per_token: int  # one copy of a token's latents, every MLA layer
    latent_bytes: int  # every DCP group reads every token once
    state_bytes: int  # the whole KDA state image: every head read by exactly one decode rank
    descriptor_bytes: int  # one token's latents of one layer, the per-token path's unit
    per_token_descriptors: int
    staged_descriptors: int
    state_descriptors: int
    staging_reserve_bytes: int  # on the producer GPU that holds the most


@dataclass(frozen=True)
class TopologyPlan:
    """The check's answer: `reads` per decode rank and `cost`, both empty when `refusals` is not."""

    prefill: EngineTopology
    decode: EngineTopology
    settings: TransferSettings
    stages: tuple[StageLayers, ...]
    reads: tuple[ReadPlan, ...]
    cost: TransferCost | None
    refusals: tuple[Refusal, ...]

    @property
    def ok(self) -> bool:
        return not self.refusals

    def raise_if_refused(self) -> None:
        """What a server calls at startup and handshake: a ValueError listing every refusal."""
        if self.refusals:
            lines = "\n".join(f"- {r.reason}" for r in self.refusals)
            raise ValueError(f"topology {self.prefill} -> {self.decode} is refused:\n{lines}")


def plan_stages(model: KimiLinearConfig, prefill: EngineTopology,
                settings: TransferSettings) -> tuple[StageLayers, ...]:
    """Each prefill stage's layers and its MLA staging reserve per GPU."""
    kinds = set(model.kda_layer_ids)
    stages = []
    for pp_rank in range(prefill.pp):
        start, end = ParallelConfig(pipeline_parallel_size=prefill.pp,
                                    pipeline_parallel_rank=pp_rank).stage_layer_range(model.num_hidden_layers)
        kda = tuple(i for i in range(start, end) if i in kinds)
        mla = tuple(i for i in range(start, end) if i not in kinds)
        slot = settings.staging_chunk_pages * settings.block_size * len(mla) * model.latent_dim
        stages.append(StageLayers(pp_rank, (start, end), kda, mla,
                                  settings.staging_slots * slot * settings.dtype_bytes))
    return tuple(stages)


def find_refusals(model: KimiLinearConfig, prefill: EngineTopology, decode: EngineTopology,
                  settings: TransferSettings, stages: tuple[StageLayers, ...]) -> list[Refusal]:
    """Every reason the producer cannot feed the consumer, each naming both sides' sizes."""
    out = []
    heads = model.linear_num_heads
    if decode.pp > 1:
        out.append(Refusal("pp_decode", f"a PP decode consumer is not supported: decode pp={decode.pp} "
                                        f"(prefill pp={prefill.pp}); use decode pp=1"))
    if prefill.dcp > 1:
        out.append(Refusal("dcp_prefill", f"a DCP prefill producer is not supported: prefill dcp={prefill.dcp} "
                                          f"(decode dcp={decode.dcp}); use prefill dcp=1"))
    if decode.tp % prefill.tp:
        out.append(Refusal("tp_ratio", f"decode tp={decode.tp} is not a multiple of prefill tp={prefill.tp}: "
                                       "each decode rank must read its KDA heads from one prefill TP rank; "
                                       "choose a decode tp that prefill tp divides"))
    if heads % decode.tp or heads % prefill.tp:
        out.append(Refusal("head_group", f"KDA heads (linear_attn_config.num_heads={heads}) do not split over "
                                         f"prefill tp={prefill.tp} and decode tp={decode.tp}: decode rank r "
                                         "reads its heads from prefill tp rank r // (decode tp / prefill tp) "
                                         "and they must lie inside that rank's head segment; choose TP sizes "
                                         f"that divide {heads}"))
    if decode.tp % decode.dcp:
        out.append(Refusal("dcp_divides_tp", f"decode dcp={decode.dcp} does not divide decode tp={decode.tp} "
                                             f"(prefill tp={prefill.tp}): DCP groups are consecutive TP ranks"))
    if settings.decode_block_size % settings.dcp_interleave:
        out.append(Refusal("interleave", f"dcp interleave={settings.dcp_interleave} does not divide decode "
                                         f"block size={settings.decode_block_size} (prefill block size="
                                         f"{settings.block_size})"))
    if settings.chunked_transfer and decode.dcp > 1:
        out.append(Refusal("chunked_to_dcp", f"chunked transfer cannot reach a DCP decode: decode dcp={decode.dcp} "
                                             f"(prefill pp={prefill.pp} x tp={prefill.tp}); a DCP rank reads its "
                                             "token stripe per token or through the producer's staging of a "
                                             "finished request. A decode refuses such requests at admission "
                                             "(HTTP 400); run the producer without chunked_transfer"))
    for stage in stages:
        if not stage.kda_layer_ids:
            out.append(Refusal("stage_without_kda", f"prefill stage pp_rank={stage.pp_rank} (of pp={prefill.pp}) "
                                                    f"holds layers [{stage.layer_range[0]}, {stage.layer_range[1]}) "
                                                    "with no KDA layer: it cannot hold state; choose a pp "
                                                    f"that gives every stage a KDA layer (decode tp={decode.tp})"))
    return out


def per_token_descriptors(num_tokens: int, stripe: TokenStripe, block_size: int, decode_block_size: int) -> int:
    """Runs of the stripe's tokens in [0, num_tokens) contiguous on the producer (pages of
    `block_size`) and on the consumer (local pages of `decode_block_size`): descriptors of one layer.

    A token starts a run when the token before it is not the stripe's, or it opens a producer page
    or a destination page. That rule repeats every lcm(block_size, dcp x decode_block_size) tokens,
    so one period is counted and scaled.
    """
    def starts(begin: int, end: int) -> int:
        return sum(1 for p in range(begin, end) if stripe.owns(p) and (
            p == 0 or not stripe.owns(p - 1) or p % block_size == 0
            or stripe.local_offset(p) % decode_block_size == 0))

    period = math.lcm(block_size, stripe.dcp * decode_block_size)
    full, rest = divmod(num_tokens, period)
    return full * starts(0, period) + starts(full * period, full * period + rest)


def _read_plan(model: KimiLinearConfig, prefill: EngineTopology, decode: EngineTopology,
               settings: TransferSettings, stages: tuple[StageLayers, ...], tp_rank: int) -> ReadPlan:
    ratio = decode.tp // prefill.tp
    per_rank, per_segment = model.linear_num_heads // decode.tp, model.linear_num_heads // prefill.tp
    producer = tp_rank // ratio
    heads = (tp_rank * per_rank, (tp_rank + 1) * per_rank)
    local = (heads[0] - producer * per_segment, heads[1] - producer * per_segment)
    dim, full_dim, seg_dim = model.linear_head_dim, model.kda_qkv_dim, per_segment * model.linear_head_dim
    conv = tuple((i * full_dim + heads[0] * dim, i * full_dim + heads[1] * dim) for i in range(3))
    seg_conv = tuple((i * seg_dim + local[0] * dim, i * seg_dim + local[1] * dim) for i in range(3))
    stripe = TokenStripe(decode.dcp, tp_rank % decode.dcp, settings.dcp_interleave)
    num_tokens = stripe.count(settings.prompt_tokens)
    num_mla, num_kda = len(model.mla_layer_ids), len(model.kda_layer_ids)
    state = KDAStateSpec(num_layers=num_kda, num_heads=per_rank, head_k_dim=dim, head_v_dim=dim,
                         conv_dim=3 * per_rank * dim, conv_window=model.short_conv_kernel_size - 1,
                         conv_dtype_bytes=settings.dtype_bytes)
    latent_per_token = num_mla * model.latent_dim * settings.dtype_bytes
    runs = per_token_descriptors(settings.prompt_tokens, stripe, settings.block_size, settings.decode_block_size)
    pages = -(-num_tokens // settings.decode_block_size)
    return ReadPlan(
        tp_rank=tp_rank, dcp_rank=stripe.dcp_rank, dcp_group=tp_rank // decode.dcp, producer_tp_rank=producer,
        kda_heads=heads, segment_heads=local, conv_channels=conv, segment_conv_channels=seg_conv, stripe=stripe,
        reads=tuple(StageRead(s.pp_rank, producer, s.kda_layer_ids, s.mla_layer_ids) for s in stages),
        num_tokens=num_tokens, latent_bytes=num_tokens * latent_per_token, state_bytes=state.bytes_per_image,
        per_token_descriptors=runs * num_mla, staged_descriptors=pages * num_mla,
        state_descriptors=num_kda * (1 + (1 if per_rank == per_segment else 3)),
    )


def plan_topology(model: KimiLinearConfig, prefill: EngineTopology, decode: EngineTopology,
                  settings: TransferSettings | None = None) -> TopologyPlan:
    """The whole check: per-decode-rank ReadPlans and the request's TransferCost, or the refusals."""
    settings = settings or TransferSettings()
    stages = plan_stages(model, prefill, settings)
    refusals = tuple(find_refusals(model, prefill, decode, settings, stages))
    if refusals:
        return TopologyPlan(prefill, decode, settings, stages, (), None, refusals)
    reads = tuple(_read_plan(model, prefill, decode, settings, stages, r) for r in range(decode.tp))
    latent = MLALatentSpec(block_size=settings.decode_block_size, num_layers=len(model.mla_layer_ids),
                           latent_dim=model.latent_dim, dtype_bytes=settings.dtype_bytes)
    cost = TransferCost(
        prompt_tokens=settings.prompt_tokens,
        latent_bytes_per_token=latent.bytes_per_token,
        latent_bytes=sum(r.latent_bytes for r in reads),
        state_bytes=sum(r.state_bytes for r in reads),
        descriptor_bytes=model.latent_dim * settings.dtype_bytes,
        per_token_descriptors=sum(r.per_token_descriptors for r in reads),
        staged_descriptors=sum(r.staged_descriptors for r in reads),
        state_descriptors=sum(r.state_descriptors for r in reads),
        staging_reserve_bytes=max(s.staging_reserve_bytes for s in stages),
    )
    return TopologyPlan(prefill, decode, settings, stages, reads, cost, ())


def _ids(ids: tuple[int, ...]) -> str:
    return " ".join(map(str, ids)) if ids else "none"


def _spans(spans: tuple[Span, ...]) -> str:
    return " ".join(f"{n} [{a}, {b})" for n, (a, b) in zip("qkv", spans, strict=True))


def _first_positions(stripe: TokenStripe, num_tokens: int, shown: int = 4) -> str:
    first = [p for p in range(min(num_tokens, shown * stripe.dcp * stripe.interleave)) if stripe.owns(p)][:shown]
    return ", ".join(map(str, first)) + (", ..." if stripe.count(num_tokens) > shown else "")


def format_plan(plan: TopologyPlan, model_name: str, model: KimiLinearConfig) -> str:
    """The report `deltaserve topology` prints: stages, every decode rank's reads, the request's cost."""
    s = plan.settings
    lines = [f"topology: prefill {plan.prefill} -> decode {plan.decode}; model {model_name}: "
             f"{model.num_hidden_layers} layers ({len(model.kda_layer_ids)} KDA, {len(model.mla_layer_ids)} MLA), "
             f"{model.linear_num_heads} KDA heads x {model.linear_head_dim}, latent {model.latent_dim} values x "
             f"{s.dtype_bytes} B; prefill pages {s.block_size} tokens, decode pages {s.decode_block_size}, "
             f"interleave {s.dcp_interleave}",
             "prefill stages (layer ids are model layer ids):"]
    for st in plan.stages:
        lines.append(f"  pp_rank {st.pp_rank}: layers [{st.layer_range[0]}, {st.layer_range[1]}), "
                     f"KDA {_ids(st.kda_layer_ids)}; MLA {_ids(st.mla_layer_ids)}; "
                     f"staging reserve {st.staging_reserve_bytes:,} B per GPU")
    for r in plan.reads:
        seg = model.linear_num_heads // plan.prefill.tp
        lines += [
            f"decode tp_rank {r.tp_rank} (dcp_rank {r.dcp_rank} of DCP group {r.dcp_group}) "
            f"reads prefill tp_rank {r.producer_tp_rank} of every stage:",
            f"  KDA heads [{r.kda_heads[0]}, {r.kda_heads[1]}) of {model.linear_num_heads} = heads "
            f"[{r.segment_heads[0]}, {r.segment_heads[1]}) of prefill tp_rank {r.producer_tp_rank}'s segment "
            f"[{r.producer_tp_rank * seg}, {(r.producer_tp_rank + 1) * seg})",
            f"  conv channels {_spans(r.conv_channels)} = segment channels {_spans(r.segment_conv_channels)}",
            f"  latent tokens: p with (p // {r.stripe.interleave}) % {r.stripe.dcp} == {r.stripe.dcp_rank}: "
            f"{_first_positions(r.stripe, s.prompt_tokens)} ({r.num_tokens:,} of {s.prompt_tokens:,})",
        ]
        lines += [f"  from (pp_rank {x.pp_rank}, tp_rank {x.tp_rank}): KDA layers {_ids(x.kda_layer_ids)}; "
                  f"MLA layers {_ids(x.mla_layer_ids)}" for x in r.reads]
        lines.append(f"  its share: latent {r.latent_bytes:,} B, KDA state {r.state_bytes:,} B; descriptors "
                     f"{r.per_token_descriptors:,} per-token or {r.staged_descriptors:,} staged (MLA), "
                     f"{r.state_descriptors:,} (KDA state)")
    c = plan.cost
    if c is not None:
        staging = (f"{c.staging_reserve_bytes:,} B per producer GPU ({s.staging_slots} slots x "
                   f"{s.staging_chunk_pages} pages of {s.block_size} tokens x the stage's MLA layers)"
                   if s.staging_chunk_pages else "off (--staging-chunk-pages 0: the per-token path is used)")
        lines += [
            f"per request of {c.prompt_tokens:,} tokens, over every decode rank:",
            f"  latent KV: {c.latent_bytes_per_token:,} B per token ({len(model.mla_layer_ids)} MLA layers x "
            f"{model.latent_dim} values x {s.dtype_bytes} B); {c.latent_bytes:,} B per request "
            f"(each of {plan.decode.tp // plan.decode.dcp} DCP groups of {plan.decode.dcp} ranks reads "
            "every token once)",
            f"  KDA state: 0 B per token (a fixed image); {c.state_bytes:,} B per request "
            f"({len(model.kda_layer_ids)} KDA layers, every head read by one decode rank)",
            f"  descriptors (MLA): {c.per_token_descriptors:,} on the per-token path "
            f"(one token of one layer is {c.descriptor_bytes:,} B); {c.staged_descriptors:,} staged "
            "(one per destination page per MLA layer)",
            f"  descriptors (KDA state): {c.state_descriptors:,}",
            f"  staging reserve: {staging}",
        ]
    lines.append("refusals: none" if plan.ok else "refusals:")
    lines += [f"  [{x.kind}] {x.reason}" for x in plan.refusals]
    return "\n".join(lines)


def run_topology_command(args: argparse.Namespace) -> int:
    """`deltaserve topology`: load the model's config, plan, print; 1 when the pair is refused."""
    from deltaserve.model_files.random_model import RANDOM_PREFIX, random_model_config

    if args.model.startswith(RANDOM_PREFIX):
        model = random_model_config(args.model)
    else:
        model = KimiLinearConfig.from_pretrained(args.model)
    if args.dtype not in DTYPE_BYTES:
        raise ValueError(f"topology: --dtype {args.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    settings = TransferSettings(
        block_size=args.block_size, decode_block_size=args.decode_block_size, dcp_interleave=args.dcp_interleave,
        prompt_tokens=args.prompt_tokens, staging_chunk_pages=args.staging_chunk_pages,
        staging_slots=args.staging_slots, dtype_bytes=DTYPE_BYTES[args.dtype], chunked_transfer=args.chunked_transfer,
    )
    plan = plan_topology(model, parse_topology(args.prefill), parse_topology(args.decode), settings)
    print(format_plan(plan, args.model, model))
    return 0 if plan.ok else 1
