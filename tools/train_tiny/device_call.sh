#!/usr/bin/env bash
# One device call of the GPU recipe: install the carried wheels, optionally run the GPU tests, run the
# stages named in STAGES (gpu_run.sh) under a wall-clock limit, then pack everything a later call or
# this machine needs (exports, fla's tuned configs, logs, curves, summaries; not the optimizer
# checkpoints) into $OUT as 15 MiB parts: `cat train_tiny.tgz.* | tar xz -C build/train_tiny/runs`.
# Carry .whl, build/train_tiny/data and, for later stages, build/train_tiny/runs (exports + fla_tuned).
set -uo pipefail
OUT=${OUT:?set by the device tool}
R=${RUNS:-build/train_tiny/runs}
shopt -s nullglob
wheels=(.whl/*.whl .whl/srv/*.whl)  # fla (required); the server's wheels only when TESTS needs them
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)"
mkdir -p "$R/logs"
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-120}" python3 -m pytest -q -x -p no:cacheprovider $TESTS 2>&1 | tail -n 25 | tee "$R/logs/gpu_tests.log"
fi
timeout "${TRAIN_LIMIT_S:-450}" bash tools/train_tiny/gpu_run.sh > "$R/logs/call.log" 2>&1
echo "gpu_run.sh exit $?" >> "$R/logs/call.log"
grep -v '^\[train\] {' "$R/logs/call.log" | tail -n 60
grep '^\[train\] {' "$R/logs/call.log" | tail -n 6
( cd "$R" && find . -path '*/ckpt' -prune -o -type f -print | grep -v '/ckpt/' ) > /tmp/pack.txt
tar czf - -C "$R" -T /tmp/pack.txt | split -b 15m - "$OUT/train_tiny.tgz."
ls -la "$OUT"
