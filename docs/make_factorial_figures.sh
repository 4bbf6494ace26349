#!/usr/bin/env bash
# The norm factorial's figures (docs/probe.md) from real runs: the smoke experiment, shortened to 30 steps (probes at
# 0, 10, 20, 30; 2,048 probe tokens), for the four norms under Pre-LN and LayerNorm/RMSNorm under Post-LN,
# then normgeo.report on the four Pre-LN arms and normgeo.compare on all six. A few minutes on 2 CPU cores.
# Called by docs/make_figures.sh; alone:
#
#   bash docs/make_factorial_figures.sh [output_root]      # default: outputs/factorial (deleted first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/factorial}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"
SHORT=(max_steps=30 checkpoint.dense_every=10 checkpoint.last_every=30 val_every=15 val_sequences=8
       probe.tokens=2048 probe.bootstrap.replicates=200 output_root="$OUT" trainer.enable_progress_bar=false)

for norm in layer layer_nobias rms rms_bias; do
  python train.py experiment=smoke norm=$norm placement=pre "${SHORT[@]}"
done
for norm in layer rms; do
  python train.py experiment=smoke norm=$norm placement=post "${SHORT[@]}"
done
python -m normgeo.report "$OUT"/smoke-{layer,layer_nobias,rms,rms_bias}-s0 --out "$OUT/report"
python -m normgeo.compare "$OUT" --formats png

fig=docs/figures
for figure in ellipsoid energy factorial_ones; do
  cp "$OUT/compare/$figure.png" "$fig/factorial-$figure.png"
done
python docs/factorial_numbers.py "$OUT" > docs/factorial_numbers.md  # the numbers docs/probe.md quotes
echo "factorial figures in $fig (factorial-*.png), numbers in docs/factorial_numbers.md"
