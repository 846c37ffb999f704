#!/usr/bin/env bash
# Issue 15's executor overhead on the device (the 48B shape, the default MODEL, needs an H200): the carried wheels, then one
# run of benchmarks/executor_overhead.py per batch size (a timeout in one keeps the other), results in $OUT.
set -uo pipefail
shopt -s nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
logs=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd benchmarks
for batch in ${BATCHES:-1 64}; do
  timeout "${PER_BATCH_LIMIT:-270}" python3 executor_overhead.py --model "${MODEL:-random:kimi-linear-48b-a3b}" --batches "$batch" \
    --context 4096 --out "$logs/executor_overhead_b$batch.json" >"$logs/executor_overhead_b$batch.log" 2>&1
  echo "== batch $batch rc=$?"
  tail -n 6 "$logs/executor_overhead_b$batch.log"
done
if [ -n "${UCX_PROBE:-}" ]; then cd .. && bash benchmarks/gpu_ucx_probe.sh; fi
