#!/usr/bin/env bash
# Issue 18 on the device: `deltaserve serve` on the 48B shape (random weights) with the offload tier off,
# on (a host tier of TIER_SIZE, default 64GiB) and hinted (the same tier with --kv-offloading-admission
# cache_control), then `deltaserve bench serve --workload agentic --agentic-cache-control` at CONCURRENCY
# (default 32,64) for DURATION seconds per level against each. Every mode gets the same requests: the hint
# (cache_control on every turn but a session's known last) changes only what the hinted server saves. The
# hit split (HBM / tier), TTFT and tok/s/GPU land in one JSON per mode (bench_serve_offload_<date>_<mode>.json).
# usage: benchmarks/serve_offload.sh [OUTDIR]   (from the repository root, on a GPU; after device_setup.sh)
set -u
variants=""
for mode in ${MODES:-off on hinted}; do
  case $mode in
    on) variants+="on --kv-offloading-size ${TIER_SIZE:-64GiB}"$'\n' ;;
    hinted) variants+="hinted --kv-offloading-size ${TIER_SIZE:-64GiB} --kv-offloading-admission cache_control"$'\n' ;;
    *) variants+="off"$'\n' ;;
  esac
done
VARIANTS=$variants CONCURRENCY=${CONCURRENCY:-32,64} PORT=8124 BENCH_ARGS="--agentic-cache-control ${BENCH_ARGS:-}" \
  bash "$(dirname "$0")/serve_variants.sh" "${1:-benchmarks/results}" offload
