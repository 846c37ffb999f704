#!/usr/bin/env bash
# Issue 20 on one H100 (or H200): prefill's GPU changes checked and timed: the MLA attention's backend
# policy (cuDNN for long prompts without cached context, in length buckets; the flash kernel elsewhere),
# KDA's short convolution through fla's kernel and the MoE combine as one Triton kernel.
# 1. their GPU tests, then the engine-level GPU tests they touch (parity, bf16 graphs vs eager; SPEC=1:
#    speculation's);
# 2. a 32k and an 8 x 4k prefill of the 48B's layers (preset kimi-linear-48b-a3b-8l, which fits 80 GB)
#    under torch.profiler, the torch ops that launched the most GPU time by shape and Python stack;
# 3. DECODE=1: decode of that preset at batch 64 and 1 (mbu_median).
# usage: bash benchmarks/gpu_prefill.sh   (from the repository root; results in $OUT)
set -uo pipefail
. benchmarks/device_setup.sh
bench="python3 benchmarks/h200_bench.py --preset kimi-linear-48b-a3b-8l --skip-transformers"
run_gpu_tests "${TEST_LIMIT:-60}" "tests/ops/test_mla_prefill.py" "tests/ops/test_conv_fla.py" "tests/ops/test_kda_fla.py" \
  "tests/ops/test_moe_combine_triton.py" "tests/ops/test_moe_grouped.py"
timeout 110 $bench --only ceilings,prefill --profile-prefill --gpu-memory-utilization 0.5 --time-budget 90 \
  --out "$logs/h100_8l_prefill_$(date +%F).json" >"$logs/prefill.log" 2>&1
grep -E "prefill|FAILED" "$logs/prefill.log" | grep -v Warn | tail -n 8
run_gpu_tests "${TEST_LIMIT:-120}" "tests/test_parity.py -k gpu"
if [ "${DECODE:-0}" = 1 ]; then  # decode of that preset at batch 64 and 1, for mbu_median
  timeout 150 $bench --only ceilings,decode --decode-batches 64,1 --gpu-memory-utilization 0.7 --time-budget 130 \
    --out "$logs/h100_8l_decode_$(date +%F).json" >"$logs/decode.log" 2>&1
  grep -E "decode B=|FAILED" "$logs/decode.log" | grep -v Warn | tail -n 6
fi
if [ "${SPEC:-1}" = 1 ]; then
  run_gpu_tests "${TEST_LIMIT:-120}" "tests/spec/test_spec_engine.py -k cuda" "tests/spec/test_state_rollback.py -k cuda"
fi
