#!/usr/bin/env bash
# The GPU tests on the device (one H200): install the carried wheels (.whl: fla; .whl/srv: the
# server's), then run the test files given as arguments (default: every GPU test that changed
# recently), printing pytest's summary and the parity tests' token agreement.
set -uo pipefail
shopt -s nullglob
wheels=(.whl/*.whl .whl/srv/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)"
if [ $# -eq 0 ]; then
  # only the GPU tests of these files: their CPU tests run transformers, which fla's import breaks on CPU tensors
  set -- -k "gpu or cuda" tests/test_parity.py tests/test_prompt_logprobs.py tests/worker/test_model_runner.py \
    tests/distributed/test_multiproc_gpu.py tests/test_accuracy_gate.py
fi
python3 -m pytest -q -p no:cacheprovider -s -rfEs --durations=10 "$@" 2>&1 \
  | grep -E "agreeing|divergence|accuracy gate|passed|failed|FAILED|ERROR|Error|SKIPPED|s (call|setup)" | tail -n 80
