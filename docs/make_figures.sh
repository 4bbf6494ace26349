#!/usr/bin/env bash
# Regenerates every figure in docs/figures and every number the README and the docs/ pages quote (docs/numbers.md), on the
# current code, offline, on CPU: the two smoke arms (per-run figures, normgeo.report, normgeo.compare), SmolLM2-135M-Instruct (Q4_1) and MiniLM on 100k
# tokens of ../shared/corpora/wikipedia, the quickstart notebook. About 20 minutes on 2 CPU cores.
#
#   bash docs/make_figures.sh [output_root]      # default: outputs/readme (deleted first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/readme}
WIKI=${NORMGEO_SHARED:-../shared}/corpora/wikipedia
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"

for norm in layer rms; do
  python train.py experiment=smoke norm=$norm output_root="$OUT" trainer.enable_progress_bar=false
done
python -m normgeo.report "$OUT/smoke-layer-s0" "$OUT/smoke-rms-s0"
python -m normgeo.compare "$OUT" --formats png,pdf   # before analyze.py writes $OUT/analyze
for model in smollm2-135m minilm; do  # the angles only; the intervention: docs/make_intervention_figures.sh
  python analyze.py model=$model probe=local probe.path="$WIKI" probe.tokens=100000 "probe.intervention=[]" output_root="$OUT" progress=false
done

# The quickstart notebook (docs/notebooks/quickstart.ipynb, committed without outputs) on the smoke rms run
# above, executed into a copy; its figures: docs/figures/notebook-*.png.
cp docs/notebooks/quickstart.ipynb "$OUT/quickstart.ipynb"
NORMGEO_NOTEBOOK_RUN="$(cd "$OUT" && pwd)/smoke-rms-s0" jupyter execute --inplace --timeout=1800 "$OUT/quickstart.ipynb"
python - "$OUT/quickstart.ipynb" docs/figures <<'PY'
import base64, sys, nbformat
cells = nbformat.read(sys.argv[1], as_version=4).cells
images = [o["data"]["image/png"] for c in cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
assert len(images) == 4, len(images)  # records.plot(), the saved null band and mean sources, the run's steps
for name, data in (("layers", images[0]), ("steps", images[3])):  # the two docs/pretrained.md shows
    with open(f"{sys.argv[2]}/notebook-{name}.png", "wb") as handle:
        handle.write(base64.b64decode(data))
PY

fig=docs/figures
cp "$OUT/smoke-layer-s0/figures/layers_normgeo-tiny_layer_step0000100.png" $fig/smoke-layer-layers.png
cp "$OUT/smoke-rms-s0/figures/layers_normgeo-tiny_rms_step0000100.png" $fig/smoke-rms-layers.png
cp "$OUT/smoke-rms-s0/figures/steps_normgeo-tiny_rms_layer1_ln1.in.png" $fig/smoke-rms-steps.png
cp "$OUT/smoke-layer-s0/figures/compare_layer_rms_ln1_ones.png" $fig/smoke-compare-ones.png
cp "$OUT/smoke-rms-s0/figures/null_steps_normgeo-tiny_rms_layer1_ln1.in.png" $fig/smoke-rms-null-steps.png
cp "$OUT/smoke-layer-s0/figures/null_layers_normgeo-tiny_layer_step0000100.png" $fig/smoke-layer-null-layers.png
cp "$OUT/analyze/smollm2-135m-instruct-q4_1/figures/layers_smollm2-135m-instruct-q4_1_rms_pretrained.png" \
  $fig/smollm2-135m-layers.png
cp "$OUT/analyze/smollm2-135m-instruct-q4_1/figures/null_layers_smollm2-135m-instruct-q4_1_rms_pretrained.png" \
  $fig/smollm2-135m-null-layers.png
cp "$OUT/analyze/minilm/figures/null_layers_minilm_layer_pretrained.png" $fig/minilm-null-layers.png
for figure in overlay_ln1.in_ones overlay_ln1.out_ones loss; do
  cp "$OUT/compare/$figure.png" "$fig/compare-$figure.png"
done
{
  python docs/readme_numbers.py "$OUT"
  printf '\n## Compare the arms\n\nnormgeo.compare summary.md:\n\n'
  cat "$OUT/compare/summary.md"
  printf '\nln1 against 1 per arm, step, layer (mean, p05, p95 over the probe tokens):\n\n'
  python - "$OUT" <<'PY'
import json, sys
for arm in ("layer", "rms"):
    for line in open(f"{sys.argv[1]}/smoke-{arm}-s0/angles.jsonl"):
        r = json.loads(line)
        if r["ref"] == "ones" and r["step"] in (0, 100) and r["layer"] in (0, 1) and r["site"].startswith("ln1"):
            print(f"- {arm} step {r['step']} layer {r['layer']} {r['site']}: {r['mean_deg']:.2f} ({r['p05']:.2f}-{r['p95']:.2f})")
PY
} > docs/numbers.md
bash docs/make_factorial_figures.sh "$OUT/factorial"   # the norm factorial and Post-LN (docs/figures/factorial-*.png)
echo "figures in $fig, numbers in docs/numbers.md"
