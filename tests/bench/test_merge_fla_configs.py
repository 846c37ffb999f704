"""benchmarks/merge_fla_configs.py: a tuning dump's entries join the shipped ones instead of replacing them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "merge_fla_configs.py"
_spec = importlib.util.spec_from_file_location("merge_fla_configs", _PATH)
merge_fla_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_fla_configs)


def _write(path: Path, entries: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kernel_name": path.stem, "autotune_entries": entries}))


def test_dump_entries_join_the_shipped_ones(tmp_path: Path) -> None:
    shipped, dump = tmp_path / "shipped", tmp_path / "dump"
    _write(shipped / "GPU" / "k.json", {"a": {"config": 1}, "b": {"config": 2}})
    _write(dump / "GPU" / "k.json", {"b": {"config": 3}, "c": {"config": 4}})
    _write(dump / "GPU" / "new_kernel.json", {"d": {"config": 5}})
    added = merge_fla_configs.merge(dump, shipped)
    assert added == {"GPU/k.json": 1, "GPU/new_kernel.json": 1}
    merged = json.loads((shipped / "GPU" / "k.json").read_text())
    assert merged["autotune_entries"] == {"a": {"config": 1}, "b": {"config": 3}, "c": {"config": 4}}
    assert merged["kernel_name"] == "k"
    assert json.loads((shipped / "GPU" / "new_kernel.json").read_text())["autotune_entries"] == {"d": {"config": 5}}
