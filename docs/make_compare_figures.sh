#!/usr/bin/env bash
# The README's smoke figures and table ("Reading the figures", "Compare the arms"): the two smoke arms
# (python train.py -m experiment=smoke norm=layer,rms), their per-run figures, normgeo.report's side by
# side figure and normgeo.compare; the README's PNGs are copied from them into docs/figures/.
#   docs/make_compare_figures.sh [OUTPUT_ROOT]     (default: a fresh temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)/outputs}
python train.py -m experiment=smoke norm=layer,rms output_root="$out" data_root="${NORMGEO_DATA:-data}" \
    trainer.enable_progress_bar=false
python -m normgeo.report "$out/smoke-layer-s0" "$out/smoke-rms-s0" --out "$out/report"
python -m normgeo.compare "$out" --formats png,pdf
cp "$out/smoke-layer-s0/figures/layers_normgeo-tiny_layer_step0000100.png" docs/figures/smoke-layer-layers.png
cp "$out/smoke-rms-s0/figures/layers_normgeo-tiny_rms_step0000100.png" docs/figures/smoke-rms-layers.png
cp "$out/smoke-rms-s0/figures/steps_normgeo-tiny_rms_layer1_ln1.in.png" docs/figures/smoke-rms-steps.png
cp "$out/report/compare_layer_rms_ln1_ones.png" docs/figures/smoke-compare-ones.png
for figure in overlay_ln1.in_ones overlay_ln1.out_ones loss; do
    cp "$out/compare/$figure.png" "docs/figures/compare-$figure.png"
done
echo "summary table ($out/compare/summary.md):"
cat "$out/compare/summary.md"
python - "$out" <<'PY'
# The numbers quoted in the README text, from the runs' own records.
import json, sys
for arm in ("layer", "rms"):
    for line in open(f"{sys.argv[1]}/smoke-{arm}-s0/angles.jsonl"):
        r = json.loads(line)
        if r["ref"] == "ones" and r["step"] in (0, 100) and r["layer"] in (0, 1) and r["site"].startswith("ln1"):
            print(arm, r["step"], r["layer"], r["site"], r["mean_deg"], r["std_deg"], r["p05"], r["p95"])
PY
