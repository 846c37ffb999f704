#!/usr/bin/env bash
# Issue 19 on the device: the Eagle3 drafter's time per step after its masked attention was kept off cuDNN,
# then bf16 tokens/s of eagle3 (and the baseline) on the trained default models, then the spec GPU tests.
set -uo pipefail
. benchmarks/device_setup.sh
dest=${OUT:-$PWD/benchmarks/results}
cd benchmarks
timeout "${DRAFT_LIMIT:-120}" python3 eagle3_draft_time.py --dtype bfloat16 --batches 1,16 \
  --out "$dest/eagle3_draft_time.json" 2>&1 | grep -v Warning | tail -n 8
echo "== draft time rc=$?"
timeout "${GAIN_LIMIT:-200}" python3 spec_acceptance.py --batches 1,16 --k 3 --dtype bfloat16 \
  --methods "${METHODS:-off,eagle3}" --out "$dest/spec_acceptance_bf16.json" 2>&1 | grep -v Warning | tail -n 12
echo "== acceptance rc=$?"
cd ..
run_gpu_tests "${PER_FILE_LIMIT:-300}" "tests/spec/test_spec_engine.py -k cuda" "tests/test_parity.py -k graph_replay"
