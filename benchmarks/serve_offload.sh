#!/usr/bin/env bash
# Issue 18 on the device: `deltaserve serve` on the 48B shape (random weights) with the offload tier off
# and on (a host tier of TIER_SIZE, default 64GiB), then `deltaserve bench serve --workload agentic` at
# CONCURRENCY (default 32,64) for DURATION seconds per level against each; the hit split (HBM / tier),
# TTFT and tok/s/GPU land in one JSON per mode (bench_serve_offload_<date>_<mode>.json).
# usage: benchmarks/serve_offload.sh [OUTDIR]   (from the repository root, on a GPU; after device_setup.sh)
set -u
variants=""
for mode in ${MODES:-off on}; do
  if [ "$mode" = on ]; then variants+="on --kv-offloading-size ${TIER_SIZE:-64GiB}"$'\n'; else variants+="off"$'\n'; fi
done
VARIANTS=$variants CONCURRENCY=${CONCURRENCY:-32,64} PORT=8124 bash "$(dirname "$0")/serve_variants.sh" \
  "${1:-benchmarks/results}" offload
