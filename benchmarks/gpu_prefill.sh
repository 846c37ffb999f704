#!/usr/bin/env bash
# Issue 20 on one H100 (or H200): prefill's GPU changes checked and timed: the MLA attention's backend
# policy (cuDNN for long prompts without cached context, in length buckets; the flash kernel elsewhere),
# KDA's short convolution through fla's kernel and the MoE combine as one Triton kernel.
# Parts, run in the order PARTS names them (comma-separated; default ops,prefill,parity,decode,spec), so the
# whole fits two device calls when one is too short, and the checks can come before the timings:
# - ops: their GPU tests, and one MLA layer's chunk after up to 1M tokens of cached context in pieces and
#   in one pass (benchmarks/gpu_checks/mla_long_context_prefill.py);
# - prefill: a 32k and an 8 x 4k prefill of the 48B's layers (preset kimi-linear-48b-a3b-8l, which fits
#   80 GB) under torch.profiler, the torch ops that launched the most GPU time by shape and Python stack;
# - parity: the engine-level GPU tests (parity, bf16 graphs vs eager);
# - decode: decode of that preset at batch 64 and 1 (mbu_median);
# - spec: speculation's GPU tests (the rejection metadata, state rollback).
# usage: PARTS=ops,parity,spec,prefill bash benchmarks/gpu_prefill.sh   (from the repository root; results in $OUT)
set -uo pipefail
. benchmarks/device_setup.sh
bench="python3 benchmarks/h200_bench.py --preset kimi-linear-48b-a3b-8l --skip-transformers"
parts=${PARTS:-ops,prefill,parity,decode,spec}
part_ops() {
  run_gpu_tests "${TEST_LIMIT:-60}" "tests/ops/test_mla_prefill.py" "tests/ops/test_conv_fla.py" "tests/ops/test_kda_fla.py" \
    "tests/ops/test_moe_combine_triton.py" "tests/ops/test_moe_grouped.py" "tests/ops/test_activation_triton.py"
  # one MLA layer's chunk after up to 1M tokens of context: in pieces against one pass (time, peak memory)
  timeout 150 python3 benchmarks/gpu_checks/mla_long_context_prefill.py 2>&1 | tail -n 8
}
part_prefill() {
  timeout 110 $bench --only ceilings,prefill --profile-prefill --gpu-memory-utilization 0.5 --time-budget 90 \
    --out "$logs/h100_8l_prefill_$(date +%F).json" >"$logs/prefill.log" 2>&1
  grep -E "prefill|FAILED" "$logs/prefill.log" | grep -v Warn | tail -n 8
}
part_parity() { run_gpu_tests "${TEST_LIMIT:-120}" "tests/test_parity.py -k gpu"; }
part_decode() {  # decode of that preset at batch 64 and 1, for mbu_median
  timeout 150 $bench --only ceilings,decode --decode-batches 64,1 --gpu-memory-utilization 0.7 --time-budget 130 \
    --out "$logs/h100_8l_decode_$(date +%F).json" >"$logs/decode.log" 2>&1
  grep -E "decode B=|FAILED" "$logs/decode.log" | grep -v Warn | tail -n 6
}
part_spec() {
  run_gpu_tests "${TEST_LIMIT:-120}" "tests/spec/test_spec_engine.py -k cuda" "tests/spec/test_state_rollback.py -k cuda"
}
for name in ${parts//,/ }; do  # in the order given
  declare -F "part_$name" >/dev/null || { echo "PARTS: no part $name (ops, prefill, parity, decode, spec)"; exit 2; }
  echo "== part $name"
  "part_$name"
done
