#!/usr/bin/env bash
# The CPU study (docs/study.md): the arms layer and rms with STUDY_SEEDS seeds, layer_nobias, rms_bias and
# dyt with 2, each 1,000 optimizer steps of 512 tokens on real OpenWebText text with 11 probes
# (experiment=study_cpu; each probe also runs the centering intervention, intervention.jsonl), then
# normgeo.compare with its verdict, then docs/study.md and its figures. With STUDY_JOBS=2, the variance
# pilot's runs (docs/pilot/round2/, probes off) took 15-16 minutes each on one of the 2 lanes of a 2-core
# machine that was also running tests; on idle cores it is not measured yet.
#
#   bash docs/make_study.sh [output_root] [webtext_path] [probe_path]
#   # defaults: outputs/study (deleted first), ../shared/corpora/webtext, ../shared/corpora/wikipedia
#   STUDY_OVERRIDES="max_steps=4 optim.warmup_steps=0 checkpoint.steps=[2,4] val_every=2" bash docs/make_study.sh /tmp/s  # a dry run
#   STUDY_JOBS=2 bash docs/make_study.sh        # two runs at a time, one core each
#   STUDY_SEEDS=13 bash docs/make_study.sh      # the primary arms' seeds (default 7: the pilot's SD reaches +-0.03 nats)
#   STUDY_PILOT=docs/pilot/round2 bash docs/make_study.sh  # the variance pilot's split on the page
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/study}
WEBTEXT=${2:-${NORMGEO_SHARED:-../shared}/corpora/webtext}
PROBE=${3:-${NORMGEO_SHARED:-../shared}/corpora/wikipedia}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
echo "docs/make_study.sh: deleting $OUT first; at the end docs/study.md, docs/study_details.md, docs/study_verdict.csv and docs/figures/study-*.png are rewritten"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
load_before=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo unknown)
COMMON=(experiment=study_cpu data.source.path="$WEBTEXT" probe.path="$PROBE" output_root="$OUT"
        data_root="$OUT/data" trainer.enable_progress_bar=false ${STUDY_OVERRIDES:-})
# One command per run. With STUDY_JOBS=2 the runs go round-robin onto 2 lanes that run side by side, each with
# its share of the cores (torch threads = cores / lanes), so that each lane trains the same number of runs
# (by seed, 7 seeds put 11 runs on one lane and 9 on the other: 20 minutes of one idle core).
JOBS=${STUDY_JOBS:-1}
SEEDS=${STUDY_SEEDS:-7}  # the primary arms' seeds; the other arms run on the first 2
CORES=$(python -c 'import os; print(len(os.sched_getaffinity(0)))')
THREADS=$(( CORES / JOBS > 0 ? CORES / JOBS : 1 ))
PREPARE="python -m corpus data=local data.source.path=$WEBTEXT data_root=$OUT/data"
RUNS=()  # "seed arm": the primary arms seed by seed, then the other arms on seeds 0 and 1
for ((seed = 0; seed < SEEDS; seed++)); do RUNS+=("$seed layer" "$seed rms"); done
for ((seed = 0; seed < (SEEDS < 2 ? SEEDS : 2); seed++)); do
  for arm in layer_nobias rms_bias dyt; do RUNS+=("$seed $arm"); done
done
run_command() {  # seed $1, arm $2
  echo "python train.py seed=$1 norm=$2 ${COMMON[*]}"
}
COMPARE="python -m normgeo.compare $OUT --formats png"
{ echo "$PREPARE"; for run in "${RUNS[@]}"; do run_command $run; done; echo "$COMPARE"; } > "$OUT/commands.txt"
echo "+ $PREPARE"
$PREPARE
lane() {  # the runs of lane $1, one after the other
  local index
  for ((index = 0; index < ${#RUNS[@]}; index++)); do
    if [ $(( index % JOBS )) -eq "$1" ]; then
      echo "+ [lane $1, $THREADS thread(s)] $(run_command ${RUNS[$index]})"
      OMP_NUM_THREADS=$THREADS $(run_command ${RUNS[$index]})
    fi
  done
}
pids=()
for ((lane_index = 0; lane_index < JOBS; lane_index++)); do
  lane $lane_index &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "+ $COMPARE"
$COMPARE
end=$(date +%s)
echo "$((end - start))" > "$OUT/wall_s.txt"
du -sb "$OUT" | cut -f1 > "$OUT/disk_bytes.txt"
echo "$load_before / $(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo unknown) (2 cores)" > "$OUT/load.txt"
python docs/study_page.py "$OUT" ${STUDY_PILOT:-} > docs/study.md  # STUDY_PILOT=outputs/pilot: its split on the page
echo "study: $((end - start)) s; docs/study.md and docs/figures/study-*.png written"
