#!/usr/bin/env bash
# Transfer study on NIH ChestX-ray14 (docs/real-radiographs.md): does a student trained on cxrdr's phantom help on
# real radiographs, alone (transfer) or as the start of NIH training (fine-tuned)? Same student, steps and lr as
# the plain arm of configs/experiments/nih.yaml, whose shards it reuses (run that experiment first).
#   CXRDR_SHARED_DATA=/path/to/shared/data scripts/nih-transfer.sh [OUT]
set -euo pipefail
OUT="${1:-runs/experiments/nih-transfer}"
DATA="${CXRDR_SHARED_DATA:-../shared/data}/nih_bbox/nih_bbox.jsonl"
NIH_SHARDS="${NIH_SHARDS:-runs/experiments/nih/shards}"
SEEDS="${SEEDS:-0 1 2 3 4}"
CFG=configs/experiments/nih-finetune.yaml
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[ -f "$NIH_SHARDS/dataset.json" ] || { echo "no NIH shards in $NIH_SHARDS: run train experiment efficiency --config configs/experiments/nih.yaml first" >&2; exit 1; }
mkdir -p "$OUT"
bench() { [ -f "$2/benchmark.json" ] || train eval --ckpt "$1" --benchmark "nih-bbox:$DATA" --split test --out "$2" --quiet; }

# 1. the phantom-trained student (phantom:1000 rendered at 256, stored at 128 like the NIH shards)
[ -f "$OUT/phantom-shards/dataset.json" ] || reinforce build --source phantom:1000 --phantom-size 256 \
  --teachers random:tiny --out "$OUT/phantom-shards" --n-aug 8 --n-captions 4 --store-size 128 --shard-size 250 \
  --workers 0 --device cpu
[ -f "$OUT/phantom/last.pt" ] || train run --shards "$OUT/phantom-shards" --config "$CFG" \
  --eval-every 0 --seed 0 --out "$OUT/phantom" --overwrite
# 2. transfer: the phantom student on the NIH test boxes, no real training
bench "$OUT/phantom/last.pt" "$OUT/transfer-bench"
# 3. fine-tuned: the phantom student trained on NIH train (same steps and lr as plain), one run per seed
for s in $SEEDS; do
  [ -f "$OUT/finetune/seed-$s/last.pt" ] || train run --shards "$NIH_SHARDS" --config "$CFG" \
    --init-ckpt "$OUT/phantom/last.pt" --seed "$s" --out "$OUT/finetune/seed-$s" --overwrite
  bench "$OUT/finetune/seed-$s/last.pt" "$OUT/finetune/seed-$s/bench"
done
echo "transfer study in $OUT"
