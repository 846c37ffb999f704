"""Merge fla autotune dumps (a MODE=tune run of gpu_fla_configs.sh, `fla_configs.tar` unpacked) into the
shipped configs: per GPU directory and kernel file, the dump's `autotune_entries` are added to the shipped
file's (a dump's entry wins on the same key). Unpacking the tar over the shipped files instead would drop
every entry the tuning run did not see.

usage: python benchmarks/merge_fla_configs.py DUMP_DIR [SHIPPED_DIR]
   (DUMP_DIR holds <GPU name>/<kernel>.json; SHIPPED_DIR defaults to deltaserve/ops/kda/fla_tuned)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "deltaserve" / "ops" / "kda" / "fla_tuned"


def merge(dump_dir: Path, shipped_dir: Path = SHIPPED) -> dict[str, int]:
    """Merge every <GPU>/<kernel>.json under dump_dir into shipped_dir; {relative path: entries added}."""
    added = {}
    for dumped in sorted(dump_dir.glob("*/*.json")):
        target = shipped_dir / dumped.relative_to(dump_dir)
        new = json.loads(dumped.read_text())
        old = json.loads(target.read_text()) if target.exists() else {}
        entries = dict(old.get("autotune_entries", {}))
        added[str(dumped.relative_to(dump_dir))] = sum(key not in entries for key in new.get("autotune_entries", {}))
        entries.update(new.get("autotune_entries", {}))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({**old, **new, "autotune_entries": entries}, indent=1) + "\n")
    return added


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    for path, count in merge(Path(sys.argv[1]), *(Path(a) for a in sys.argv[2:])).items():
        print(f"{path}: {count} entries added")
