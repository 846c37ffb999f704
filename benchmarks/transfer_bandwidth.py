"""READ bandwidth of each transfer engine between two processes on loopback (issue 17).

For each installed backend a peer process registers a region of the largest size; this process pulls
N MiB of it in one `read` + `wait`, once as a single descriptor and once as 4 KiB descriptors (the
shape of a request's paged KV: one descriptor per block per layer). Each case runs one untimed
warm-up, then `--repeats` timed reads; the median is reported and every read's bytes are checked.
Time includes building the descriptor lists (inside `read`) and polling to completion.

Usage:
  python benchmarks/transfer_bandwidth.py                      # 1, 16, 64 MiB, every backend, 5 repeats
  python benchmarks/transfer_bandwidth.py --backends nixl --sizes-mib 1,4
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import time

import torch
from host_step_time import machine

from deltaserve.kv_transfer import TransferOp, available_backends, make_agent
from deltaserve.kv_transfer.loopback_peer import LoopbackPeer

HERE = os.path.dirname(os.path.abspath(__file__))
DESCRIPTOR_SHAPES = {"one": None, "4KiB": 4096}
LIBRARIES = {"nixl": ("nixl-cu12", "nixl-cu13"), "mooncake": ("mooncake-transfer-engine-non-cuda",
                                                               "mooncake-transfer-engine")}


def library_version(backend: str) -> str:
    """The installed distribution and version of `backend`'s library (the first of its wheels found)."""
    for name in LIBRARIES[backend]:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def read_ops(local_addr: int, remote_addr: int, nbytes: int, descriptor_bytes: int | None) -> list[TransferOp]:
    """One op for the whole range, or one per `descriptor_bytes` piece."""
    step = descriptor_bytes or nbytes
    offsets = range(0, nbytes, step)
    return [(local_addr + offset, remote_addr + offset, min(step, nbytes - offset)) for offset in offsets]


def bench_backend(backend: str, sizes_mib: list[int], repeats: int) -> list[dict]:
    """Rows of (backend, size, descriptor shape) with the median time and bandwidth."""
    region_bytes = max(sizes_mib) << 20
    local = torch.zeros(region_bytes, dtype=torch.uint8)
    rows = []
    peer = LoopbackPeer(backend, region_bytes, name="bench-peer")
    with make_agent(backend, f"bench-{backend}") as agent, peer:
        agent.register([(local.data_ptr(), region_bytes)])
        peer_name = agent.add_peer(peer.metadata)
        for size_mib in sizes_mib:
            nbytes = size_mib << 20
            for shape, descriptor_bytes in DESCRIPTOR_SHAPES.items():
                ops = read_ops(local.data_ptr(), peer.region_addr, nbytes, descriptor_bytes)
                seconds = []
                for repeat in range(repeats + 1):
                    local[:nbytes].zero_()
                    start = time.perf_counter()
                    agent.wait(agent.read(peer_name, ops), timeout_s=120)
                    if repeat:  # the first read is the warm-up (connection, registration caches)
                        seconds.append(time.perf_counter() - start)
                    if not torch.equal(local[:nbytes], peer.expected[:nbytes]):
                        raise RuntimeError(f"{backend} read of {size_mib} MiB as {shape} landed wrong bytes")
                median_s = statistics.median(seconds)
                rows.append({
                    "backend": backend, "size_mib": size_mib, "descriptors": shape, "num_ops": len(ops),
                    "median_ms": round(median_s * 1e3, 3), "gib_per_s": round(nbytes / median_s / 2**30, 3),
                    "all_ms": [round(s * 1e3, 3) for s in seconds],
                })
                print(f"{backend:9s} {size_mib:4d} MiB {shape:5s} {len(ops):6d} ops  {median_s * 1e3:9.2f} ms  "
                      f"{nbytes / median_s / 2**30:7.2f} GiB/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=None, help="comma-separated; default: every installed backend")
    parser.add_argument("--sizes-mib", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="default: results/transfer_bandwidth_<date>_cpu.json")
    args = parser.parse_args()
    backends = args.backends.split(",") if args.backends else available_backends()
    sizes_mib = [int(s) for s in args.sizes_mib.split(",")]
    torch.set_num_threads(1)
    print(f"{'backend':9s} {'size':>8s} {'descr':5s} {'ops':>10s}  {'median':>12s}  {'bandwidth':>12s}")
    rows = [row for backend in backends for row in bench_backend(backend, sizes_mib, args.repeats)]
    date = datetime.date.today().isoformat()
    result = {
        "benchmark": "transfer_bandwidth", "date": date, "machine": machine(None),
        "versions": {backend: library_version(backend) for backend in backends},
        "setup": "two processes on loopback, READ pulled by this process; nixl: UCX, mooncake: TCP",
        "repeats": args.repeats, "rows": rows,
    }
    out = args.out or os.path.join(HERE, "results", f"transfer_bandwidth_{date}_cpu.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
