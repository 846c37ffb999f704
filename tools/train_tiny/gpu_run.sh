#!/usr/bin/env bash
# The whole GPU recipe in one command: target, draft, Eagle3 head, evaluation, results packed into $OUT.
# Every stage passes --resume, so running this script again on the same (warm) machine continues a
# stage that a budget paused and re-exports the finished ones. Budgets are seconds of training steps
# (TARGET_S, DRAFT_S, EAGLE_S); each stage also stops, with a checkpoint, after its budget plus
# STAGE_SLACK_S of wall time (model build, kernel compilation, evaluation, export).
# The other variables exist for CPU proofs: TARGET_MODEL=micro DRAFT_MODEL=micro BATCH=4 SEQ=64 ...
set -euo pipefail
D=${DATA:-build/train_tiny/data}
R=${RUNS:-build/train_tiny/runs}
OUT=${OUT:-$R/out}
TARGET_S=${TARGET_S:-180}
DRAFT_S=${DRAFT_S:-60}
EAGLE_S=${EAGLE_S:-60}
SLACK=${STAGE_SLACK_S:-60}
TARGET_MODEL=${TARGET_MODEL:-target}
DRAFT_MODEL=${DRAFT_MODEL:-draft}
BATCH=${BATCH:-16}
SEQ=${SEQ:-512}
EVAL_EVERY=${EVAL_EVERY:-200}
# the stages this call runs, in order (a device call of under 10 minutes may run only some of them)
STAGES=" ${STAGES:-target draft eagle3 evaluate} "
WINDOWS=()
if [ -n "${MAX_WINDOWS:-}" ]; then WINDOWS=(--eval-windows "$MAX_WINDOWS"); fi
export PYTHONUNBUFFERED=1
# fla autotunes each Triton kernel on first use (minutes on a fresh process); every stage reads and
# adds to one directory of chosen configs, so a resumed or later stage does not tune again
export FLA_CONFIG_DIR=${FLA_CONFIG_DIR:-$R/fla_tuned} FLA_CACHE_MODE=${FLA_CACHE_MODE:-strict}
mkdir -p "$R/logs" "$OUT"
common=(--data "$D" --batch-size "$BATCH" --seq-len "$SEQ" --eval-every "$EVAL_EVERY" --ckpt-every 500 --log-every 50
        --resume "${WINDOWS[@]}")
stage_done() {
  python3 -c "import json,sys; sys.exit(json.load(open(sys.argv[1]))['status'] != 'done')" "$1/summary.json" \
    || { echo "stage $1 paused by its budget: run this script again to continue"; exit 3; }
}

has() { [[ "$STAGES" == *" $1 "* ]]; }

if has target; then
python3 -m tools.train_tiny train "${common[@]}" --out "$R/target" --model "$TARGET_MODEL" --lr 1.5e-3 \
  --warmup-steps 100 --max-epochs 8 --train-seconds "$TARGET_S" --stop-after-seconds $((TARGET_S + SLACK)) \
  2>&1 | tee -a "$R/logs/target.log"
stage_done "$R/target"
fi
if has draft; then
python3 -m tools.train_tiny train "${common[@]}" --out "$R/draft" --model "$DRAFT_MODEL" --lr 2e-3 \
  --warmup-steps 50 --max-epochs 8 --train-seconds "$DRAFT_S" --stop-after-seconds $((DRAFT_S + SLACK)) \
  2>&1 | tee -a "$R/logs/draft.log"
stage_done "$R/draft"
fi
if has eagle3; then
python3 -m tools.train_tiny eagle3 "${common[@]}" --target "$R/target/export" --out "$R/eagle3" --ttt-steps 3 \
  --lr 1e-3 --warmup-steps 50 --max-epochs 3 --train-seconds "$EAGLE_S" --stop-after-seconds $((EAGLE_S + SLACK)) \
  2>&1 | tee -a "$R/logs/eagle3.log"
stage_done "$R/eagle3"
fi
has evaluate || exit 0
EVAL_WINDOWS=()
if [ -n "${MAX_WINDOWS:-}" ]; then EVAL_WINDOWS=(--max-windows "$MAX_WINDOWS"); fi
python3 -m tools.train_tiny evaluate --data "$D" --model "$R/target/export" --draft "$R/draft/export" \
  --eagle3 "$R/eagle3" --seq-len "$SEQ" --batch-size "$BATCH" --out "$R/eval.json" "${EVAL_WINDOWS[@]}" \
  2>&1 | tee -a "$R/logs/eval.log"
cp "$R/eval.json" "$OUT/eval.json"
# at most 8 files of 16 MiB come back from the device: one tarball, cut into 15 MiB parts
rm -f "$OUT"/tiny_models.tgz.*
tar czf - -C "$R" logs eval.json target/export target/loss_curve.csv target/summary.json draft/export \
  draft/loss_curve.csv draft/summary.json eagle3/export eagle3/loss_curve.csv eagle3/summary.json \
  | split -b 15m - "$OUT/tiny_models.tgz."
ls -la "$OUT"
