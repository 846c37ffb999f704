#!/usr/bin/env bash
# Issue 18 on the device: `deltaserve serve` on the 48B shape (random weights) with the offload tier off
# and on (a host tier of TIER_SIZE, default 64GiB), then `deltaserve bench serve --workload agentic` at
# CONCURRENCY (default 32,64) for DURATION seconds per level against each; the hit split (HBM / tier),
# TTFT and tok/s/GPU land in one JSON per mode. MODES picks the servers ("off on" by default).
# usage: benchmarks/serve_offload.sh [OUTDIR]   (from the repository root, on a GPU; after device_setup.sh)
set -u
DS=${DS:-deltaserve}  # e.g. DS="python3 -m deltaserve.cli" where the package is on PYTHONPATH, not installed
out=${1:-benchmarks/results}
duration=${DURATION:-60}
port=8124
day=$(date +%F)
mkdir -p "$out"
for mode in ${MODES:-off on}; do
  flags=()
  if [ "$mode" = on ]; then flags=(--kv-offloading-size "${TIER_SIZE:-64GiB}"); fi
  setsid $DS serve --model random:kimi-linear-48b-a3b --port $port --max-model-len 65536 "${flags[@]}" \
    >"$out/serve_offload_$mode.log" 2>&1 &
  pid=$!
  started=$(date +%s)
  python3 benchmarks/wait_healthy.py "$port" || { echo "server ($mode) never became healthy"; tail -20 "$out/serve_offload_$mode.log"; }
  echo "== tier $mode: healthy after $(( $(date +%s) - started )) s"
  $DS bench serve --base-url "http://127.0.0.1:$port" --workload agentic --concurrency "${CONCURRENCY:-32,64}" \
    --duration "$duration" --seed 0 --no-progress --out "$out/bench_serve_offload_${day}_tier_$mode.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "offload|prefix_cache|state_checkpoints_(filed|evicted)" \
    >"$out/serve_offload_${mode}_metrics.txt"
  kill -INT -- -$pid  # the launcher's whole process group
  for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$pid 2>/dev/null
  wait $pid
done
