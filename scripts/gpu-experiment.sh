#!/usr/bin/env bash
# The GPU efficiency recipe (issue 36) one chunk at a time: each call prints what is done and what is left, runs
# the next chunk of `train experiment efficiency` when work is left, and prints the status again.
#
#   scripts/gpu-experiment.sh [RECIPE]     # default configs/experiments/gpu-efficiency.yaml
#
# Call it until it exits 0. Exit codes: 0 everything done (results in the recipe's <out>/efficiency: results.json,
# table.md, plots; nothing was run), 3 work left (call again), anything else an error (the output names the unit).
# A call lasts at most HARD_S + 15 s plus two status listings: under 9 minutes with the defaults.
# Every unit (a shard build, the teacher's training, its evaluations, add-teacher, each run, each evaluation, the
# step benchmark) is reused when done and resumed when interrupted (cxrdr/experiments/chunks.py): the chunk stops
# cleanly before the next unit after CHUNK_S seconds, and is killed at HARD_S; a killed chunk loses at most a
# shard, a run's steps since its last save, or one evaluation. A run's evaluation right after its training is not
# stopped at CHUNK_S, and a run the chunk's own measured times say would not finish with its evaluation by HARD_S
# does not start (a trained run without its evaluation does not travel to the next lease).
#   env: CHUNK_S (default 390), HARD_S (default 480), TRAIN (the `train` command, e.g. "python -m cxrdr.cli"),
#        COPIES (default 1): copies of the chunk run side by side on the one GPU; they split the runs (each holds
#        its run's folder lock), wait for each other on shared units (builds, the teacher), and one of them times
#        the step benchmark alone. A run's set-up, validation passes and evaluation leave the GPU idle, which a
#        second copy's training fills (mind the GPU memory: two students and their evaluations at once). The
#        runs' own step times then include the other copy's load; the interleaved step benchmark runs alone.
set -uo pipefail
cd "$(dirname "$0")/.."
RECIPE="${1:-configs/experiments/gpu-efficiency.yaml}"
CHUNK_S="${CHUNK_S:-390}"
HARD_S="${HARD_S:-480}"
read -r -a TRAIN <<< "${TRAIN:-train}"

status() { "${TRAIN[@]}" experiment efficiency --config "$RECIPE" --quiet --status; }

status
rc=$?
if [ "$rc" -eq 0 ]; then echo "[gpu-experiment] nothing left to run"; exit 0; fi
[ "$rc" -eq 3 ] || exit "$rc"
COPIES="${COPIES:-1}"
# a unit killed at HARD_S prints every thread's stack first: where it was (cxrdr.common.errors.stacks_on_sigterm)
export CXRDR_STACKS_ON_TERM="${CXRDR_STACKS_ON_TERM-1}"
echo "[gpu-experiment] next chunk (${COPIES} cop$([ "$COPIES" -eq 1 ] && echo y || echo ies)): stops before a new unit" \
     "after ${CHUNK_S} s, killed at ${HARD_S} s"
start=$(date +%s)
pids=()
for _ in $(seq 1 "$COPIES"); do
  # timeout signals the whole process group (data-loader workers too); no unit is left half-written as done
  timeout --kill-after=15 "$HARD_S" "${TRAIN[@]}" experiment efficiency --config "$RECIPE" --quiet --chunk-s "$CHUNK_S" \
    --chunk-hard-s "$HARD_S" &
  pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do
  wait "$pid"; rc=$?
  echo "[gpu-experiment] chunk exited $rc after $(( $(date +%s) - start )) s (3: stopped with work left;" \
       "124/137: killed, resumes next call)"
  case "$rc" in 0|3|124|137) ;; *) failed=$rc ;; esac
done
[ "$failed" -eq 0 ] || exit "$failed"
status
