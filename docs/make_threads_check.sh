#!/usr/bin/env bash
# Does the CPU study's answer survive the floating-point order? Re-trains the two runs of seed 0 of the primary
# question (layer and rms) exactly as docs/make_study.sh trained them, but with 2 torch threads instead of the
# lanes' 1, then rewrites docs/study.md with both the pilot's split and this check ("Floating-point order").
#
#   bash docs/make_threads_check.sh [study_root] [threads_root] [pilot]
#   # defaults: outputs/study (read), outputs/study-threads (deleted first), docs/pilot/round2
set -euo pipefail
cd "$(dirname "$0")/.."
STUDY=${1:-outputs/study}
OUT=${2:-outputs/study-threads}
PILOT=${3:-docs/pilot/round2}
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken} HF_HUB_OFFLINE=1 WANDB_MODE=offline
[ -f "$STUDY/commands.txt" ] || { echo "error: $STUDY has no commands.txt: run bash docs/make_study.sh first" >&2; exit 2; }
# The study's own command for seed 0 (one run per command, or a sweep of its arms), as a sweep of the primary
# question's two arms, into another folder (its data reused), with 2 threads.
SEED0=$(grep -m1 -E -- "train.py (-m )?seed=0 norm=" "$STUDY/commands.txt")
COMMAND="$(echo "$SEED0" | sed -E "s/train.py (-m )?/train.py -m /; s/ norm=[^ ]+/ norm=layer,rms/; s# output_root=[^ ]+# output_root=$OUT#") threads=2"
echo "docs/make_threads_check.sh: deleting $OUT first; at the end docs/study.md and docs/study_details.md are rewritten"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
echo "+ $COMMAND"
OMP_NUM_THREADS=2 $COMMAND
echo "$(( $(date +%s) - start ))" > "$OUT/wall_s.txt"
echo "$COMMAND" > "$OUT/commands.txt"
python docs/study_page.py "$STUDY" "$PILOT" "$OUT" > docs/study.md
echo "threads check: $(cat "$OUT/wall_s.txt") s; docs/study.md rewritten"
