"""The draft-model drafter (vLLM's "draft_model" method): a smaller Kimi Linear proposes k tokens per request.

It runs on the output rank (the last stage's first TP rank) right after the target's step is sampled, as
one model on one rank (its layers see no process groups), with caches of its own:
- MLA latents under the target's block ids, so a request's block table serves both (the scheduler
  allocates k tokens of lookahead for the drafted positions);
- KDA state in its own pool: the request's live slot id holds the drafter's state after every token it has
  processed, and a scratch row per drafting request (past the scheduler's slot ids) holds the state while
  it drafts, so drafted tokens never reach the live state and a rejected draft needs no rollback.

Per step, for each request the target sampled for, the drafter first catches up on the tokens it has not
seen (the verified and sampled tokens of this step, or the whole prompt of a request new to it: its state
is not checkpointed, so a prefix hit or a P/D import is recomputed here, at most `max_catchup_tokens`
per request and step, drafting only once caught up), then decodes greedily in the scratch row: the
argmax after the last known token is draft 1, and each draft is fed back for the next. Drafts are point
masses (as vLLM's), which the rejection sampler verifies losslessly.
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.distributed.parallel_state import without_groups
from deltaserve.model.forward_context import ForwardContext, PrefillSequence, set_forward_context
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.spec.known_tokens import KnownTokens
from deltaserve.worker.block_tables import BlockTables
from deltaserve.worker.model_runner import copy_slots
from deltaserve.worker.runner_output import ModelRunnerOutput


class DraftModelRunner:
    def __init__(self, model: KimiLinearForCausalLM, k: int, block_size: int, num_blocks: int,
                 num_state_slots: int, max_num_seqs: int, max_model_len: int, max_catchup_tokens: int,
                 device: torch.device) -> None:
        """num_blocks / num_state_slots: the target's ids (blocks and live slots are shared by id); the
        pool gets max_num_seqs scratch rows past them."""
        self.model = model
        self.k = k
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_catchup_tokens = max_catchup_tokens
        self.device = device
        self.scratch_base = num_state_slots
        config, dtype = model.config, model.dtype
        with torch.device(device):
            for layer in model.mla_layers():
                layer.bind_cache(torch.zeros(num_blocks + 1, block_size, config.latent_dim, dtype=dtype))
            rows = num_state_slots + max_num_seqs
            for layer in model.kda_layers():
                layer.bind_state(
                    torch.zeros(rows, 3 * layer.local_dim, layer.conv_width - 1, dtype=dtype),
                    torch.zeros(rows, layer.num_heads, layer.head_dim, layer.head_dim, dtype=torch.float32))
        self.known = KnownTokens()
        self.progress: dict[str, int] = {}  # tokens the drafter has run, in the live slot

    @torch.inference_mode()
    def propose(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput,
                runner: Any) -> dict[str, list[int]]:
        """After the target's step: the drafts of every request it sampled for (none for one still
        catching up). `runner`: the model runner, whose block tables have this step's blocks applied."""
        self.known.note_step(scheduler_output)
        for request_id in scheduler_output.finished_request_ids + scheduler_output.preempted_request_ids:
            self.progress.pop(request_id, None)  # a new life: a new slot, recomputed from the start
        for new in scheduler_output.new_requests:
            self.progress.pop(new.request_id, None)
        self.known.note_output(output)
        slots = {chunk.request_id: chunk.state_slot for chunk in scheduler_output.chunks}
        sampled = [r for r in output.request_ids if r in slots]
        if not sampled:
            return {}
        with without_groups():
            first = self._catch_up(sampled, slots, runner.block_tables)
            return self._draft(first, slots, runner.block_tables)

    def _catch_up(self, request_ids: list[str], slots: dict[str, int], tables: BlockTables) -> dict[str, int]:
        """Run each request's unseen tokens from its live state (a prefill chunk each, up to
        max_catchup_tokens); returns the argmax after the last known token of those caught up."""
        chunks = []  # (request id, start, tokens)
        for request_id in request_ids:
            known, start = self.known[request_id], self.progress.get(request_id, 0)
            end = min(len(known), start + self.max_catchup_tokens)
            chunks.append((request_id, start, known[start:end]))
            self.progress[request_id] = end
        rows = [tables.row(r) for r, _, _ in chunks]
        ids, row_of_token, positions, sequences, cu = [], [], [], [], [0]
        for (_, start, tokens), row in zip(chunks, rows, strict=True):
            sequences.append(PrefillSequence(len(ids), len(tokens), start,
                                             tables.blocks(row, -(-(start + len(tokens)) // self.block_size))))
            ids += tokens
            row_of_token += [row] * len(tokens)
            positions += range(start, start + len(tokens))
            cu.append(len(ids))
        long = {"dtype": torch.long, "device": self.device}
        empty = torch.zeros(0, **long)
        ctx = ForwardContext(
            num_tokens=len(ids), num_decodes=0,
            slot_mapping=tables.slot_mapping(torch.tensor(row_of_token, **long), torch.tensor(positions, **long),
                                             self.block_size),
            decode_state_slots=empty, decode_block_tables=torch.zeros(0, 1, **long), decode_seq_lens=empty,
            prefill_cu_seqlens=torch.tensor(cu, **long),
            prefill_state_slots=torch.tensor([slots[r] for r, _, _ in chunks], **long),
            prefill_has_initial_state=torch.tensor([start > 0 for _, start, _ in chunks], device=self.device),
            prefill_sequences=tuple(sequences), prefill_cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long),
        )
        with set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids, **long))
        last = torch.tensor([c - 1 for c in cu[1:]], **long)
        argmax = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        return {r: token for (r, _, _), token in zip(chunks, argmax, strict=True)
                if self.progress[r] == len(self.known[r])}

    def _draft(self, first: dict[str, int], slots: dict[str, int], tables: BlockTables) -> dict[str, list[int]]:
        """From each caught-up request's first draft, decode greedily in a scratch row for the rest."""
        counts = {r: min(self.k, self.max_model_len - len(self.known[r])) for r in first}
        drafts = {r: [token] for r, token in first.items() if counts[r] >= 1}
        order = [r for r in drafts if counts[r] > 1]
        scratch = {r: self.scratch_base + i for i, r in enumerate(order)}
        if order:
            copy_slots(self.model, [slots[r] for r in order], [scratch[r] for r in order])
        long = {"dtype": torch.long, "device": self.device}
        for step in range(1, self.k):
            active = [r for r in order if counts[r] > step]
            if not active:
                break
            rows = torch.tensor([tables.row(r) for r in active], **long)
            positions = torch.tensor([len(self.known[r]) + step - 1 for r in active], **long)
            width = max(tables.num_blocks(r) for r in active)
            ctx = ForwardContext(
                num_tokens=len(active), num_decodes=len(active),
                slot_mapping=tables.slot_mapping(rows, positions, self.block_size),
                decode_state_slots=torch.tensor([scratch[r] for r in active], **long),
                decode_block_tables=tables.gather(rows, width), decode_seq_lens=positions + 1,
                prefill_cu_seqlens=torch.zeros(1, **long), prefill_state_slots=torch.zeros(0, **long),
                prefill_has_initial_state=torch.zeros(0, dtype=torch.bool, device=self.device),
                prefill_sequences=(),
            )
            with set_forward_context(ctx):
                hidden = self.model(torch.tensor([drafts[r][-1] for r in active], **long))
            for r, token in zip(active, self.model.compute_logits(hidden).argmax(dim=-1).tolist(), strict=True):
                drafts[r].append(token)
        return drafts
