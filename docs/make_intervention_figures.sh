#!/usr/bin/env bash
# The centering intervention on two real pretrained models, offline, on CPU (docs/pretrained.md): SmolLM2-135M-Instruct
# (RMSNorm: the centering added) and all-MiniLM-L6-v2 (LayerNorm: the centering removed), on Wikipedia text, with every
# scope (all norms at once, one block at a time, one site class at a time). Writes docs/figures/*-intervention.png and
# docs/intervention_numbers.md. SmolLM2 makes 1 + 35 forwards over its tokens, the 31 per-block ones resumed at their block.
#
#   bash docs/make_intervention_figures.sh [output_root]      # default: outputs/intervention (deleted first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/intervention}
WIKI=${NORMGEO_SHARED:-../shared}/corpora/wikipedia
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"
SCOPES='probe.intervention=[all,layers,site_classes]'
# SmolLM2: 16 windows of 256 tokens (the intervals are over probe windows); MiniLM: 20,000 tokens in windows of 512.
python analyze.py model=smollm2-135m probe=local probe.path="$WIKI" probe.tokens=4096 model.seq_len=256 "$SCOPES" \
  output_root="$OUT" progress=false
python analyze.py model=minilm probe=local probe.path="$WIKI" probe.tokens=20000 probe.intervention_tokens=20000 "$SCOPES" \
  output_root="$OUT" progress=false
cp "$OUT/analyze/smollm2-135m-instruct-q4_1/figures/intervention_smollm2-135m-instruct-q4_1_rms_pretrained.png" \
  docs/figures/smollm2-135m-intervention.png
cp "$OUT/analyze/minilm/figures/intervention_minilm_layer_pretrained.png" docs/figures/minilm-intervention.png
python docs/intervention_numbers.py "$OUT/analyze/smollm2-135m-instruct-q4_1" "$OUT/analyze/minilm" > docs/intervention_numbers.md
echo "figures in docs/figures/*-intervention.png, numbers in docs/intervention_numbers.md"
