#!/usr/bin/env bash
# Where the mean lives in two real pretrained models, offline, on CPU: SmolLM2-135M-Instruct (RMSNorm) and
# all-MiniLM-L6-v2 (LayerNorm), on Wikipedia text, with the centering intervention on all norms at once.
# Writes docs/mean_sources.md (docs/mean_sources_page.py) and docs/figures/mean_sources_*.png. The page's
# training runs (their last probed step) are the study's seed-0 LayerNorm and RMSNorm arms (experiment=study_cpu,
# as docs/make_study.sh trains them), trained here side by side on one core each; run folders given after
# the output root (an earlier study's) are used instead.
#
# CPU time (one thread each): SmolLM2's analysis about 12 minutes (its probe: 54 forwards of 8 x 256 tokens),
# MiniLM's 1, each training arm about 10; on a 2-core machine shared with other jobs, under nice, the whole
# script took about 70 minutes.
#
#   bash docs/make_mean_sources.sh [output_root] [run_dir ...]     # default: outputs/mean_sources (deleted first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/mean_sources}
shift || true
WIKI=${NORMGEO_SHARED:-../shared}/corpora/wikipedia
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"
RUNS=("$@")
if [ ${#RUNS[@]} -eq 0 ]; then
  WEBTEXT=${NORMGEO_SHARED:-../shared}/corpora/webtext
  python -m corpus data=local data.source.path="$WEBTEXT" data_root="$OUT/data"
  pids=()
  for arm in layer rms; do
    OMP_NUM_THREADS=1 python train.py experiment=study_cpu seed=0 norm=$arm data.source.path="$WEBTEXT" \
      probe.path="$WIKI" output_root="$OUT/study" data_root="$OUT/data" trainer.enable_progress_bar=false &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # each run's failure stops the script
  RUNS=("$OUT/study/study-layer-s0" "$OUT/study/study-rms-s0")
fi
# SmolLM2: 400 windows of 256 tokens (102,400 tokens, as docs/pretrained.md's 100k); MiniLM: 100 windows of 512
# (51,200 tokens, the intervention on the first 20,000 as docs/make_intervention_figures.sh). analyze.py cuts
# each document to its first probe.max_doc_tokens=1024 tokens (conf/analyze/analyze.yaml), so the probes span
# at least 100 and 50 documents, over which the shares' intervals resample (the page says how many).
python analyze.py model=smollm2-135m probe=local probe.path="$WIKI" probe.tokens=102400 model.seq_len=256 \
  output_root="$OUT" progress=false
python analyze.py model=minilm probe=local probe.path="$WIKI" probe.tokens=51200 probe.intervention_tokens=20000 \
  output_root="$OUT" progress=false
SMOL="$OUT/analyze/smollm2-135m-instruct-q4_1"
MINI="$OUT/analyze/minilm"
cp "$SMOL"/figures/mean_sources_*.png "$MINI"/figures/mean_sources_*.png docs/figures/
python docs/mean_sources_page.py "$SMOL" "$MINI" "${RUNS[@]}" > docs/mean_sources.md
echo "page: docs/mean_sources.md"
