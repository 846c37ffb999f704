#!/usr/bin/env bash
# P/D disaggregation on one GPU (issue 17): the carried wheels (.whl: fla, pyzmq and nixl-cu13 with its
# expert-parallel extension left out to fit the carry limit), the GPU P/D tests (NIXL over VRAM, staging
# streams), then the KV wait per request of a producer and a consumer whose ranks are processes on the
# one GPU, caches registered as VRAM. Logs and the result JSON go to $OUT.
#   bash benchmarks/gpu_pd.sh [prompt lens, default 8192,65536] [repeats, default 3,2]
set -uo pipefail
. benchmarks/device_setup.sh
python3 - <<'EOF'
import torch, triton, transformers
from deltaserve.kv_transfer import available_backends
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers",
      transformers.__version__, "transfer backends", available_backends())
EOF
timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider -s -rfEs tests/kv_transfer/test_pd_gpu.py \
  >"$logs/test_pd_gpu.log" 2>&1
echo "== tests/kv_transfer/test_pd_gpu.py rc=$?"
grep -E "passed|failed|FAILED|ERROR|Error" "$logs/test_pd_gpu.log" | tail -n 15
cd benchmarks
timeout "${BENCH_LIMIT:-300}" python3 pd_kv_wait.py --backends nixl --layouts tp1_to_tp1 --device cuda \
  --dtype bfloat16 --preset small --ranks-in-processes --prompt-lens "${1:-8192,65536}" --repeats "${2:-3,2}" \
  --prefill-budget 8192 --cache-memory 8GiB --note "H200, both engines' ranks as processes on the one GPU" \
  --out "$logs/pd_kv_wait_$(date +%F)_cuda.json" >"$logs/pd_kv_wait.log" 2>&1
echo "== pd_kv_wait rc=$?"
grep -v -E "NIXL INFO|transfer_metadata" "$logs/pd_kv_wait.log" | tail -n 25
