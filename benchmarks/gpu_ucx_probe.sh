#!/usr/bin/env bash
# Which UCX transports NIXL's VRAM reads take between two processes on one GPU, and the KV wait under
# each UCX_TLS choice (issue 17: the first GPU run moved 0.38 GiB/s).
set -uo pipefail
. benchmarks/device_setup.sh
cd benchmarks
for tls in default "cuda_ipc,cuda_copy,sm,self" ; do
  tag=${tls//,/_}
  if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
  UCX_LOG_LEVEL=info timeout "${PROBE_LIMIT:-100}" python3 pd_kv_wait.py --backends nixl --layouts tp1_to_tp1 \
    --device cuda --dtype bfloat16 --preset small --ranks-in-processes --prompt-lens 8192 --repeats 2 \
    --prefill-budget 8192 --cache-memory 2GiB --note "UCX_TLS=$tls" --out "$logs/pd_ucx_$tag.json" \
    >"$logs/pd_ucx_$tag.log" 2>&1
  echo "== UCX_TLS=$tls rc=$?"
  grep -i -E "ucp_context|transport|tls|selected|lane" "$logs/pd_ucx_$tag.log" | sort | uniq -c | sort -rn | head -n 8
  grep -E "^nixl +tp1_to_tp1 +8192 +[0-9]" "$logs/pd_ucx_$tag.log" | tail -n 1
done
