#!/usr/bin/env bash
# Export and evaluate a study tree (docs/export.md): build the offline task wiki_next_sentence from
# ../shared/corpora/wikipedia, export every run's last checkpoint as a Hugging Face directory
# (<root>/exported/<run>), score every run with lm-evaluation-harness (<run>/eval.json), rerun the comparison
# so that the verdict has the downstream contrasts.
#
#   bash docs/export_study.sh [study_root] [examples]      # defaults: outputs/study, 500
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/study}
EXAMPLES=${2:-500}
SHARED=${NORMGEO_SHARED:-../shared}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-$SHARED/tiktoken} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
mapfile -t RUNS < <(find "$OUT" -mindepth 1 -maxdepth 1 -type d -exec test -d '{}/checkpoints' ';' -print | sort)
if [ "${#RUNS[@]}" -eq 0 ]; then
  echo "error: $OUT holds no run directories with checkpoints (train the study first: bash docs/make_study.sh)" >&2
  exit 2
fi
start=$(date +%s)
COMMANDS=(
  "python -m normgeo.evaluate --make-task $OUT/tasks --corpus $SHARED/corpora/wikipedia/enwiki-wikiextractor --examples $EXAMPLES"
  "python -m normgeo.export <run> --to hf --out $OUT/exported/<run>   # each run"
  "python -m normgeo.evaluate $OUT/<run>... --tasks wiki_next_sentence --include-path $OUT/tasks"
  "python -m normgeo.compare $OUT --formats png"
)
# Added to the study's commands (docs/study.md lists them), once.
if [ -f "$OUT/commands.txt" ] && ! grep -q "normgeo.evaluate" "$OUT/commands.txt"; then
  printf '%s\n' "${COMMANDS[@]}" >> "$OUT/commands.txt"
fi
python -m normgeo.evaluate --make-task "$OUT/tasks" --corpus "$SHARED/corpora/wikipedia/enwiki-wikiextractor" \
  --examples "$EXAMPLES"
rm -rf "$OUT/exported"
for run in "${RUNS[@]}"; do
  python -m normgeo.export "$run" --to hf --out "$OUT/exported/$(basename "$run")"
done
python -m normgeo.evaluate "${RUNS[@]}" --tasks wiki_next_sentence --include-path "$OUT/tasks"
python -m normgeo.compare "$OUT" --formats png
end=$(date +%s)
echo "$((end - start))" > "$OUT/export_eval_wall_s.txt"
echo "exported and evaluated ${#RUNS[@]} runs in $((end - start)) s: $OUT/exported, <run>/eval.json, $OUT/compare/verdict.md"
