#!/usr/bin/env bash
# Issues 19 and 20 on the device, after gpu_verify_graphs.sh: speculation's tokens/s in bfloat16 (verify graphs
# on) on the trained default models, then kernels per decode step with the input projections fused and not.
set -uo pipefail
. benchmarks/device_setup.sh
dest=${OUT:-$PWD/benchmarks/results}
cd benchmarks
timeout "${GAIN_LIMIT:-300}" python3 spec_acceptance.py --batches 1,16 --k 3 --dtype bfloat16 \
  --out "$dest/spec_acceptance_bf16.json" 2>&1 | grep -v Warning | tail -n 20
echo "== acceptance rc=$?"
timeout "${KERNELS_LIMIT:-240}" python3 decode_kernel_count.py --preset "${PRESET:-small}" --batches 1,64 \
  --context 2048 --out "$dest/decode_kernel_count.json" 2>&1 | grep -v Warning | tail -n 32
echo "== kernel count rc=$?"
