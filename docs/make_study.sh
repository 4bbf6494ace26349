#!/usr/bin/env bash
# The CPU study (docs/study.md): the arms layer and rms with 5 seeds, layer_nobias, rms_bias and dyt with
# 2, each 1,000 optimizer steps on real OpenWebText text with 11 probes (experiment=study_cpu; each probe
# also runs the centering intervention, intervention.jsonl), then normgeo.compare with its verdict, then
# docs/study.md and its figures. About 40 minutes on 2 idle CPU cores.
#
#   bash docs/make_study.sh [output_root] [webtext_path] [probe_path]
#   # defaults: outputs/study (deleted first), ../shared/corpora/webtext, ../shared/corpora/wikipedia
#   STUDY_OVERRIDES="max_steps=4 optim.warmup_steps=0 checkpoint.steps=[2,4] val_every=2" bash docs/make_study.sh /tmp/s  # a dry run
# Runs go seed by seed, each seed's arms back to back, so that a pair's tokens/s see the same machine load.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/study}
WEBTEXT=${2:-${NORMGEO_SHARED:-../shared}/corpora/webtext}
PROBE=${3:-${NORMGEO_SHARED:-../shared}/corpora/wikipedia}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
COMMON=(experiment=study_cpu data.source.path="$WEBTEXT" probe.path="$PROBE" output_root="$OUT"
        data_root="$OUT/data" trainer.enable_progress_bar=false ${STUDY_OVERRIDES:-})
COMMANDS=(
  "python -m corpus data=local data.source.path=$WEBTEXT data_root=$OUT/data"
  "python train.py -m seed=0,1 norm=layer,rms,layer_nobias,rms_bias,dyt ${COMMON[*]}"
  "python train.py -m seed=2,3,4 norm=layer,rms ${COMMON[*]}"
  "python -m normgeo.compare $OUT --formats png"
)
printf '%s\n' "${COMMANDS[@]}" > "$OUT/commands.txt"
for command in "${COMMANDS[@]}"; do
  echo "+ $command"
  $command
done
end=$(date +%s)
echo "$((end - start))" > "$OUT/wall_s.txt"
du -sb "$OUT" | cut -f1 > "$OUT/disk_bytes.txt"
python docs/study_page.py "$OUT" > docs/study.md
echo "study: $((end - start)) s; docs/study.md and docs/figures/study-*.png written"
