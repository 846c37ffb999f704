"""What prefix caching's per-request boundary slot costs on the 48B shape: bytes and copy time.

Each running request keeps a second KDA state slot, refreshed (slot-to-slot copy of every KDA
layer's conv window and recurrent state) each time decode fills a block; finished requests save it
into checkpoint units. This times those copies with the 48B shape's state tensors on the current
device, using the engine's own StateCheckpointStore.

Usage: python benchmarks/boundary_slot_cost.py [--slots 8] [--block-size 16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from deltaserve.core.cache_sizing import default_unit_bytes
from deltaserve.model_files.presets import preset_config
from deltaserve.worker.state_store import StateCheckpointStore


def timed(fn, device, repeats=20) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats / 1e3
    import time

    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_config("kimi-linear-48b-a3b")
    heads, dim, width = cfg.linear_num_heads, cfg.linear_head_dim, cfg.short_conv_kernel_size
    tensors = []
    for _ in cfg.kda_layer_ids:
        tensors.append(torch.randn(args.slots, 3 * heads * dim, width - 1, dtype=torch.bfloat16, device=device))
        tensors.append(torch.randn(args.slots, heads, dim, dim, dtype=torch.float32, device=device))
    image = sum(t[0].numel() * t.element_size() for t in tensors)
    unit = default_unit_bytes(image)
    units_per = -(-image // unit)
    store = StateCheckpointStore(tensors, 2 * units_per, unit)
    copy_s = timed(lambda: store.copy(0, 1), device)
    save_s = timed(lambda: store.save(0, list(range(units_per))), device)
    load_s = timed(lambda: store.load(list(range(units_per)), 2), device)
    row = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "kda_layers": len(cfg.kda_layer_ids),
        "image_bytes": image,
        "unit_bytes": unit,
        "units_per_checkpoint": units_per,
        "boundary_copy_s": copy_s,
        "checkpoint_save_s": save_s,
        "checkpoint_load_s": load_s,
        "copy_bandwidth_GBps": 2 * image / copy_s / 1e9,
        "amortised_copy_per_decode_token_s": copy_s / args.block_size,
    }
    out = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    path = os.path.join(out, f"boundary_slot_cost_{row['date']}.json")
    with open(path, "w") as f:
        json.dump(row, f, indent=1)
    for k, v in row.items():
        print(f"{k:>36}: {v}")


if __name__ == "__main__":
    main()
