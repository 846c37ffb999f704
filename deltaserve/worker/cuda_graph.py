"""CUDA graphs for decode steps: the model forward plus the logits, captured per batch size (the capture
loop is shared with speculative decoding's verify graphs, worker/verify_graph.py).

A decode-only step of B sequences replays the graph of the smallest captured size >= B. Its inputs
live in static buffers sized for the largest graph; rows past B are padding that writes its latent
into a scratch KV block and steps a scratch KDA state slot (both allocated beyond the scheduler's
range by the worker), so padding never touches a real request. Graphs are captured largest first
into one memory pool, after an eager warm-up of each size (Triton autotuning must not run inside a
capture). Every op on the decode path must be capturable: no host syncs, static shapes. The MLA
decode kernel gets a fixed `decode_max_seq_len` (the model's context) so its split count is static.
If a capture fails, graphs are turned off with a warning and decode runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from deltaserve.model.forward_context import ForwardContext, no_prefill_fields, set_forward_context
from deltaserve.model.kimi_linear import KimiLinearForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES) -> list[int]:
    """The batch sizes to capture: the defaults up to max_num_seqs, plus max_num_seqs itself (if <= 256);
    larger batches decode eagerly."""
    chosen = {s for s in sizes if s <= max_num_seqs}
    if max_num_seqs <= max(sizes):
        chosen.add(max_num_seqs)
    return sorted(chosen)


class StepGraphs:
    """Captured CUDA graphs of one kind of step, one per size, with static input buffers sized for the
    largest (subclasses lay the buffers out and build each size's forward context)."""

    kind = "step"

    def __init__(self, model: KimiLinearForCausalLM, device: torch.device, block_size: int, max_model_len: int,
                 pad_block: int, pad_state_slot: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pad_block = pad_block
        self.pad_state_slot = pad_state_slot
        self.max_blocks = -(-max_model_len // block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.taps: dict[int, torch.Tensor | None] = {}  # an Eagle3 drafter's tap states of each size's rows
        self.eager_sizes: set[int] = set()  # sizes laid out without a capture (lay_out_without_capture)
        self.max_size = 0

    def _allocate(self, max_size: int) -> None:
        raise NotImplementedError

    def _forward(self, size: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, sizes: Sequence[int]) -> bool:
        """Warm up and capture every size, largest first, in one pool. False (graphs off) on failure."""
        if not sizes:
            return False
        sizes = sorted(set(sizes), reverse=True)
        self._allocate(sizes[0])
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                for size in sizes:
                    self._forward(size)  # eager warm-up: autotuning and lazy init happen here
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            for size in sizes:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[size] = self._forward(size)
                self.taps[size] = self.model.captured_taps  # written by every replay (None without tap layers)
                self.graphs[size] = graph
        except Exception as e:  # an op that cannot be captured: these steps stay eager, loudly
            logger.warning("CUDA graph capture failed (%s: %s); %s steps run without CUDA graphs",
                           type(e).__name__, e, self.kind)
            self.graphs.clear()
            self.logits.clear()
            self.taps.clear()
            torch.cuda.synchronize(self.device)
            return False
        self.max_size = sizes[0]
        logger.info("captured CUDA graphs for %s batch sizes %s", self.kind, sorted(self.graphs))
        return True

    def lay_out_without_capture(self, sizes: Sequence[int]) -> None:
        """Run these sizes' padded layouts eagerly instead of replaying graphs: the same buffers, padding
        and contexts with no capture (how the CPU tests check a layout against the unpadded step)."""
        self._allocate(max(sizes))
        self.max_size = max(sizes)
        self.eager_sizes = set(sizes)

    def graph_size(self, num_sequences: int) -> int | None:
        """The captured size that serves a batch of num_sequences, or None."""
        sizes = self.graphs.keys() | self.eager_sizes
        if not sizes or num_sequences > self.max_size:
            return None
        return min(s for s in sizes if s >= num_sequences)

    def size_for(self, context: ForwardContext) -> int | None:
        """The graph size that serves this step, or None."""
        raise NotImplementedError

    def run(self, input_ids: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Replay for one step this kind serves: input_ids [T] -> logits [T, vocab] of its rows, in order."""
        raise NotImplementedError

    def _replay(self, size: int) -> torch.Tensor:
        """Replay this size's graph (or run its layout eagerly) on the filled buffers -> its logits rows;
        the model's `captured_taps` then hold the layout's tap rows, as after an eager forward."""
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)
        graph.replay()
        self.model.captured_taps = self.taps[size]
        return self.logits[size]


class DecodeGraphs(StepGraphs):
    """Captured decode graphs and their static input buffers."""

    kind = "decode"

    def _allocate(self, max_size: int) -> None:
        dev, long = self.device, torch.long
        self.input_ids = torch.zeros(max_size, dtype=long, device=dev)
        self.slot_mapping = torch.full((max_size,), self.pad_block * self.block_size, dtype=long, device=dev)
        self.state_slots = torch.full((max_size,), self.pad_state_slot, dtype=long, device=dev)
        self.block_tables = torch.full((max_size, self.max_blocks), self.pad_block, dtype=long, device=dev)
        self.seq_lens = torch.ones(max_size, dtype=long, device=dev)
        self._no_prefill = no_prefill_fields(dev)

    def _context(self, size: int) -> ForwardContext:
        return ForwardContext(
            num_tokens=size,
            num_decodes=size,
            slot_mapping=self.slot_mapping[:size],
            decode_state_slots=self.state_slots[:size],
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            decode_max_seq_len=self.max_model_len,
            **self._no_prefill,
        )

    def _forward(self, size: int) -> torch.Tensor:
        with set_forward_context(self._context(size)):
            hidden = self.model(self.input_ids[:size])
        return self.model.compute_logits(hidden)

    def size_for(self, context: ForwardContext) -> int | None:
        """The graph size that serves this step, or None: it must hold decode rows only."""
        if context.num_prefills or context.num_verify_tokens:
            return None
        return self.graph_size(context.num_decodes)

    def run(self, input_ids: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Replay for one decode-only step; returns logits [B, vocab] of its B sequences (rows in order)."""
        batch = context.num_decodes
        size = self.size_for(context)
        assert size is not None
        self.input_ids[:batch].copy_(input_ids)
        self.slot_mapping[:batch].copy_(context.slot_mapping)
        self.state_slots[:batch].copy_(context.decode_state_slots)
        width = context.decode_block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(context.decode_block_tables)
        self.seq_lens[:batch].copy_(context.decode_seq_lens)
        if size > batch:  # padding rows: scratch block and slot, one token of context
            self.slot_mapping[batch:size].fill_(self.pad_block * self.block_size)
            self.state_slots[batch:size].fill_(self.pad_state_slot)
            self.block_tables[batch:size, 0].fill_(self.pad_block)
            self.seq_lens[batch:size].fill_(1)
        return self._replay(size)[:batch]
