"""The block table of every request a worker runs, kept across steps.

The scheduler sends each request's table once and then only the blocks appended to it
(`ScheduledChunk.new_block_ids`), so a step costs the host what changed, not every table in full.
Tables live as rows of one host tensor. On a GPU a device mirror of it is kept in step by scattering
each step's new block ids into it (`pending` + `write_pending`), and a step's slot mapping, decode
tables and prefill block lists are gathered on the device from the mirror: the host never copies a
table. On the CPU the host table is the device table.
"""

from __future__ import annotations

import torch

from deltaserve.core.scheduler_output import ScheduledChunk


class BlockTables:
    """Rows of block ids, one per request, grown as the scheduler appends blocks."""

    def __init__(self, rows: int = 16, width: int = 64, device: torch.device | None = None,
                 mirror: bool | None = None) -> None:
        """device: where the step's tensors go; mirror: keep a device mirror (None: on any device but
        the CPU; tests mirror on the CPU to check the incremental updates)."""
        device = device or torch.device("cpu")
        if mirror is None:
            mirror = device.type != "cpu"
        self.table = torch.zeros(rows, width, dtype=torch.long)  # [rows, width] block ids, on the host
        self.lengths: list[int] = [0] * rows  # valid ids in each row
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))
        # [rows, width] long on the device; ids past a row's length are stale, never read
        self._mirror = torch.zeros(rows, width, dtype=torch.long, device=device) if mirror else None
        self._pending_rows: list[int] = []  # ids taken in since the last pending(), not yet mirrored
        self._pending_cols: list[int] = []
        self._pending_ids: list[int] = []

    def __len__(self) -> int:
        return len(self._row_of)

    @property
    def num_rows(self) -> int:
        """Rows allocated (row indices are below this)."""
        return self.table.shape[0]

    @property
    def device_table(self) -> torch.Tensor:
        """[rows, width] long on the worker's device: the mirror on a GPU, the host table on the CPU.
        Current once `write_pending` has run for the step."""
        return self.table if self._mirror is None else self._mirror

    def row(self, request_id: str) -> int:
        return self._row_of[request_id]

    def num_blocks(self, request_id: str) -> int:
        return self.lengths[self._row_of[request_id]]

    def ids(self, request_id: str) -> list[int]:
        """The request's table as a list (for tests and checks), from the host table."""
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
            if self._mirror is not None:
                self._pending_rows.extend([row] * len(new))
                self._pending_cols.extend(range(start, start + len(new)))
                self._pending_ids.extend(new)
        return row

    def pending(self) -> tuple[list[int], list[int]]:
        """The ids taken in since the last call and not yet in the mirror, as (flat index into
        `device_table`, block id) lists, for the caller to stage; cleared. Empty on the CPU."""
        width = self.table.shape[1]
        flat = [r * width + c for r, c in zip(self._pending_rows, self._pending_cols, strict=True)]
        ids = self._pending_ids
        self._pending_rows, self._pending_cols, self._pending_ids = [], [], []
        return flat, ids

    def write_pending(self, flat_index: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Scatter what `pending` returned, staged on the device ([K] long each), into the mirror."""
        if self._mirror is not None and flat_index.numel():
            self._mirror.view(-1).index_copy_(0, flat_index, block_ids)

    def slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """rows, positions: [T] long on the device (each token's table row and position) -> [T] long,
        the flat KV slot (block_id * block_size + offset) of each token."""
        return self.device_table[rows, positions // block_size] * block_size + positions % block_size

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """rows: [D] long on the device -> [D, width] long, those rows' first `width` ids (ids past a
        row's length are stale: readers stop at the sequence's length)."""
        return self.device_table[:, :width].index_select(0, rows)

    def blocks(self, row: int, num_blocks: int) -> torch.Tensor:
        """[num_blocks] long on the device: a view of the row's first ids."""
        return self.device_table[row, :num_blocks]

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
            if self._mirror is not None:
                self._mirror = torch.cat([self._mirror, torch.zeros_like(self._mirror)])
            self.lengths.extend([0] * rows)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _reserve(self, width: int) -> None:
        have = self.table.shape[1]
        if width > have:
            grown = max(width, 2 * have)
            self.table = _widen(self.table, grown)
            if self._mirror is not None:
                self._mirror = _widen(self._mirror, grown)


def _widen(table: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, w] -> [rows, width] (width >= w), the ids kept, zeros after them; on table's device."""
    wider = table.new_zeros(table.shape[0], width)
    wider[:, : table.shape[1]] = table
    return wider
