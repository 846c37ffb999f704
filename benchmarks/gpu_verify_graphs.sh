#!/usr/bin/env bash
# Issues 19 and 20 on the device: the verify-graph and graph-replay GPU tests (fla autotunes each tiny shape
# on a fresh machine: minutes per file), then the verify-step cost
# with verify graphs against eager verify (MODEL, default random:small, fits an H100), results in $OUT.
set -uo pipefail
. benchmarks/device_setup.sh
dest=${OUT:-$PWD/benchmarks/results}
run_gpu_tests "${PER_FILE_LIMIT:-330}" "tests/spec/test_spec_engine.py -k cuda" \
  "tests/spec/test_state_rollback.py -k cuda" "tests/test_parity.py -k graph_replay"
cd benchmarks
timeout "${COST_LIMIT:-240}" python3 spec_verify_cost.py --model "${MODEL:-random:small}" --batches "${BATCHES:-1,16,64}" \
  --ks "${KS:-0,1,3}" --context "${CONTEXT:-2048}" --steps 24 --warmup 4 --cache-memory "${CACHE_MEMORY:-8GiB}" --out "$dest/spec_verify_cost.json" 2>&1 \
  | grep -v Warning | tail -n 14
echo "== verify cost rc=$?"
