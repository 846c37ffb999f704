"""The draft-model drafter (vLLM's "draft_model" method): a smaller Kimi Linear proposes k tokens per request.

It runs on the output rank (the last stage's first TP rank) right after the target's step is sampled, as
one model on one rank (its layers see no process groups), with caches of its own:
- MLA latents under the target's block ids, so a request's block table serves both (the scheduler
  allocates k tokens of lookahead for the drafted positions);
- KDA state in its own pool: the request's live slot id holds the drafter's state after every token it has
  processed, and a scratch row per drafting request (past the scheduler's slot ids) holds the state while
  it drafts, so drafted tokens never reach the live state and a rejected draft needs no rollback.

Per step, for each request the target sampled for, the drafter first catches up on the tokens it has not
seen (the verified and sampled tokens of this step, at most k + 1, as that many decode steps; or the whole
prompt of a request new to it, as a prefill chunk: its state is not checkpointed, so a prefix hit or a
P/D import is recomputed here, at most `max_catchup_tokens` per request and step, drafting only once
caught up), then decodes greedily in the scratch row: the argmax after the last known token is draft 1,
and each draft is fed back for the next. Decode steps replay CUDA graphs where they were captured, and
the drafts stay on the device until the last one (one host sync per step). Drafts are point masses (as
vLLM's), which the rejection sampler verifies losslessly.
"""

from __future__ import annotations

from typing import Any

import torch

from deltaserve.core.scheduler_output import SchedulerOutput
from deltaserve.distributed.parallel_state import without_groups
from deltaserve.model.forward_context import ForwardContext, PrefillSequence, no_prefill_fields, set_forward_context
from deltaserve.model.kimi_linear import KimiLinearForCausalLM
from deltaserve.spec.known_tokens import KnownTokens
from deltaserve.worker.block_tables import BlockTables
from deltaserve.worker.cuda_graph import DecodeGraphs
from deltaserve.worker.host_transfer import to_device
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
        # CUDA-graph padding: the block past the target's ids and the row past the scratch rows
        self.pad_block, self.pad_state_slot = num_blocks, num_state_slots + max_num_seqs
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs
        config, dtype = model.config, model.dtype
        with torch.device(device):
            for layer in model.mla_layers():
                layer.bind_cache(torch.zeros(num_blocks + 1, block_size, config.latent_dim, dtype=dtype))
            rows = num_state_slots + max_num_seqs + 1
            for layer in model.kda_layers():
                layer.bind_state(
                    torch.zeros(rows, 3 * layer.local_dim, layer.conv_width - 1, dtype=dtype),
                    torch.zeros(rows, layer.num_heads, layer.head_dim, layer.head_dim, dtype=torch.float32))
        self.known = KnownTokens()
        self.progress: dict[str, int] = {}  # tokens the drafter has run, in the live slot

    @torch.inference_mode()
    def capture_graphs(self, sizes: list[int]) -> bool:
        """CUDA graphs of the draft model's decode steps (catching up on a few tokens and drafting); its
        padding writes the extra KV block and state row past everything the pools share with the target."""
        graphs = DecodeGraphs(self.model, self.device, self.block_size, self.max_model_len, self.pad_block,
                              self.pad_state_slot)
        with without_groups():
            if graphs.capture(sizes):
                self.graphs = graphs
        return self.graphs is not None

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
        tables = runner.block_tables
        # a few unseen tokens (a verify window's accepted run, a sampled token) run as decode steps; a
        # prompt or any longer run as a prefill chunk
        short = [r for r in sampled
                 if 0 < self.progress.get(r, 0) and len(self.known[r]) - self.progress[r] <= self.k + 1]
        long = [r for r in sampled if r not in set(short)]
        with without_groups():
            first: dict[str, torch.Tensor] = {}
            if short:
                first.update(zip(short, self._catch_up_by_decode(short, slots, tables).unbind(), strict=True))
            if long:
                first.update(self._catch_up(long, slots, tables))
            return self._draft([r for r in sampled if r in first], first, slots, tables)

    def _decode(self, request_ids: list[str], positions: list[int], slots: list[int], input_ids: torch.Tensor,
                tables: BlockTables) -> torch.Tensor:
        """One decode step: input_ids [B] (on the device) at `positions`, each request's state in `slots`
        -> the argmax token after each [B] on the device (no host sync)."""
        dev = to_device(self.device, {"rows": [tables.row(r) for r in request_ids], "positions": positions,
                                      "slots": slots})
        rows, position = dev["rows"], dev["positions"]
        width = max(tables.num_blocks(r) for r in request_ids)
        ctx = ForwardContext(
            num_tokens=len(request_ids), num_decodes=len(request_ids),
            slot_mapping=tables.slot_mapping(rows, position, self.block_size),
            decode_state_slots=dev["slots"], decode_block_tables=tables.gather(rows, width),
            decode_seq_lens=position + 1, **no_prefill_fields(self.device),
        )
        if self.graphs is not None and self.graphs.size_for(ctx) is not None:
            return self.graphs.run(input_ids, ctx).argmax(dim=-1)
        with set_forward_context(ctx):
            return self.model.compute_logits(self.model(input_ids)).argmax(dim=-1)

    def _catch_up_by_decode(self, request_ids: list[str], slots: dict[str, int], tables: BlockTables,
                            ) -> torch.Tensor:
        """Each request's few unseen tokens as successive decode steps on its live state; returns the
        argmax after each one's last token [R] on the device."""
        unseen = {r: self.known[r][self.progress[r]:] for r in request_ids}
        first = torch.empty(len(request_ids), dtype=torch.long, device=self.device)
        for step in range(max(len(tokens) for tokens in unseen.values())):
            active = [i for i, r in enumerate(request_ids) if len(unseen[request_ids[i]]) > step]
            names = [request_ids[i] for i in active]
            dev = to_device(self.device, {
                "tokens": [unseen[r][step] for r in names],
                "ends": [j for j, r in enumerate(names) if len(unseen[r]) == step + 1],  # last token now
                "at": [i for i in active if len(unseen[request_ids[i]]) == step + 1]})
            argmax = self._decode(names, [self.progress[r] + step for r in names], [slots[r] for r in names],
                                  dev["tokens"], tables)
            first.index_copy_(0, dev["at"], argmax.index_select(0, dev["ends"]))
        for r in request_ids:
            self.progress[r] = len(self.known[r])
        return first

    def _catch_up(self, request_ids: list[str], slots: dict[str, int], tables: BlockTables,
                  ) -> dict[str, torch.Tensor]:
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
        dev = to_device(self.device, {
            "rows": row_of_token, "positions": positions, "cu": cu, "slots": [slots[r] for r, _, _ in chunks],
            "ids": ids, "last": [c - 1 for c in cu[1:]], "has_state": [int(start > 0) for _, start, _ in chunks]})
        ctx = ForwardContext(
            num_tokens=len(ids), num_decodes=0,
            slot_mapping=tables.slot_mapping(dev["rows"], dev["positions"], self.block_size),
            decode_state_slots=empty, decode_block_tables=torch.zeros(0, 1, **long), decode_seq_lens=empty,
            prefill_cu_seqlens=dev["cu"], prefill_state_slots=dev["slots"],
            prefill_has_initial_state=dev["has_state"].bool(),
            prefill_sequences=tuple(sequences), prefill_cu_seqlens_cpu=torch.tensor(cu, dtype=torch.long),
        )
        with set_forward_context(ctx):
            hidden = self.model(dev["ids"])
        argmax = self.model.compute_logits(hidden.index_select(0, dev["last"])).argmax(dim=-1)
        return {r: token for (r, _, _), token in zip(chunks, argmax.unbind(), strict=True)
                if self.progress[r] == len(self.known[r])}

    def _draft(self, request_ids: list[str], first: dict[str, torch.Tensor], slots: dict[str, int],
               tables: BlockTables) -> dict[str, list[int]]:
        """From each caught-up request's first draft (a device scalar), decode greedily in a scratch row
        for the rest; the drafts come to the host once, at the end."""
        counts = {r: min(self.k, self.max_model_len - len(self.known[r])) for r in request_ids}
        request_ids = [r for r in request_ids if counts[r] >= 1]
        if not request_ids:
            return {}
        drafts = torch.stack([first[r] for r in request_ids]).unsqueeze(1).repeat(1, self.k)  # [R, k]
        index = {r: i for i, r in enumerate(request_ids)}
        order = [r for r in request_ids if counts[r] > 1]
        scratch = {r: self.scratch_base + i for i, r in enumerate(order)}
        if order:
            copy_slots(self.model, [slots[r] for r in order], [scratch[r] for r in order])
        for step in range(1, self.k):
            active = [r for r in order if counts[r] > step]
            if not active:
                break
            rows = to_device(self.device, {"rows": [index[r] for r in active]})["rows"]
            tokens = drafts[:, step - 1].index_select(0, rows)
            argmax = self._decode(active, [len(self.known[r]) + step - 1 for r in active],
                                  [scratch[r] for r in active], tokens, tables)
            drafts[:, step].index_copy_(0, rows, argmax)
        host = drafts.tolist()
        return {r: host[index[r]][: counts[r]] for r in request_ids}
