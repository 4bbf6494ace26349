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
#   PILOT_JOBS=2 bash docs/make_pilot.sh    # the runs on 2 lanes side by side
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/pilot}
WEBTEXT=${2:-${NORMGEO_SHARED:-../shared}/corpora/webtext}
K=${PILOT_SEEDS:-4}
F=${PILOT_FP:-2}
JOBS=${PILOT_JOBS:-1}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
echo "docs/make_pilot.sh: deleting $OUT first"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
# Run names carry what is varied; val_seed=0 (the preset's): the same validation windows for every run.
COMMON=(experiment=study_cpu probe.enabled=false data.source.path="$WEBTEXT" output_root="$OUT" data_root="$OUT/data"
        "'run_name=pilot-\${norm.name}-w\${seed}-b\${data.seed}-t\${threads}'" trainer.enable_progress_bar=false
        ${PILOT_OVERRIDES:-})
PREPARE="python -m corpus data=local data.source.path=$WEBTEXT data_root=$OUT/data"
run() {  # one run: arm $1, seed $2, data.seed $3, threads $4
  echo "python train.py seed=$2 data.seed=$3 threads=$4 norm=$1 ${COMMON[*]}"
}
RUNS=()  # initial weights, then batch order, then the same runs at another thread count; both arms each
for ((s = 0; s < K; s++)); do for arm in layer rms; do RUNS+=("$(run $arm $s 0 1)"); done; done
for ((b = 1; b < K; b++)); do for arm in layer rms; do RUNS+=("$(run $arm 0 $b 1)"); done; done
for ((s = 0; s < F; s++)); do for arm in layer rms; do RUNS+=("$(run $arm $s 0 2)"); done; done
PILOT="python -m normgeo.pilot $OUT"
{ echo "$PREPARE"; printf '%s\n' "${RUNS[@]}"; echo "$PILOT"; } > "$OUT/commands.txt"
echo "+ $PREPARE"
$PREPARE
# The runs go round-robin onto the lanes. A run's numbers depend on its thread count, not on what else shares
# the machine, so the 2-thread runs may share the cores with another lane: only the wall time changes.
lane() {
  local i
  for ((i = 0; i < ${#RUNS[@]}; i++)); do
    if [ $(( i % JOBS )) -eq "$1" ]; then echo "+ [lane $1] ${RUNS[$i]}"; eval "${RUNS[$i]}"; fi
  done
}
pids=()
for ((l = 0; l < JOBS; l++)); do lane $l & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "$(( $(date +%s) - start ))" > "$OUT/wall_s.txt"
echo "+ $PILOT"
$PILOT
