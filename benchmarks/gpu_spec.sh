#!/usr/bin/env bash
# Issue 19 on the device: the verify-step cost on the 48B shape (needs an H200), then acceptance and tok/s
# of each method on the trained default models, results in $OUT (or benchmarks/results).
set -uo pipefail
. benchmarks/device_setup.sh
dest=${OUT:-$PWD/benchmarks/results}
cd benchmarks
timeout "${COST_LIMIT:-330}" python3 spec_verify_cost.py --model "${MODEL:-random:kimi-linear-48b-a3b}" \
  --batches "${BATCHES:-1,16,64}" --context "${CONTEXT:-4096}" --steps 24 --warmup 4 \
  --out "$dest/spec_verify_cost.json" 2>&1 | grep -v Warning | tail -n 16
echo "== verify cost rc=$?"
timeout "${GAIN_LIMIT:-200}" python3 spec_acceptance.py --batches 1,16 --k 3 --dtype float32 \
  --out "$dest/spec_acceptance.json" 2>&1 | grep -v Warning | tail -n 20
echo "== acceptance rc=$?"
