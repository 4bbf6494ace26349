#!/usr/bin/env bash
# The variance pilot of the CPU study (issue 32): where the SD of LayerNorm − RMSNorm validation loss comes from.
# Both arms, the study preset without probes (experiment=study_cpu probe.enabled=false), trained for:
#   initial weights       seed = 0 .. K-1, data.seed = 0, threads = 1
#   batch order           seed = 0, data.seed = 1 .. K-1, threads = 1
#   floating-point order  seed = 0 .. F-1, data.seed = 0, threads = 2 (the same runs, another thread count)
# then `python -m normgeo.pilot` splits the paired SD (adding the validation sample: the base pair's checkpoints
# scored on their validation windows, bootstrapped) into outputs/pilot/pilot.md, .csv, .json.
#
#   bash docs/make_pilot.sh [output_root] [webtext_path]
#   # defaults: outputs/pilot (deleted first), ../shared/corpora/webtext; PILOT_SEEDS=K (4), PILOT_FP=F (2)
#   PILOT_OVERRIDES="optim.min_lr_ratio=0 global_batch=16" bash docs/make_pilot.sh   # a candidate design
#   PILOT_OVERRIDES="max_steps=6 optim.warmup_steps=0 checkpoint.steps=[6] val_every=3" bash docs/make_pilot.sh /tmp/p  # a dry run
#   PILOT_JOBS=2 bash docs/make_pilot.sh    # the 1-thread runs on 2 lanes side by side (the 2-thread runs alone)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/pilot}
WEBTEXT=${2:-${NORMGEO_SHARED:-../shared}/corpora/webtext}
K=${PILOT_SEEDS:-4}
F=${PILOT_FP:-2}
JOBS=${PILOT_JOBS:-1}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
# Run names carry what is varied; val_seed=0 (the preset's): the same validation windows for every run.
COMMON=(experiment=study_cpu probe.enabled=false data.source.path="$WEBTEXT" output_root="$OUT" data_root="$OUT/data"
        "'run_name=pilot-\${norm.name}-w\${seed}-b\${data.seed}-t\${threads}'" trainer.enable_progress_bar=false
        ${PILOT_OVERRIDES:-})
PREPARE="python -m corpus data=local data.source.path=$WEBTEXT data_root=$OUT/data"
run() {  # one (seed, data.seed, threads): both arms
  echo "python train.py -m seed=$1 data.seed=$2 threads=$3 norm=layer,rms ${COMMON[*]}"
}
ONE=()  # the 1-thread runs: weights, then batch order
for ((s = 0; s < K; s++)); do ONE+=("$(run $s 0 1)"); done
for ((b = 1; b < K; b++)); do ONE+=("$(run 0 $b 1)"); done
TWO=()
for ((s = 0; s < F; s++)); do TWO+=("$(run $s 0 2)"); done
PILOT="python -m normgeo.pilot $OUT"
{ echo "$PREPARE"; printf '%s\n' "${ONE[@]}" "${TWO[@]}"; echo "$PILOT"; } > "$OUT/commands.txt"
echo "+ $PREPARE"
$PREPARE
lane() {
  local i
  for ((i = 0; i < ${#ONE[@]}; i++)); do
    if [ $(( i % JOBS )) -eq "$1" ]; then echo "+ [lane $1] ${ONE[$i]}"; eval "${ONE[$i]}"; fi
  done
}
pids=()
for ((l = 0; l < JOBS; l++)); do lane $l & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
for command in "${TWO[@]}"; do echo "+ $command"; eval "$command"; done
echo "$(( $(date +%s) - start ))" > "$OUT/wall_s.txt"
echo "+ $PILOT"
$PILOT
