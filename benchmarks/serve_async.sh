#!/usr/bin/env bash
# Served end to end with async scheduling off and on: `deltaserve serve` on the 48B shape (random
# weights), then `deltaserve bench serve --workload agentic` at concurrency 8 and 32 against it.
# usage: benchmarks/serve_async.sh [OUTDIR] [SECONDS_PER_LEVEL]   (run from the repository root, on a GPU)
set -u
DS=${DS:-deltaserve}  # e.g. DS="python3 -m deltaserve.cli" where the package is on PYTHONPATH, not installed
out=${1:-benchmarks/results}
duration=${2:-60}
port=8123
day=$(date +%F)
mkdir -p "$out"
for mode in no-async-scheduling async-scheduling; do
  setsid $DS serve --model random:kimi-linear-48b-a3b --port $port --max-model-len 65536 --$mode \
    >"$out/serve_$mode.log" 2>&1 &
  pid=$!
  python3 benchmarks/wait_healthy.py "$port" || { echo "server ($mode) never became healthy"; tail -20 "$out/serve_$mode.log"; }
  $DS bench serve --base-url "http://127.0.0.1:$port" --workload agentic --concurrency 8,32 \
    --duration "$duration" --seed 0 --no-progress --out "$out/bench_serve_agentic_${day}_h200_$mode.json"
  kill -INT -- -$pid  # the launcher's whole process group
  for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$pid 2>/dev/null
  wait $pid
done
