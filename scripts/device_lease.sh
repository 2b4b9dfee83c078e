#!/usr/bin/env bash
# What one call on a lent GPU runs (docs/gpu.md, "Running on a lent GPU"), from the repository root there, with
# `.whl` (scripts/device_carry.py) carried:
#
#   MODE=recipe bash scripts/device_lease.sh   # the GPU efficiency recipe's next chunks (scripts/gpu-experiment.sh)
#                                              # for RECIPE_S seconds (default 540), then its status; a fresh
#                                              # machine's first call times the pair similarity first
#   MODE=suite  bash scripts/device_lease.sh   # benchmarks/gpu_suite.py --device cuda --budget SUITE_S (default
#                                              # 470), after the pair similarity and text attention benchmarks
#   MODE=pair   bash scripts/device_lease.sh   # benchmarks/pair_similarity.py at the GPU step's shape only
#
# Give the call a timeout_s about 50 s above RECIPE_S / SUITE_S (the install and the copies). The machine keeps its
# disk while warm (30 s idle), so a second recipe call right after the first resumes its finished units. What
# comes back lands in $OUT (at most 8 files): lease.log, and the recipe's results.json, table.md and plots when
# it has finished, or the suite's JSON and Markdown.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${MODE:-recipe}"
OUT="${OUT:-/tmp/lease-out}"
SITE=/tmp/cxrdr-site
mkdir -p "$OUT"
exec > >(tee -a "$OUT/lease.log") 2>&1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl/wheels/*.whl || exit 1
# --upgrade: without it pip leaves out cxrdr's console scripts
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . || exit 1
export PYTHONPATH="$SITE:$PWD/.whl/pkgs" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
python3 -c "import torch, cxrdr; print('torch', torch.__version__, torch.cuda.get_device_name(0), cxrdr.__file__)" \
  || exit 1
echo "[lease] installed in $(elapsed) s; mode $MODE"

pair() { python3 benchmarks/pair_similarity.py --device cuda --batch 256 --amp --shapes 196x512 --rounds 10; }

case "$MODE" in
  recipe)
    RECIPE_S="${RECIPE_S:-540}"
    # a fresh machine's first call also times the pair similarity (~20 s): the loop's figure the recipe waits on
    [ -d runs/experiments/gpu-efficiency ] || pair
    rc=3
    # a chunk stops before a new unit 90 s before its kill, and the last one is killed before RECIPE_S
    while [ "$rc" -eq 3 ] && [ $(( RECIPE_S - $(elapsed) )) -gt 150 ]; do
      hard=$(( RECIPE_S - $(elapsed) - 30 ))
      CHUNK_S=$(( hard - 90 )) HARD_S=$hard COPIES="${COPIES:-2}" bash scripts/gpu-experiment.sh; rc=$?
    done
    results=runs/experiments/gpu-efficiency/efficiency
    for f in results.json table.md metric_vs_samples.png metric_vs_samples_per_seed.png auc_vs_samples.png \
             step_time.png; do
      [ -f "$results/$f" ] && cp "$results/$f" "$OUT/"
    done
    heatmap=$(find runs/experiments/gpu-efficiency -name '*heatmap*.png' 2>/dev/null | sort | head -1)
    [ -n "$heatmap" ] && cp "$heatmap" "$OUT/heatmaps.png"
    echo "[lease] recipe exit $rc after $(elapsed) s (0: finished, 3: work left, call again while warm)"
    ;;
  suite)
    pair
    python3 benchmarks/text_attention.py --device cuda
    python3 benchmarks/gpu_suite.py --device cuda --budget "${SUITE_S:-470}" --out-dir /tmp/suite-out ${SUITE_ARGS:-}
    cp /tmp/suite-out/*.json /tmp/suite-out/*.md "$OUT/"
    echo "[lease] suite done after $(elapsed) s"
    ;;
  pair) pair ;;
  *) echo "MODE must be recipe, suite or pair, got '$MODE'"; exit 2 ;;
esac
