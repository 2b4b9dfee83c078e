#!/usr/bin/env bash
# The offline end-to-end demo (`make demo`): phantom data -> reinforced shards with real offline
# teachers (MiniLM text teacher + a CLIP teacher trained here by `train run`) -> Patch-IB student
# distilled from the stored embeddings -> evaluation table and plots.
# Real use swaps the teachers for `--teachers biomedclip` on a GPU host (see README).
set -euo pipefail
OUT="${1:-demo}"
N="${DEMO_N:-600}"
mkdir -p "$OUT"
# Torch gets the cores (at most 4: these models are too small to use more). The build measures
# its MiniLM teacher against preparation and says where it prepares and how many threads its
# teacher keeps. The training runs load batches in their own process (--workers 0): a stored
# 128-px sample decodes in ~1 ms, and no loader worker competes with the OpenMP threads (they
# spin-wait beside busy processes: 5-30x slower steps seen on loaded 2-core boxes). Measured on an
# idle 2-core box, a student step: 2 threads, no workers 354-360 ms; 2 threads, 2 workers 370 ms;
# 1 thread, 2 workers (the former setting) 570 ms.
CORES=$(nproc); export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( CORES < 4 ? CORES : 4 ))}"
start=$(date +%s)
step() { printf '\n\033[1m== %s\033[0m  (%d s in)\n' "$*" $(( $(date +%s) - start )); }
# A rerun into the same folder continues the runs (DEMO_RESUME=1) or replaces them.
AGAIN="--overwrite"; [ -n "${DEMO_RESUME:-}" ] && AGAIN="--resume"

step "1/6 phantom CXR data: $N images -> $OUT/phantom"
reinforce phantom --n "$N" --out "$OUT/phantom" --seed 0 --size 256

step "2/6 reinforce build: augmentations, captions, MiniLM text-teacher embeddings -> $OUT/shards"
reinforce build --source "jsonl:$OUT/phantom/records.jsonl" --teachers text:minilm \
  --out "$OUT/shards" --n-aug 4 --n-captions 3 --store-size 128 --shard-size 200 --workers 2 --resume

step "3/6 train a CLIP teacher on the shards (train run, model tiny-cnn-A, no teacher)"
train run --shards "$OUT/shards" --model tiny-cnn-A --mode plain --steps "${DEMO_TEACHER_STEPS:-300}" \
  --batch-size 32 --eval-every 100 --out "$OUT/teacher" --workers 0 "$AGAIN"

step "4/6 reinforce add-teacher: embed every stored augmentation and caption with that teacher"
reinforce add-teacher "$OUT/shards" --teachers "ckpt:$OUT/teacher/best.pt"

step "5/6 train the Patch-IB student (model cpu-D) distilled from the stored teacher embeddings"
train run --shards "$OUT/shards" --model cpu-D --steps "${DEMO_STUDENT_STEPS:-400}" --batch-size 32 \
  --eval-every 150 --out "$OUT/student" --workers 0 "$AGAIN"

step "6/6 evaluate the student on the phantom test split"
train eval --ckpt "$OUT/student/best.pt" --shards "$OUT/shards" --split test --out "$OUT/eval"

echo
echo "demo finished in $(( $(date +%s) - start )) s; plots and tables are in $OUT/eval/"
ls "$OUT/eval"
