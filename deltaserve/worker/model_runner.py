"""Turns a SchedulerOutput into flat variable-length tensors, runs the model, samples.

Sequences that decode (one token on top of existing state) are placed first, prefill chunks after,
which is the order the layers' forward context expects.

On a GPU a step does not wait for the device, so the host can run ahead of it (async scheduling):
the step's integers cross in one pinned non-blocking copy, block tables are gathered from a device
mirror (block_tables.py), a decode token the scheduler does not know yet (PLACEHOLDER_TOKEN_ID) is
filled in on the device from the id this runner sampled for the request in its previous step, and
with `non_block` the sampled ids come back by a non-blocking copy that `get_output()` waits for.

Chunks of requests with prompt_logprobs also get logits at the prompt rows the scheduler named
(`worker/prompt_logprobs.py`); they come back with the sampled ids, by the same copy.

Under pipeline parallelism every stage's runner prepares the same step (block tables, state slots and
checkpoint copies are per stage, under the same ids); a later stage takes the previous stage's residual
stream instead of token ids, a stage before the last sends its stream on and samples nothing. Only the
last stage samples, so under PP the scheduler never sends a placeholder (a decode waits for its token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.core.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledChunk, SchedulerOutput
from deltaserve.distributed import recv_tensors, send_tensors
from deltaserve.distributed.dcp_layout import DCPLayout
from deltaserve.model.forward_context import ForwardContext, PrefillSequence, set_forward_context
from deltaserve.model.kimi_linear import IntermediateTensors, KimiLinearForCausalLM
from deltaserve.sample.sampler import Sampler, SamplerOutput, SamplingMetadata, step_seed
from deltaserve.sampling_params import SamplingParams
from deltaserve.spec.rejection_sampler import RejectionOutput
from deltaserve.worker.block_tables import BlockTables
from deltaserve.worker.cuda_graph import DecodeGraphs
from deltaserve.worker.host_transfer import to_device
from deltaserve.worker.prompt_logprobs import PromptLogprobPlan, prompt_logprob_tensors
from deltaserve.worker.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput, TokenLogprobs
from deltaserve.worker.spec_verify import DraftVerifier, verified_tokens, verify_context, verify_host_arrays
from deltaserve.worker.state_store import StateCheckpointStore
from deltaserve.worker.verify_graph import VerifyGraphs


def is_decode(chunk: ScheduledChunk) -> bool:
    return len(chunk.token_ids) == 1 and chunk.num_computed_tokens > 0


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [T] long
    context: ForwardContext
    sample_rows: torch.Tensor  # [N] long: the row whose logits each sampling request needs
    sample_table_rows: torch.Tensor  # [N] long: each sampling request's block-table row
    sample_chunks: list[ScheduledChunk]
    prompt_plan: PromptLogprobPlan  # the rows whose prompt logprobs are asked for, host side
    prompt_rows: torch.Tensor  # [R] long: their flat rows
    prompt_targets: torch.Tensor  # [R] long: the prompt token each row gives the logprob of
    verify_chunks: list[ScheduledChunk]  # speculative decoding's verify windows, in row order
    verify_rows: torch.Tensor  # [sum of their lengths] long: their rows


@dataclass
class StepResult:
    """What a step queued on the device for the host: the sampling of the chunks that sample, and the
    prompt logprobs ([R, 2 + k] ints, [R, 1 + k] values) of the plan's rows."""

    sample_chunks: list[ScheduledChunk]
    params: list[SamplingParams]
    sampled: SamplerOutput | None
    prompt_plan: PromptLogprobPlan
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor] | None
    verify_chunks: list[ScheduledChunk] = field(default_factory=list)
    verified: RejectionOutput | None = None  # the verify windows' accepted tokens


class ModelRunner:
    """Owns the model, the per-request sampling parameters the worker has been told about, every
    running request's block table and, on the device, the id each request sampled last."""

    def __init__(self, model: KimiLinearForCausalLM, block_size: int, device: torch.device,
                 dcp: DCPLayout | None = None) -> None:
        """block_size: tokens per scheduler block (under DCP, block_size x dcp.size: the local page
        holds dcp.block_size of them); dcp: this rank's stripe under decode context parallelism."""
        self.model = model
        self.block_size = block_size
        self.dcp = dcp
        self.dcp_pad_slot = 0  # under DCP, where other ranks' tokens are written: set by the worker
        self.device = device
        self.sampler = Sampler()
        self.verifier = DraftVerifier()
        self.sampling_params: dict[str, SamplingParams] = {}
        self.state_store: StateCheckpointStore | None = None  # set when prefix caching keeps checkpoints
        self.offload: Any = None  # the offload tier's rank side (offload/worker_side.py), when it is on
        self.decode_graphs: DecodeGraphs | None = None  # set when CUDA graphs were captured
        self.verify_graphs: VerifyGraphs | None = None  # speculative decoding's, when captured
        self.drafter: Any = None  # speculative decoding's model drafter (spec/), on the output rank
        self.step_rows: dict[str, int] = {}
        self.block_tables = BlockTables(device=device)  # every running request's table, kept across steps
        # [rows] long on the device, by block-table row: the token the row's request sampled last;
        # valid for the requests in _has_sampled (a dropped row's value is stale)
        self.last_sampled = torch.zeros(self.block_tables.num_rows, dtype=torch.long, device=device)
        self._has_sampled: set[str] = set()

    @torch.inference_mode()
    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """Flatten the step into device tensors without waiting for the device. The host sends the
        token ids and a few numbers per chunk; per-token positions and slots are expanded on the
        device. Call once per step, in step order: it takes in the step's new block ids, and its
        placeholders read the ids the previous step sampled."""
        tables = self.block_tables
        decodes = [c for c in scheduler_output.chunks if is_decode(c)]
        verifies = [c for c in scheduler_output.chunks if c.is_verify]
        prefills = [c for c in scheduler_output.chunks if not (is_decode(c) or c.is_verify)]
        rows = [tables.apply(c) for c in decodes + verifies + prefills]
        self.step_rows, start = {}, 0  # each chunk's first flat row (an Eagle3 drafter reads its taps)
        for chunk in decodes + verifies + prefills:
            self.step_rows[chunk.request_id] = start
            start += chunk.num_tokens
        self._grow_last_sampled()
        host, sample_chunks, prompt_plan = self._host_arrays(decodes, verifies, prefills, rows)
        dev = to_device(self.device, host)

        tables.write_pending(dev["new_block_index"], dev["new_block_ids"])  # before any gather below
        input_ids = dev["input_ids"]
        if host["placeholder_at"]:
            filled = self.last_sampled.index_select(0, dev["placeholder_rows"])
            input_ids.index_copy_(0, dev["placeholder_at"], filled)
        num_tokens, nd, bs = len(host["input_ids"]), len(decodes), self.block_size
        # [T] each token's chunk; output_size keeps repeat_interleave from reading the total back
        chunk_of_token = torch.repeat_interleave(dev["chunk_lens"], output_size=num_tokens)
        positions = torch.arange(num_tokens, device=self.device) + dev["position_offsets"][chunk_of_token]
        prefill_sequences: list[PrefillSequence] = []
        start = nd + sum(c.num_tokens for c in verifies)
        for chunk, row in zip(prefills, rows[nd + len(verifies):], strict=True):
            n = chunk.num_tokens
            needed = -(-(chunk.num_computed_tokens + n) // bs)
            prefill_sequences.append(PrefillSequence(start, n, chunk.num_computed_tokens, tables.blocks(row, needed)))
            start += n
        # MLA decodes the verify windows' tokens too, one row each (the decode rows, then every window token)
        max_blocks = max((tables.lengths[r] for r in rows[: nd + len(verifies)]), default=1)
        ctx = ForwardContext(
            num_tokens=num_tokens,
            num_decodes=nd,
            slot_mapping=self._slot_mapping(dev["chunk_rows"][chunk_of_token], positions),
            decode_state_slots=dev["decode_state_slots"],
            decode_block_tables=tables.gather(dev["mla_decode_rows"], max_blocks),
            decode_seq_lens=dev["decode_seq_lens"],
            prefill_cu_seqlens=dev["prefill_cu_seqlens"],
            prefill_state_slots=dev["prefill_state_slots"],
            prefill_has_initial_state=dev["prefill_has_initial_state"].bool(),
            prefill_sequences=tuple(prefill_sequences),
            prefill_cu_seqlens_cpu=torch.tensor(host["prefill_cu_seqlens"], dtype=torch.long),
            dcp=self.dcp,
            prefill_captures=(tuple(tuple((offset, c.state_slot, units) for offset, units in c.state_captures)
                                    for c in prefills) if any(c.state_captures for c in prefills) else ()),
            **verify_context(verifies, dev),
        )
        return PreparedStep(input_ids, ctx, dev["sample_rows"], dev["sample_table_rows"], sample_chunks,
                            prompt_plan, dev["prompt_rows"], dev["prompt_targets"], verifies, dev["verify_rows"])

    def _slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows, positions: [T] long on the device -> [T] long, each token's KV slot on this rank (under
        DCP: in its stripe, or the scratch slot for another rank's token)."""
        if self.dcp is None:
            return self.block_tables.slot_mapping(rows, positions, self.block_size)
        block_ids = self.block_tables.device_table[rows, positions // self.block_size]
        return self.dcp.slot_mapping(block_ids, positions, self.dcp_pad_slot)

    def _host_arrays(self, decodes: list[ScheduledChunk], verifies: list[ScheduledChunk],
                     prefills: list[ScheduledChunk], rows: list[int],
                     ) -> tuple[dict[str, list[int]], list[ScheduledChunk], PromptLogprobPlan]:
        """The step's integers, for one transfer: token ids [T] (placeholders left in), per chunk its
        length, table row and position offset [C], per-sequence metadata, where the placeholders,
        sampled rows, verify rows and prompt-logprob rows are, and the block ids new to the tables. Also
        the chunks that sample plainly (verify windows apart), in order, and the prompt-logprob plan."""
        host: dict[str, list[int]] = {name: [] for name in (
            "input_ids", "chunk_lens", "position_offsets", "sample_rows", "sample_table_rows",
            "placeholder_at", "placeholder_rows", "verify_rows")}
        host["chunk_rows"] = rows  # decodes first: its first D entries are the decode rows
        sample_chunks: list[ScheduledChunk] = []
        prompt_plan = PromptLogprobPlan()
        for chunk, row in zip(decodes + verifies + prefills, rows, strict=True):
            start, n = len(host["input_ids"]), chunk.num_tokens
            host["input_ids"].extend(chunk.token_ids)
            host["chunk_lens"].append(n)
            host["position_offsets"].append(chunk.num_computed_tokens - start)  # position - flat index
            if chunk.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                if chunk.request_id not in self._has_sampled:
                    raise RuntimeError(
                        f"{chunk.request_id}: its chunk ends with PLACEHOLDER_TOKEN_ID, the token sampled in "
                        "its previous step, but this worker has sampled no token for it since it was last "
                        "(re)admitted; the scheduler may send a placeholder only after a step that sampled "
                        "for the request"
                    )
                host["placeholder_at"].append(start + n - 1)
                host["placeholder_rows"].append(row)
            if chunk.is_verify:  # every row: its logits verify the drafts, the last gives the bonus token
                host["verify_rows"].extend(range(start, start + n))
            elif chunk.sample:
                host["sample_rows"].append(start + n - 1)
                host["sample_table_rows"].append(row)
                sample_chunks.append(chunk)
            if chunk.prompt_logprob_targets is not None:
                k = self.sampling_params[chunk.request_id].prompt_logprobs or 0
                prompt_plan.add(chunk.request_id, chunk.num_computed_tokens, start, chunk.prompt_logprob_targets, k)
        host["prompt_rows"], host["prompt_targets"] = prompt_plan.rows, prompt_plan.targets
        cu = [0]
        for chunk in prefills:
            cu.append(cu[-1] + chunk.num_tokens)
        host["new_block_index"], host["new_block_ids"] = self.block_tables.pending()
        host["decode_state_slots"] = [c.state_slot for c in decodes]
        host["decode_seq_lens"] = [c.num_computed_tokens + 1 for c in decodes]
        host["mla_decode_rows"] = rows[: len(decodes)]
        for chunk, row in zip(verifies, rows[len(decodes):], strict=False):  # a window token: its own length
            first = chunk.num_computed_tokens + 1
            host["decode_seq_lens"] += range(first, first + chunk.num_tokens)
            host["mla_decode_rows"] += [row] * chunk.num_tokens
        host["prefill_cu_seqlens"] = cu
        host["prefill_state_slots"] = [c.state_slot for c in prefills]
        host["prefill_has_initial_state"] = [int(c.num_computed_tokens > 0) for c in prefills]
        host.update(verify_host_arrays(verifies))
        return host, sample_chunks, prompt_plan

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput,
                non_block: bool = False) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Run one step. With non_block, return an AsyncModelRunnerOutput once the step is queued: on a
        GPU its sampled ids come to the host by a non-blocking copy that `get_output()` waits for, and
        the runner itself never waits for the device (the state store's saves and loads do, and so may
        model kernels: fla's chunked KDA prefill); on the CPU it is ready."""
        # finished before this step: an id may come back as a new request in the same step
        for request_id in scheduler_output.finished_request_ids:
            self.sampling_params.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.sampling_params[new.request_id] = new.sampling_params
        # finished requests are gone; preempted ones start a new table in their next life
        dropped = scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids
        self.block_tables.drop(dropped)
        self._has_sampled.difference_update(dropped)
        self._copy_states(scheduler_output)
        if self.state_store is not None:
            offload = self.offload
            between = None if offload is None else lambda: offload.before_forward(scheduler_output.offload_metadata)
            self.state_store.before_forward(scheduler_output, between)
        result = self._forward_and_sample(scheduler_output) if scheduler_output.chunks else None
        if result is None:
            output = self._with_drafts(scheduler_output, ModelRunnerOutput())
            return AsyncModelRunnerOutput.ready(output) if non_block else output
        tensors = _output_tensors(result)
        if self.drafter is not None:  # the drafter needs this step's tokens on the host now
            output = _runner_output(result, {name: t.tolist() for name, t in tensors.items()})
            output = self._with_drafts(scheduler_output, output)
            return AsyncModelRunnerOutput.ready(output) if non_block else output
        if not (non_block and self.device.type == "cuda"):
            output = _runner_output(result, {name: t.tolist() for name, t in tensors.items()})  # the host sync
            return AsyncModelRunnerOutput.ready(output) if non_block else output
        return AsyncModelRunnerOutput(_copy_to_host(result, tensors))

    def _with_drafts(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """The output with the model drafter's proposals for the requests it sampled (if there is one)."""
        if self.drafter is None:
            return output
        drafts = self.drafter.propose(scheduler_output, output, self)
        return dataclasses.replace(output, draft_token_ids=drafts)

    def _copy_states(self, scheduler_output: SchedulerOutput) -> None:
        """Speculative decoding's rollbacks, before anything else reads a slot: the state a verify
        window accepted, from its spare slot into the live one (and into the boundary slot)."""
        copies = scheduler_output.state_copies_before
        if copies:
            copy_slots(self.model, [c.src_slot for c in copies], [c.dst_slot for c in copies])

    def _after_forward_state(self, scheduler_output: SchedulerOutput) -> None:
        """The step's checkpoint saves and copies after the forward, then the offload tier's saves of them."""
        if self.state_store is not None:
            self.state_store.after_forward(scheduler_output)
        if self.offload is not None:
            self.offload.after_forward(scheduler_output.offload_metadata)

    def _forward_and_sample(self, scheduler_output: SchedulerOutput) -> StepResult | None:
        """Queue the step's forward, sampling and prompt logprobs; None when no chunk samples or
        computes prompt logprobs."""
        step = self.prepare(scheduler_output)
        ctx = step.context
        graphs = next((g for g in (self.decode_graphs, self.verify_graphs)
                       if g is not None and g.size_for(ctx) is not None), None)
        if graphs is not None:
            rows, to_logits = graphs.run(step.input_ids, ctx), torch.Tensor.float  # every row's logits
            logits = rows[step.sample_rows]
        else:
            with set_forward_context(ctx):
                rows = self._stage_forward(step.input_ids)
            if rows is None:  # a stage before the last: its stream went on to the next stage
                self._after_forward_state(scheduler_output)
                return None
            to_logits = self.model.compute_logits
            logits = to_logits(rows[step.sample_rows]) if step.sample_chunks else None
        prompt = None
        if step.prompt_plan.request_ids:
            prompt = prompt_logprob_tensors(rows[step.prompt_rows], to_logits, step.prompt_targets,
                                            step.prompt_plan.max_num_logprobs)
        self._after_forward_state(scheduler_output)
        verified = None
        if step.verify_chunks:
            verified = self.verifier(step.verify_chunks, to_logits(rows[step.verify_rows]),
                                     [self.sampling_params[c.request_id] for c in step.verify_chunks])
        if not step.sample_chunks:
            if prompt is None and verified is None:
                return None
            return StepResult([], [], None, step.prompt_plan, prompt, step.verify_chunks, verified)
        params = [self.sampling_params[c.request_id] for c in step.sample_chunks]
        seeds = [
            None if p.seed is None else step_seed(p.seed, c.num_output_tokens)
            for p, c in zip(params, step.sample_chunks, strict=True)
        ]
        metadata = SamplingMetadata.from_params(params, seeds, logits.device)
        sampled = self.sampler(logits, metadata)
        # the next step's placeholders for these requests read their ids from here, on the device
        self.last_sampled.index_copy_(0, step.sample_table_rows, sampled.sampled_token_ids)
        self._has_sampled.update(c.request_id for c in step.sample_chunks)
        return StepResult(step.sample_chunks, params, sampled, step.prompt_plan, prompt, step.verify_chunks, verified)

    def _stage_forward(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """This stage's forward (inside the step's forward context): token ids [T] (first stage) or the
        previous stage's stream -> the last stage's hidden rows [T, hidden_size]; a stage before the last
        sends its stream ([T, hidden_size] twice) to the same TP rank of the next stage and returns None.
        Every stage runs every step, in step order, so each send meets its receive."""
        parallel = self.model.parallel
        if parallel.pipeline_parallel_size == 1:
            return self.model(input_ids)
        if parallel.is_first_stage:
            out = self.model(input_ids)
        else:
            out = self.model(intermediate=IntermediateTensors.from_dict(recv_tensors(device=self.device)))
        if isinstance(out, IntermediateTensors):
            send_tensors(out.to_dict())
            return None
        return out

    def _grow_last_sampled(self) -> None:
        """Give last_sampled a slot for every block-table row (rows grow as requests arrive)."""
        have, rows = self.last_sampled.shape[0], self.block_tables.num_rows
        if rows > have:
            grown = self.last_sampled.new_zeros(rows)
            grown[:have] = self.last_sampled
            self.last_sampled = grown


def copy_slots(model: KimiLinearForCausalLM, src: list[int], dst: list[int]) -> None:
    """Every KDA layer's conv window and recurrent state from slots `src` into slots `dst`, all sources read
    before any destination is written (two kernels a pool, whatever the number of copies)."""
    layers = model.kda_layers()
    if not layers:
        return
    index = to_device(layers[0].recurrent_state.device, {"src": src, "dst": dst})
    src_index, dst_index = index["src"], index["dst"]
    for layer in layers:
        for pool in (layer.conv_state, layer.recurrent_state):
            pool.index_copy_(0, dst_index, pool.index_select(0, src_index))


def _output_tensors(result: StepResult) -> dict[str, torch.Tensor]:
    """What the host needs of a step: the sampled ids [N, 1]; with logprobs, the ids, ranks and
    logprob ids together [N, 2 + k] (one transfer) and the logprob values [N, 1 + k]; with prompt
    logprobs, their ints [R, 2 + k'] and values [R, 1 + k']."""
    tensors = {}
    sampled = result.sampled
    if sampled is not None:
        ids = sampled.sampled_token_ids.view(-1, 1)
        if sampled.logprobs is None:
            tensors["sampled"] = ids
        else:
            ranks = sampled.sampled_token_ranks.view(-1, 1)
            tensors["sampled"] = torch.cat([ids, ranks, sampled.logprob_token_ids], dim=1)
            tensors["logprobs"] = sampled.logprobs
    if result.prompt_logprobs is not None:
        tensors["prompt_ints"], tensors["prompt_values"] = result.prompt_logprobs
    if result.verified is not None:  # [V, K + 2]: the window's tokens, then how many are valid
        tensors["verified"] = torch.cat([result.verified.token_ids, result.verified.num_tokens.view(-1, 1)], dim=1)
    return tensors


def _copy_to_host(result: StepResult, tensors: dict[str, torch.Tensor]) -> Callable[[], ModelRunnerOutput]:
    """Queue non-blocking copies of `tensors` (on a GPU) into pinned host memory; returns what waits
    for them (an event recorded behind the copies, so not for later steps) and builds the output."""
    host = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for name, t in tensors.items()}
    copied = torch.cuda.Event()
    copied.record()

    def resolve() -> ModelRunnerOutput:
        copied.synchronize()
        return _runner_output(result, {name: t.tolist() for name, t in host.items()})

    return resolve


def _runner_output(result: StepResult, host: dict[str, list]) -> ModelRunnerOutput:
    """The step's output from the host copies of `_output_tensors` (as lists): per sampled row,
    "sampled" holds [sampled id] or [sampled id, rank, logprob ids...] and "logprobs" the values."""
    ints = host.get("sampled", [])
    values = host.get("logprobs")
    logprobs: list[TokenLogprobs | None] = [None] * len(result.params)
    if values is not None:
        for row, p in enumerate(result.params):
            if p.logprobs is not None:
                k = 1 + p.logprobs
                logprobs[row] = TokenLogprobs(ints[row][2 : 2 + k], values[row][:k], ints[row][1])
    prompt = {}
    if "prompt_ints" in host:
        prompt = result.prompt_plan.outputs(host["prompt_ints"], host["prompt_values"])
    request_ids, sampled = [c.request_id for c in result.sample_chunks], [row[0] for row in ints]
    extra = {}
    if "verified" in host:  # a window's first token goes with the plain samples, the rest apart
        for request_id, tokens in verified_tokens(result.verify_chunks, host["verified"]).items():
            request_ids.append(request_id)
            sampled.append(tokens[0])
            logprobs.append(None)
            if len(tokens) > 1:
                extra[request_id] = tokens[1:]
    return ModelRunnerOutput(request_ids, sampled, logprobs, prompt, extra_token_ids=extra)
