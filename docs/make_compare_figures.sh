#!/usr/bin/env bash
# The figures and table of README "Compare the arms": the two smoke arms (python train.py -m
# experiment=smoke norm=layer,rms), compared by normgeo.compare; the README's PNGs are copied from it.
#   docs/make_compare_figures.sh [OUTPUT_ROOT]     (default: a fresh temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)/outputs}
python train.py -m experiment=smoke norm=layer,rms output_root="$out" data_root="${NORMGEO_DATA:-data}" \
    trainer.enable_progress_bar=false
python -m normgeo.compare "$out" --formats png,pdf
for figure in overlay_ln1.in_ones overlay_ln1.out_ones loss; do
    cp "$out/compare/$figure.png" "docs/figures/compare-$figure.png"
done
echo "summary table ($out/compare/summary.md):"
cat "$out/compare/summary.md"
