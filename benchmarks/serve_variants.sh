#!/usr/bin/env bash
# One `deltaserve serve` per variant on the 48B shape (random weights), `deltaserve bench serve --workload
# agentic` at CONCURRENCY against each, a /metrics snapshot, and the server's whole process group stopped.
# Variants: the VARIANTS environment variable, one per line, "NAME FLAGS..." (FLAGS for `deltaserve serve`);
# MODEL, MAX_MODEL_LEN, CONCURRENCY, DURATION, PORT and BENCH_ARGS (more `bench serve` flags) as named.
# usage: VARIANTS=$'off\ncap --max-prefill-tokens-with-decodes 2048' benchmarks/serve_variants.sh OUTDIR TAG
#   (from the repository root, on a GPU; DS="python3 -m deltaserve.cli" where the package is on PYTHONPATH)
# Writes OUTDIR/bench_serve_<TAG>_<date>_<NAME>.json, OUTDIR/serve_<TAG>_<NAME>.log and _metrics.txt.
set -u
DS=${DS:-deltaserve}
out=${1:-benchmarks/results}
tag=${2:-variants}
duration=${DURATION:-60}
port=${PORT:-8125}
day=$(date +%F)
mkdir -p "$out"
while read -r name flags; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086  # the flags are words
  setsid $DS serve --model "${MODEL:-random:kimi-linear-48b-a3b}" --port "$port" --max-model-len "${MAX_MODEL_LEN:-65536}" $flags \
    >"$out/serve_${tag}_$name.log" 2>&1 &
  pid=$!
  started=$(date +%s)
  python3 benchmarks/wait_healthy.py "$port" || { echo "server ($name) never became healthy"; tail -20 "$out/serve_${tag}_$name.log"; }
  echo "== $tag $name: healthy after $(( $(date +%s) - started )) s"
  $DS bench serve --base-url "http://127.0.0.1:$port" --workload agentic --concurrency "${CONCURRENCY:-32}" \
    --duration "$duration" --seed 0 --no-progress ${BENCH_ARGS:-} --out "$out/bench_serve_${tag}_${day}_$name.json"
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "offload|prefix_cache|spec_decode|time_per_output" \
    >"$out/serve_${tag}_${name}_metrics.txt"
  kill -INT -- -$pid
  for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$pid 2>/dev/null
  wait $pid
done <<< "${VARIANTS:?set VARIANTS: one line per server, NAME FLAGS...}"
