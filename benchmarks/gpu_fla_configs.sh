#!/usr/bin/env bash
# Issue 20 on the device: a fresh process's startup for the shapes one card runs (the trained default target
# and draft, random:small; the 48B shape where it fits), in MODE=tune (an empty fla config dir: every kernel
# autotunes; the chosen configs are packed into $OUT/fla_configs.tar, to unpack into a scratch directory and
# merge into deltaserve/ops/kda/fla_tuned/ with benchmarks/merge_fla_configs.py) or MODE=shipped (what a
# user gets: the kernels still autotuned are listed).
# usage: MODE=tune bash benchmarks/gpu_fla_configs.sh   (from the repository root)
set -uo pipefail
. benchmarks/device_setup.sh
dest=${OUT:-$PWD/benchmarks/results}
mode=${MODE:-shipped}
dump=/tmp/fla_dump
rm -rf "$dump"
trained=$PWD/deltaserve/model_files/trained
for model in ${MODELS:-$trained/target $trained/draft random:small}; do
  name=$(basename "$model" | tr ':' '_')
  extra=()
  [ "$mode" = tune ] && extra=(--dump-dir "$dump")
  timeout "${PER_MODEL_LIMIT:-170}" python3 benchmarks/startup_time.py --model "$model" --modes "$mode" \
    --prompt-len "${PROMPT_LEN:-2048}" --timeout "${PER_MODEL_LIMIT:-170}" "${extra[@]}" \
    --out "$dest/startup_${mode}_$name.json" 2>&1 | grep -v Warning | tail -n 1
  echo "== $mode $name rc=$?"
done
if [ "$mode" = tune ] && [ -d "$dump" ]; then
  tar -C "$dump" -cf "$dest/fla_configs.tar" . && tar -tf "$dest/fla_configs.tar"
fi
