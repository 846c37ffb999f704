"""The worker's incremental block tables: a table arrives once, then only its new blocks."""

from __future__ import annotations

import pytest

from deltaserve.core.scheduler_output import ScheduledChunk
from deltaserve.worker.block_tables import BlockTables


def chunk(request_id: str, new_block_ids: list[int], reset: bool) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 0, new_block_ids, reset, 0, False, 0)


def test_tables_grow_reset_and_drop():
    tables = BlockTables(rows=1, width=2)
    tables.apply(chunk("a", [5, 6, 7], reset=True))  # wider than the tensor: it grows
    tables.apply(chunk("b", [1], reset=True))  # a second row: it grows too
    tables.apply(chunk("a", [8], reset=False))
    tables.apply(chunk("a", [], reset=False))  # a step that needed no new block
    assert tables.ids("a") == [5, 6, 7, 8] and tables.ids("b") == [1] and len(tables) == 2
    tables.apply(chunk("a", [9, 10], reset=True))  # readmitted after a preemption: a new table
    assert tables.ids("a") == [9, 10]
    row_b = tables.row("b")
    tables.drop(["b", "never-sent"])
    tables.apply(chunk("c", [3], reset=True))
    assert tables.row("c") == row_b and tables.ids("c") == [3]  # the row is reused, from empty
    with pytest.raises(RuntimeError, match="never sent"):
        tables.apply(chunk("d", [4], reset=False))
