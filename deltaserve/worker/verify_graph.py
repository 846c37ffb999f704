"""CUDA graphs for speculative decoding's verify steps: windows of a fixed length, captured per batch size.

A verify step runs each request's last token and its drafts as one window (plain decode rows are
windows of one token). Windows vary in length (fewer drafts near max_tokens, n-gram misses), so a
graph of size N holds N windows of `window` = k + 1 tokens each, and a step of D decode rows and V
windows (D + V <= N, none longer than `window`) is laid out window by window: decode row i as
window i's first token, verify window j as window D + j, every other position padding. Padding
writes its latent into the scratch KV block and its KDA state (conv window and recurrent state) into
the scratch state slot, both past the scheduler's range, so it never touches a real request; a
decode row's state slot is its window's first slot, which fla's spec-decoding kernel reads the
initial state from and writes the state after token 0 to, exactly as a decode step would.

Every window token is an MLA decode row (its own sequence length), so the step runs the same
kernels as an eager verify step with a fixed MLA split count (the model's context, as decode graphs
use). Logits of every position are copied into one static buffer outside the graph pool, so sizes
share the pool's activations; the step's rows are gathered from it in their original order.
"""

from __future__ import annotations

import torch

from deltaserve.model.forward_context import ForwardContext, no_prefill_fields, set_forward_context
from deltaserve.worker.cuda_graph import StepGraphs, capture_sizes
from deltaserve.worker.host_transfer import to_device

# the most tokens one verify graph holds (vLLM's default largest capture is 512 tokens)
MAX_VERIFY_GRAPH_TOKENS = 512


def verify_capture_sizes(max_num_seqs: int, window: int, max_tokens: int = MAX_VERIFY_GRAPH_TOKENS) -> list[int]:
    """The window counts to capture: decode's sizes whose windows hold at most max_tokens tokens."""
    return [s for s in capture_sizes(max_num_seqs) if s * window <= max_tokens]


def graph_memory_bytes(max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                       activation_bytes_per_token: int, window: int = 0) -> int:
    """What decode graphs (and verify graphs of `window` tokens, when window > 1) take beside the caches:
    for the largest size of each kind, its block-table buffer (rows x blocks of max_model_len, int64),
    its float32 logits in the graph pool (and the verify graphs' static copy of them), and an activation
    allowance per row. An estimate the cache budget sets aside, as it does for eager activations."""
    max_blocks = -(-max_model_len // block_size)
    per_row = max_blocks * 8 + vocab_size * 4 + activation_bytes_per_token
    total = max(capture_sizes(max_num_seqs)) * per_row
    verify_sizes = verify_capture_sizes(max_num_seqs, window) if window > 1 else []
    if verify_sizes:
        total += max(verify_sizes) * window * (per_row + vocab_size * 4)
    return total


class VerifyGraphs(StepGraphs):
    """Captured verify graphs of `window`-token windows and their static input buffers."""

    kind = "verify"

    def __init__(self, *args: object, window: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if window < 1:
            raise ValueError(f"a verify window holds at least one token, got window={window}")
        self.window = window
        self._out: torch.Tensor | None = None  # [max windows * window, vocab]: every position's logits

    def _allocate(self, max_size: int) -> None:
        dev, long, rows = self.device, torch.long, max_size * self.window
        self.input_ids = torch.zeros(rows, dtype=long, device=dev)
        self.slot_mapping = torch.full((rows,), self.pad_block * self.block_size, dtype=long, device=dev)
        self.block_tables = torch.full((rows, self.max_blocks), self.pad_block, dtype=long, device=dev)
        self.seq_lens = torch.ones(rows, dtype=long, device=dev)
        self.state_indices = torch.full((max_size, self.window), self.pad_state_slot, dtype=long, device=dev)
        self.cu_seqlens = torch.arange(max_size + 1, dtype=long, device=dev) * self.window
        self._no_decodes = torch.zeros(0, dtype=long, device=dev)
        self._no_prefill = no_prefill_fields(dev)

    def _context(self, size: int) -> ForwardContext:
        rows = size * self.window
        return ForwardContext(
            num_tokens=rows,
            num_decodes=0,
            slot_mapping=self.slot_mapping[:rows],
            decode_state_slots=self._no_decodes,
            decode_block_tables=self.block_tables[:rows],
            decode_seq_lens=self.seq_lens[:rows],
            decode_max_seq_len=self.max_model_len,
            num_verify_tokens=rows,
            verify_seq_lens=(self.window,) * size,
            verify_cu_seqlens=self.cu_seqlens[: size + 1],
            verify_state_indices=self.state_indices[:size],
            **self._no_prefill,
        )

    def _forward(self, size: int) -> torch.Tensor:
        rows = size * self.window
        with set_forward_context(self._context(size)):
            logits = self.model.compute_logits(self.model(self.input_ids[:rows]))
        if self._out is None:  # the first (largest) warm-up, outside any capture
            self._out = torch.empty((self.input_ids.shape[0], logits.shape[1]), dtype=logits.dtype, device=self.device)
        self._out[:rows].copy_(logits)
        return self._out[:rows]

    def size_for(self, context: ForwardContext) -> int | None:
        """The graph size that serves this step, or None: it must have verify windows and no prefill
        chunk, and every window must fit `window` tokens."""
        if context.num_prefills or not context.num_verify_tokens or max(context.verify_seq_lens) > self.window:
            return None
        return self.graph_size(context.num_decodes + len(context.verify_seq_lens))

    def run(self, input_ids: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """Replay for one step of decode rows and verify windows (see `size_for`): input_ids [T] ->
        logits [T, vocab] of its rows, in the step's order (decode rows, then every window's tokens)."""
        size = self.size_for(context)
        assert size is not None and context.verify_state_indices is not None
        window, decodes, lengths = self.window, context.num_decodes, context.verify_seq_lens
        width = context.verify_state_indices.shape[1]
        # each row's position in the padded layout, and each window token's entry in verify_state_indices
        dest = [i * window for i in range(decodes)]
        source: list[int] = []
        for j, length in enumerate(lengths):
            first = (decodes + j) * window
            dest += range(first, first + length)
            source += range(j * width, j * width + length)
        index = to_device(self.device, {"dest": dest, "source": source})
        dest_rows, source_entries = index["dest"], index["source"]

        rows = size * window
        self.input_ids[:rows].zero_()
        self.slot_mapping[:rows].fill_(self.pad_block * self.block_size)
        self.block_tables[:rows, 0].fill_(self.pad_block)
        self.seq_lens[:rows].fill_(1)
        self.state_indices[:size].fill_(self.pad_state_slot)
        self.input_ids.index_copy_(0, dest_rows, input_ids)
        self.slot_mapping.index_copy_(0, dest_rows, context.slot_mapping)
        blocks = context.decode_block_tables.shape[1]
        self.block_tables[dest_rows, :blocks] = context.decode_block_tables
        self.seq_lens.index_copy_(0, dest_rows, context.decode_seq_lens)
        slots = torch.cat([context.decode_state_slots,
                           context.verify_state_indices.reshape(-1).index_select(0, source_entries)])
        self.state_indices.view(-1).index_copy_(0, dest_rows, slots)
        logits = self._replay(size).index_select(0, dest_rows)
        if self.model.captured_taps is not None:  # an Eagle3 drafter reads them by the step's rows
            self.model.captured_taps = self.model.captured_taps.index_select(0, dest_rows)
        return logits
