#!/usr/bin/env bash
# Issue 20 on one H100 (or H200): prefill's GPU changes checked and timed: the MLA attention's backend
# policy (cuDNN for long prompts without cached context, in length buckets; the flash kernel elsewhere) and
# KDA's short convolution through fla's kernel.
# 1. their GPU tests; the engine-level GPU tests they touch (parity, bf16 graphs vs eager, speculation) last;
# 2. a 32k and an 8 x 4k prefill of the 48B's layers (preset kimi-linear-48b-a3b-8l, which fits 80 GB)
#    under torch.profiler, the torch ops that launched the most GPU time by shape and Python stack;
# 3. DECODE_CHECK=1: decode at batch 256 on that preset with most of the GPU's memory as cache, with
#    CUDA_LAUNCH_BLOCKING=1 and no CUDA graphs, for the traceback of an index assertion seen there.
# usage: bash benchmarks/gpu_prefill.sh   (from the repository root; results in $OUT)
set -uo pipefail
. benchmarks/device_setup.sh
bench="python3 benchmarks/h200_bench.py --preset kimi-linear-48b-a3b-8l --skip-transformers"
run_gpu_tests "${TEST_LIMIT:-60}" "tests/ops/test_mla_prefill.py" "tests/ops/test_conv_fla.py" "tests/ops/test_kda_fla.py"
timeout 110 $bench --only ceilings,prefill --profile-prefill --gpu-memory-utilization 0.5 --time-budget 90 \
  --out "$logs/h100_8l_prefill_$(date +%F).json" >"$logs/prefill.log" 2>&1
grep -E "prefill|FAILED" "$logs/prefill.log" | grep -v Warn | tail -n 8
run_gpu_tests "${TEST_LIMIT:-120}" "tests/test_parity.py -k gpu"
if [ "${DECODE_CHECK:-1}" = 1 ]; then
  CUDA_LAUNCH_BLOCKING=1 timeout 120 $bench --only decode --decode-batches 256 --gpu-memory-utilization 0.7 --enforce-eager \
    --time-budget 100 --out "$logs/h100_8l_decode_check.json" >"$logs/decode_check.log" 2>&1
  echo "== decode check rc=$?"
  grep -v Warn "$logs/decode_check.log" | grep -E -A40 "Traceback" | grep -E "File|Error|error" | head -n 30
  grep -E "decode B=|done in" "$logs/decode_check.log" | tail -n 4
fi
run_gpu_tests "${TEST_LIMIT:-120}" "tests/spec/test_spec_engine.py -k cuda" "tests/spec/test_state_rollback.py -k cuda"
