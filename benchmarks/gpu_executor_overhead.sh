#!/usr/bin/env bash
# Issue 15's executor overhead on the device (the 48B shape, the default MODEL, needs an H200): the carried wheels, then one
# run of benchmarks/executor_overhead.py per batch size (a timeout in one keeps the other), results in $OUT.
set -uo pipefail
. benchmarks/device_setup.sh
cd benchmarks
for batch in ${BATCHES:-1 64}; do
  timeout "${PER_BATCH_LIMIT:-270}" python3 executor_overhead.py --model "${MODEL:-random:kimi-linear-48b-a3b}" --batches "$batch" \
    --context 4096 --out "$logs/executor_overhead_b$batch.json" >"$logs/executor_overhead_b$batch.log" 2>&1
  echo "== batch $batch rc=$?"
  tail -n 6 "$logs/executor_overhead_b$batch.log"
done
if [ -n "${UCX_PROBE:-}" ]; then cd .. && bash benchmarks/gpu_ucx_probe.sh; fi
