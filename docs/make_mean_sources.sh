#!/usr/bin/env bash
# Where the mean lives in two real pretrained models, offline, on CPU: SmolLM2-135M-Instruct (RMSNorm) and
# all-MiniLM-L6-v2 (LayerNorm), on Wikipedia text, with the centering intervention on all norms at once.
# Writes docs/mean_sources.md (docs/mean_sources_page.py) and docs/figures/mean_sources_*.png; training runs'
# folders given after the output root are added to the page (their last probed step).
#
#   bash docs/make_mean_sources.sh [output_root] [run_dir ...]     # default: outputs/mean_sources (deleted first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/mean_sources}
shift || true
WIKI=${NORMGEO_SHARED:-../shared}/corpora/wikipedia
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"
# SmolLM2: 16 windows of 256 tokens; MiniLM: 20,000 tokens in windows of 512 (as docs/make_intervention_figures.sh).
python analyze.py model=smollm2-135m probe=local probe.path="$WIKI" probe.tokens=4096 model.seq_len=256 \
  output_root="$OUT" progress=false
python analyze.py model=minilm probe=local probe.path="$WIKI" probe.tokens=20000 probe.intervention_tokens=20000 \
  output_root="$OUT" progress=false
SMOL="$OUT/analyze/smollm2-135m-instruct-q4_1"
MINI="$OUT/analyze/minilm"
cp "$SMOL"/figures/mean_sources_*.png "$MINI"/figures/mean_sources_*.png docs/figures/
python docs/mean_sources_page.py "$SMOL" "$MINI" "$@" > docs/mean_sources.md
echo "page: docs/mean_sources.md"
