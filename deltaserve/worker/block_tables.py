"""The block table of every request a worker runs, kept across steps.

The scheduler sends each request's table once and then only the blocks appended to it
(`ScheduledChunk.new_block_ids`), so a step costs the host what changed, not every table in full.
Tables live as rows of one host tensor; a step's slot mapping, decode tables and prefill block lists
are gathered from it with a few tensor ops.
"""

from __future__ import annotations

import torch

from deltaserve.core.scheduler_output import ScheduledChunk


class BlockTables:
    """Rows of block ids, one per request, grown as the scheduler appends blocks."""

    def __init__(self, rows: int = 16, width: int = 64) -> None:
        self.table = torch.zeros(rows, width, dtype=torch.long)  # [rows, width] block ids
        self.lengths: list[int] = [0] * rows  # valid ids in each row
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row_of)

    def row(self, request_id: str) -> int:
        return self._row_of[request_id]

    def num_blocks(self, request_id: str) -> int:
        return self.lengths[self._row_of[request_id]]

    def ids(self, request_id: str) -> list[int]:
        """The request's table as a list (for tests and checks)."""
        row = self._row_of[request_id]
        return self.table[row, : self.lengths[row]].tolist()

    def apply(self, chunk: ScheduledChunk) -> int:
        """Take in the chunk's new block ids; returns the request's row."""
        row = self._row_of.get(chunk.request_id)
        if row is None:
            if not chunk.table_reset:
                raise RuntimeError(f"{chunk.request_id}: new block ids for a table this worker was never sent")
            row = self._row_of[chunk.request_id] = self._take_row()
        if chunk.table_reset:
            self.lengths[row] = 0
        new = chunk.new_block_ids
        if new:
            start = self.lengths[row]
            self._reserve(start + len(new))
            self.table[row, start : start + len(new)] = torch.tensor(new, dtype=torch.long)
            self.lengths[row] = start + len(new)
        return row

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self.lengths[row] = 0
                self._free_rows.append(row)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self.table.shape[0]
            self.table = torch.cat([self.table, torch.zeros_like(self.table)])
            self.lengths.extend([0] * rows)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _reserve(self, width: int) -> None:
        have = self.table.shape[1]
        if width > have:
            grown = max(width, 2 * have)
            wider = torch.zeros(self.table.shape[0], grown, dtype=torch.long)
            wider[:, :have] = self.table
            self.table = wider
