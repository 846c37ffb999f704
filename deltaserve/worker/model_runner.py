"""Turns a SchedulerOutput into flat variable-length tensors, runs the model, samples.

Sequences that decode (one token on top of existing state) are placed first, prefill chunks after,
which is the order the layers' forward context expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.core.scheduler_output import ScheduledChunk, SchedulerOutput
from deltaserve.model.forward_context import ForwardContext, PrefillSequence, set_forward_context
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.sample.sampler import Sampler, SamplingMetadata, step_seed
from deltaserve.sampling_params import SamplingParams
from deltaserve.worker.block_tables import BlockTables
from deltaserve.worker.cuda_graph import DecodeGraphs
from deltaserve.worker.runner_output import ModelRunnerOutput, TokenLogprobs
from deltaserve.worker.state_store import StateCheckpointStore


def is_decode(chunk: ScheduledChunk) -> bool:
    return len(chunk.token_ids) == 1 and chunk.num_computed_tokens > 0


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [T] long
    context: ForwardContext
    sample_rows: torch.Tensor  # [N] long: the row whose logits each sampling request needs
    sample_chunks: list[ScheduledChunk]


class ModelRunner:
    """Owns the model and the per-request sampling parameters the worker has been told about."""

    def __init__(self, model: KimiLinearForCausalLM, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.sampling_params: dict[str, SamplingParams] = {}
        self.state_store: StateCheckpointStore | None = None  # set when prefix caching keeps checkpoints
        self.decode_graphs: DecodeGraphs | None = None  # set when CUDA graphs were captured
        self.block_tables = BlockTables()  # every running request's table, kept across steps

    def prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """Flatten the step. Host-side work only; one transfer per tensor. Call once per step, in
        step order: it takes in the step's new block ids."""
        tables = self.block_tables
        chunks = scheduler_output.chunks
        decodes = [c for c in chunks if is_decode(c)]
        prefills = [c for c in chunks if not is_decode(c)]
        ordered = decodes + prefills
        rows = [tables.apply(c) for c in ordered]
        bs = self.block_size
        token_ids: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        positions = [torch.tensor([c.num_computed_tokens for c in decodes], dtype=torch.long)]
        for chunk in ordered:
            start = len(token_ids)
            token_ids.extend(chunk.token_ids)
            if chunk.sample:
                sample_rows.append(start + len(chunk.token_ids) - 1)
                sample_chunks.append(chunk)
        positions += [torch.arange(c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids)) for c in prefills]
        token_positions = torch.cat(positions)
        counts = torch.tensor([len(c.token_ids) for c in ordered], dtype=torch.long)
        token_rows = torch.tensor(rows, dtype=torch.long).repeat_interleave(counts)
        slot_mapping = tables.table[token_rows, token_positions // bs] * bs + token_positions % bs

        dev = self.device
        prefill_sequences: list[PrefillSequence] = []
        cu = [0]
        start = len(decodes)
        for chunk, row in zip(prefills, rows[len(decodes):], strict=True):
            n = len(chunk.token_ids)
            cu.append(cu[-1] + n)
            needed = -(-(chunk.num_computed_tokens + n) // bs)
            prefill_sequences.append(
                PrefillSequence(start, n, chunk.num_computed_tokens, tables.table[row, :needed].to(dev))
            )
            start += n
        decode_rows = rows[: len(decodes)]
        max_blocks = max((tables.lengths[r] for r in decode_rows), default=1)
        decode_tables = tables.table[decode_rows, :max_blocks] if decode_rows else torch.zeros(0, 1, dtype=torch.long)

        def to_dev(values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev)

        cu_seqlens = torch.tensor(cu, dtype=torch.long)
        ctx = ForwardContext(
            num_tokens=len(token_ids),
            num_decodes=len(decodes),
            slot_mapping=slot_mapping.to(dev),
            decode_state_slots=to_dev([c.state_slot for c in decodes]),
            decode_block_tables=decode_tables.to(dev),
            decode_seq_lens=to_dev([c.num_computed_tokens + 1 for c in decodes]),
            prefill_cu_seqlens=cu_seqlens.to(dev),
            prefill_state_slots=to_dev([c.state_slot for c in prefills]),
            prefill_has_initial_state=to_dev([c.num_computed_tokens > 0 for c in prefills], torch.bool),
            prefill_sequences=tuple(prefill_sequences),
            prefill_cu_seqlens_cpu=cu_seqlens,
        )
        return PreparedStep(to_dev(token_ids), ctx, to_dev(sample_rows), sample_chunks)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for new in scheduler_output.new_requests:
            self.sampling_params[new.request_id] = new.sampling_params
        for request_id in scheduler_output.finished_request_ids:
            self.sampling_params.pop(request_id, None)
        # finished requests are gone; preempted ones start a new table in their next life
        self.block_tables.drop(scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids)
        if self.state_store is not None:
            self.state_store.before_forward(scheduler_output)
        if not scheduler_output.chunks:
            return ModelRunnerOutput()

        step = self.prepare(scheduler_output)
        ctx = step.context
        graphs = self.decode_graphs
        if graphs is not None and ctx.num_prefills == 0 and graphs.graph_size(ctx.num_decodes) is not None:
            logits = graphs.run(step.input_ids, ctx)[step.sample_rows]  # every decode samples
        else:
            with set_forward_context(ctx):
                hidden = self.model(step.input_ids)
            logits = self.model.compute_logits(hidden[step.sample_rows]) if step.sample_chunks else None
        if self.state_store is not None:
            self.state_store.after_forward(scheduler_output)
        if not step.sample_chunks:
            return ModelRunnerOutput()
        params = [self.sampling_params[c.request_id] for c in step.sample_chunks]
        seeds = [
            None if p.seed is None else step_seed(p.seed, c.num_output_tokens)
            for p, c in zip(params, step.sample_chunks, strict=True)
        ]
        metadata = SamplingMetadata.from_params(params, seeds, logits.device)
        sampled = self.sampler(logits, metadata)
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if sampled.logprobs is None:
            token_ids = sampled.sampled_token_ids.tolist()  # the step's one host sync
        else:  # ids, ranks and logprob ids in one transfer, the values in a second
            ints = torch.cat([sampled.sampled_token_ids.view(-1, 1), sampled.sampled_token_ranks.view(-1, 1),
                              sampled.logprob_token_ids], dim=1).tolist()
            values = sampled.logprobs.tolist()
            token_ids = [row[0] for row in ints]
            ranks = [row[1] for row in ints]
            ids = [row[2:] for row in ints]
            for row, p in enumerate(params):
                if p.logprobs is not None:
                    k = 1 + p.logprobs
                    logprobs[row] = TokenLogprobs(ids[row][:k], values[row][:k], ranks[row])
        return ModelRunnerOutput([c.request_id for c in step.sample_chunks], token_ids, logprobs)
