#!/usr/bin/env bash
# The GPU tests on the device: install the carried wheels (.whl: fla; .whl/srv: the server's),
# then run each test file given as an argument (default: every GPU test) in its own pytest with
# its own time limit, printing each file's summary as it ends and keeping the full logs in $OUT
# (a single pytest over every file ran past the device's per-call limit with nothing printed).
set -uo pipefail
. benchmarks/device_setup.sh
per_file_limit=${PER_FILE_LIMIT:-150}
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)"
if [ $# -eq 0 ]; then
  set -- tests/test_parity.py tests/distributed/test_multiproc_gpu.py tests/test_accuracy_gate.py \
    tests/test_prompt_logprobs.py tests/worker/test_model_runner.py tests/kv_transfer/test_pd_gpu.py \
    tests/offload/test_rank_store.py tests/offload/test_offload_engine.py tests/spec/test_state_rollback.py \
    tests/spec/test_spec_engine.py tests/ops/test_mla_prefill.py tests/ops/test_conv_fla.py \
    tests/ops/test_moe_combine_triton.py
fi
for test_file in "$@"; do
  log="$logs/$(basename "$test_file" .py).log"
  # only the GPU tests: the CPU tests of these files run transformers, which fla's import breaks on CPU tensors
  timeout "$per_file_limit" python3 -m pytest -q -p no:cacheprovider -s -rfEs --durations=3 -k "gpu or cuda" \
    "$test_file" >"$log" 2>&1
  echo "== $test_file rc=$?"
  grep -E "agreeing|divergence|accuracy gate|FAILED|ERROR" "$log" | head -n 20
  tail -n 2 "$log"
done
