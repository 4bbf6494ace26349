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
#   PILOT_JOBS=2 bash docs/make_pilot.sh    # the sweeps on 2 lanes side by side
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
# One process per group: a Hydra -m sweep trains both arms of each of its points one after the other, every
# run seeded as on its own (each job re-seeds and sets its thread count), without paying the start-up again.
seq_list() { seq -s, "$1" "$2"; }  # "a,a+1,...,b"
SWEEPS=(  # initial weights, batch order, the same runs at another thread count
  "python train.py -m seed=$(seq_list 0 $((K - 1))) data.seed=0 threads=1 norm=layer,rms ${COMMON[*]}")
if [ "$K" -gt 1 ]; then
  SWEEPS+=("python train.py -m seed=0 data.seed=$(seq_list 1 $((K - 1))) threads=1 norm=layer,rms ${COMMON[*]}")
fi
if [ "$F" -gt 0 ]; then
  SWEEPS+=("python train.py -m seed=$(seq_list 0 $((F - 1))) data.seed=0 threads=2 norm=layer,rms ${COMMON[*]}")
fi
PILOT="python -m normgeo.pilot $OUT"
{ echo "$PREPARE"; printf '%s\n' "${SWEEPS[@]}"; echo "$PILOT"; } > "$OUT/commands.txt"
echo "+ $PREPARE"
$PREPARE
# The sweeps go round-robin onto the lanes. A run's numbers depend on its thread count, not on what else shares
# the machine, so the 2-thread runs may share the cores with another lane: only the wall time changes.
lane() {
  local i
  for ((i = 0; i < ${#SWEEPS[@]}; i++)); do
    if [ $(( i % JOBS )) -eq "$1" ]; then echo "+ [lane $1] ${SWEEPS[$i]}"; eval "${SWEEPS[$i]}"; fi
  done
}
pids=()
for ((l = 0; l < JOBS; l++)); do lane $l & pids+=($!); done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "$(( $(date +%s) - start ))" > "$OUT/wall_s.txt"
echo "+ $PILOT"
$PILOT
