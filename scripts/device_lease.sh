#!/usr/bin/env bash
# What one call on a lent GPU runs (docs/gpu.md, "Running on a lent GPU"), from the repository root there, with
# `.whl` (scripts/device_carry.py) carried:
#
#   MODE=recipe bash scripts/device_lease.sh   # the GPU efficiency recipe's next chunks (scripts/gpu-experiment.sh)
#                                              # for RECIPE_S seconds (default 540), then its status
#   MODE=probe-recipe bash scripts/device_lease.sh  # the recipe's val probe (PROBE, default
#                                              # configs/experiments/gpu-efficiency-probe.yaml) first; once it is done,
#                                              # its rule (scripts/probe_choice.py) writes the recipe it leaves, and
#                                              # that recipe's chunks go on in the time left (RECIPE_S in all): the
#                                              # probed recipe, its runs whose setting stands reused. Called again
#                                              # on the warm machine it goes on where it stopped. Brings back what
#                                              # MODE=recipe does, and probe.tar.gz: the probe's results, table,
#                                              # plots, the rule's decision (choice.txt), the recipe it wrote and
#                                              # the probe's carry.tar.gz (for PROBE_CARRY on a fresh machine)
#   MODE=suite  bash scripts/device_lease.sh   # benchmarks/gpu_suite.py --device cuda --budget SUITE_S (default
#                                              # 380), after the pair similarity and text attention benchmarks and
#                                              # the compiled blocks' graphs checked against them ungraphed
#   MODE=heads  bash scripts/device_lease.sh   # the suite's loop_graphs section (~2-3 min on an H200): the
#                                              # heads on the patch grid and the global loss terms graphed
#                                              # (--cuda-graphs-heads, --cuda-graphs-losses) beside the blocks' and
#                                              # text layers' graphs and eager, and their checks on the card; then
#                                              # its loop_compiled section for the scopes COMPILED names (default
#                                              # blocks+all-graphs: A, D, E with the image blocks compiled under
#                                              # every graph, beside every graph uncompiled, ~50 s each as the
#                                              # budget allows; COMPILED="" leaves it out); its JSON and MD come
#                                              # back as heads-<device>.json/.md; then A and E
#                                              # each without one part of the step, and with the token-region term
#                                              # in groups of 64 (train_step.py --parts --with, ~80 s):
#                                              # heads-parts.json
#   MODE=pair   bash scripts/device_lease.sh   # benchmarks/pair_similarity.py at the GPU step's shape only
#   MODE=layout bash scripts/device_lease.sh   # benchmarks/cnn_layout.py: the recipe's Lite2 teacher tower
#                                              # channels_last against the default layout, bf16 (~30 s)
#   MODE=graphs bash scripts/device_lease.sh   # benchmarks/graphs_real_run.py: a real run with the default CUDA
#                                              # graphs beside the same run eager (~1-2 min)
#   MODE=collect bash scripts/device_lease.sh  # gather what earlier recipe calls wrote (below) into $OUT again,
#                                              # running nothing of the recipe
#
# Give a recipe call a timeout_s about 50 s above RECIPE_S (the install and the copies; a partial report gets what
# is left of RECIPE_S + 30 s), a suite call about 200 s above SUITE_S (the install, the pair similarity, text
# attention and the compiled blocks' check, at most 120 s, before the suite). The machine keeps its
# disk while warm (30 s idle), so a second recipe call right after the first resumes its finished units. What
# comes back lands in $OUT (at most 8 files): lease.log; for the recipe, recipe.tar.gz (every JSON, JSONL,
# Markdown, YAML and plot it has written so far, finished or not: a lease that ends first still brings back the
# teacher's figures, the finished runs' curves and evaluations and each unit's time), carry.tar.gz (the runs trained
# and evaluated so far, for the next lease: below) and, once it has finished,
# results.json, table.md, metric_vs_samples.png and the reinforced arm's heatmaps.png beside it, or, cut short, the
# finished runs' partial-results.json and partial-table.md (`train experiment efficiency --partial`); for the
# suite, its JSON and Markdown. A heads call: timeout_s about 180 s above SUITE_S (default 400; 240 with COMPILED="").
#   env: RECIPE (default configs/experiments/gpu-efficiency.yaml; its CPU twin rehearses this script on any machine:
#        RECIPE=configs/experiments/gpu-efficiency-twin.yaml OUT=/tmp/lease-out bash scripts/device_lease.sh),
#        COPIES (default 2), RECIPE_S, SUITE_S, SUITE_ARGS, SUITE_PREFIX (default 1; 0: the suite alone, without
#        the pair similarity, text attention and compiled blocks' checks first, ~65 s on an H200), GRAPHS_DEVICE
#        (default cuda), GRAPHS_ARGS (MODE=graphs), HEADS_DEVICE (default cuda; MODE=heads rehearsed on the CPU:
#        HEADS_DEVICE=cpu SUITE_ARGS=--tiny PARTS_ARGS="--size tiny --batch-size 4 --steps 1 --warmup 0"),
#        INSTALL (default 1; 0: no install, this environment's cxrdr runs),
#        ARCHIVE_MAX_KB (default 15360: recipe.tar.gz stays under a returned file's 16 MiB),
#        CARRY (default, for gpu-efficiency.yaml only, docs/results/gpu-recipe-carry.tar.gz: an earlier lease's
#        carry.tar.gz, committed; a fresh machine's recipe call unpacks its runs first, so they are not trained again:
#        cxrdr/experiments/carry.py), PROBE_CARRY (default, for gpu-efficiency-probe.yaml only,
#        docs/results/gpu-probe-carry.tar.gz: an earlier lease's carry.tar.gz of the probe's runs, where it was cut
#        short)
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${MODE:-recipe}"
OUT="${OUT:-/tmp/lease-out}"
SITE="${SITE:-/tmp/cxrdr-site}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/lease.log") 2>&1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

if [ "${INSTALL:-1}" = 1 ]; then  # INSTALL=0: use this environment's cxrdr (a rehearsal, the tests)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/wheels/*.whl || exit 1
  # --upgrade: without it pip leaves out cxrdr's console scripts
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . || exit 1
  export PYTHONPATH="$SITE:$PWD/.whl/pkgs" PATH="$SITE/bin:$PATH"
fi
export PYTHONUNBUFFERED=1
# what the install gave (collect needs cxrdr's recipe reader only; INSTALL=0 runs the caller's environment as it is,
# and importing torch to say so took ~2 s of each of the tests' lease calls)
if [ "$MODE" != collect ] && [ "${INSTALL:-1}" = 1 ]; then
  python3 -c "import torch, cxrdr; print('torch', torch.__version__, cxrdr.__file__,
                                         torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')" \
    || exit 1
fi
echo "[lease] installed in $(elapsed) s; mode $MODE"

has_cuda() { python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; }
pair() {
  if has_cuda; then
    python3 benchmarks/pair_similarity.py --device cuda --batch 256 --amp --shapes 196x512 --rounds 10
  else
    echo "[lease] no CUDA here: the pair similarity benchmark is left out"
  fi
}
# the recipe's teacher tower in both layouts (stop 66: add-teacher slowed on a lease after it went channels_last)
layout() {
  if has_cuda; then
    timeout 120 python3 benchmarks/cnn_layout.py --model teacher-lite2-gpu-D --device cuda --batch 256 \
      | tee "$OUT/cnn-layout.md"
  else
    echo "[lease] no CUDA here: the layout benchmark is left out"
  fi
}

RECIPE="${RECIPE:-configs/experiments/gpu-efficiency.yaml}"
read -r -a TRAIN_CMD <<< "${TRAIN:-train}"  # an array of its own: TRAIN stays exported to the chunks
recipe_folder() {  # the recipe's out folder, as train experiment reads it
  python3 -c "import sys; from cxrdr.experiments.recipe_file import load_recipe, recipe_out
print(recipe_out(load_recipe(sys.argv[1])))" "$RECIPE"
}

# The recipe's set-up folders (shards, teachers, report set) outside its out folder: a probe's are its probed
# recipe's. Their records (dataset.json: the builds' time split and add-teacher's seconds; the teacher's run) say
# where a fresh host's set-up went, which the probe's own folder does not.
setup_folders() {
  python3 -c "import sys; from pathlib import Path; from cxrdr.experiments.recipe_file import load_recipe, recipe_out
recipe = load_recipe(sys.argv[1]); out = Path(recipe_out(recipe)).resolve()
named = [(recipe.get('shards') or {}).get('dir'), (recipe.get('teachers') or {}).get('dir'),
         ((recipe.get('report') or {}).get('shards') or {}).get('dir')]
for folder in dict.fromkeys(f for f in named if f):
    if Path(folder).is_dir() and out not in Path(folder).resolve().parents: print(folder)" "$RECIPE"
}

# The recipe's files worth bringing back (RECIPE's out folder and its set-up folders) into $OUT
collect() {
  # what the recipe has written so far, small files only (no shards, checkpoints or parquet); a file comes back
  # at <= 16 MiB, so the runs' heatmaps (~1 MB each at 224 px) stay behind if they would pass that
  local folders
  mapfile -t folders < <(echo "$recipe_out"; setup_folders)
  teacher_check
  small() { find "${folders[@]}" -type f -size -4194304c \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' \
            -o -name '*.yaml' -o -name '*.png' \) | sort; }
  too_big() { [ "$(stat -c %s "$OUT/recipe.tar.gz")" -gt $(( ${ARCHIVE_MAX_KB:-15360} * 1024 )) ]; }
  small | tar czf "$OUT/recipe.tar.gz" -T -
  if too_big; then small | grep -v '/heatmaps.png$' | tar czf "$OUT/recipe.tar.gz" -T -; fi
  if too_big; then small | grep -v '\.png$' | tar czf "$OUT/recipe.tar.gz" -T -; fi  # the figures, no plot
  # the runs finished so far (the carried ones included), for the next lease to go on from
  python3 -m cxrdr.experiments.carry pack "$recipe_out" "$OUT/carry.tar.gz" --label "lease $(date -u +%FT%TZ)" \
    || echo "[lease] no carry.tar.gz (above: why)"
  results="$recipe_out/efficiency"
  for f in results.json table.md metric_vs_samples.png; do
    [ -f "$results/$f" ] && cp "$results/$f" "$OUT/"
  done
  for f in results.json table.md; do  # a recipe cut short: its finished runs' figures, marked partial
    [ -f "$results/partial/$f" ] && [ ! -f "$results/$f" ] && cp "$results/partial/$f" "$OUT/partial-$f"
  done
  heatmap=$(find "$results/runs/reinforced" -path '*/eval-report/heatmaps.png' 2>/dev/null | sort -V | head -1)
  [ -n "$heatmap" ] && cp "$heatmap" "$OUT/heatmaps.png"
  return 0
}

# What the students' stored teacher embeddings know (reinforce inspect --teacher-check: recall of each view's own
# report among the test split's, from the stored embeddings alone; seconds), again whenever a teacher was added
# since; into the recipe's folder, so recipe.tar.gz brings it back (no ninth returned file)
teacher_check() {
  local shards out="$recipe_out/teacher-check.md"
  # the students' shard folder, once built with a teacher (a folder without one has nothing to check)
  shards=$(python3 -c "import json, sys; from pathlib import Path; from cxrdr.experiments.recipe_file import load_recipe
shards = Path((load_recipe(sys.argv[1]).get('shards') or {}).get('dir') or '/nonexistent')
info = json.loads((shards / 'dataset.json').read_text()) if (shards / 'dataset.json').is_file() else {}
print(shards if info.get('teachers') else '')" "$RECIPE") || return 0
  [ -n "$shards" ] || return 0
  [ "$out" -nt "$shards/dataset.json" ] && return 0  # checked since the last teacher was added
  mkdir -p "$recipe_out"  # a probe's folder before its first run: the shards are its probed recipe's
  if timeout 120 reinforce inspect "$shards" --teacher-check --split test > "$out.tmp" 2>&1; then
    { echo '```'; cat "$out.tmp"; echo '```'; } > "$out"
  else
    echo "[lease] no teacher check of $shards:"; tail -3 "$out.tmp"
  fi
  rm -f "$out.tmp"
}

case "$MODE" in recipe|collect) recipe_out=$(recipe_folder) || exit 1 ;; esac
# The runs' CUDA graphs, mended after the sixth lease (logging steps run eager) but not yet run on a GPU in a real
# run: should a run still go non-finite with them, the recipe goes on eager (train.cuda_graphs off) from a copy in
# its out folder, which later calls on this machine read too (the finished runs' configs say which way they ran).
# The copy names the recipe's name and folder: a recipe that extends another (a probe) takes them from its file's.
eager_copy() { echo "$recipe_out/recipe-eager.yaml"; }
go_eager() {
  python3 -c "import sys, yaml
from cxrdr.experiments.recipe_file import load_recipe, recipe_out
r = yaml.safe_load(open(sys.argv[1])); loaded = load_recipe(sys.argv[1])
r.update(name=loaded['name'], out=str(recipe_out(loaded))); r.setdefault('train', {})['cuda_graphs'] = 'off'
yaml.safe_dump(r, open(sys.argv[2], 'w'), sort_keys=False)" "$RECIPE" "$(eager_copy)" || return 1
  echo "[lease] a run went non-finite with CUDA graphs: the recipe goes on eager ($(eager_copy))"
  RECIPE="$(eager_copy)"
}

# The next chunks of RECIPE (its folder: recipe_out) until it is done or RECIPE_S is near: rc 0 done, 3 work left.
# Its carry (CARRY, or the committed one for gpu-efficiency's folder) is unpacked first on a fresh machine.
recipe_chunks() {
  [ -f "$(eager_copy)" ] && RECIPE="$(eager_copy)"
  # (until stop 59 a fresh machine's first call timed the pair similarity first: ~20 s of the lease, measured
  # alike on two leases; MODE=pair times it alone)
  # the committed carries: gpu-efficiency's runs and its val probe's; another recipe starts from none unless told
  local default_carry="" carry="$1"
  case "$(basename "$recipe_out")" in
    gpu-efficiency) default_carry=docs/results/gpu-recipe-carry.tar.gz ;;
    gpu-efficiency-probe) default_carry=docs/results/gpu-probe-carry.tar.gz ;;
  esac
  carry="${carry:-$default_carry}"
  if [ -f "$carry" ] && [ ! -d "$recipe_out/efficiency/runs" ]; then  # a fresh machine: an earlier lease's runs
    python3 -m cxrdr.experiments.carry unpack "$carry" "$recipe_out" || exit 1
  fi
  rc=3
  local chunks=0 chunk_log
  chunk_log=$(mktemp)
  # a chunk stops before a new unit 90 s before its kill, and the last one is killed before RECIPE_S
  while [ "$rc" -eq 3 ] && [ $(( RECIPE_S - $(elapsed) )) -gt 150 ]; do
    hard=$(( RECIPE_S - $(elapsed) - 30 ))
    # the chunk's own output read back whole (lease.log's tee may not have written its last lines yet)
    CHUNK_S=$(( hard - 90 )) HARD_S=$hard COPIES="${COPIES:-2}" bash scripts/gpu-experiment.sh "$RECIPE" 2>&1 \
      | tee "$chunk_log"; rc=${PIPESTATUS[0]}; chunks=$(( chunks + 1 ))
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ] && [ "$RECIPE" != "$(eager_copy)" ] \
       && grep -q "non-finite loss" "$chunk_log" && go_eager; then rc=3; fi
  done
  if [ "$chunks" -eq 0 ]; then  # not one chunk ran: say why, not just "work left"
    echo "[lease] RECIPE_S=$RECIPE_S leaves no chunk room: a chunk starts only while more than 150 s of it are" \
         "left (it stops new units 90 s before its kill, 30 s before RECIPE_S); nothing of $RECIPE ran"
  fi
}

# What a recipe call brings back, and a recipe cut short reports of its finished runs
recipe_report() {
  collect  # first what is there, should the partial report below outlast the call
  left_s=$(( RECIPE_S + 30 - $(elapsed) ))
  if [ "$rc" -eq 3 ] && [ "$left_s" -gt 20 ]; then  # cut short: the finished runs' results (it only reads)
    timeout "$(( left_s < 120 ? left_s : 120 ))" "${TRAIN_CMD[@]}" experiment efficiency --config "$RECIPE" --quiet \
      --partial || echo "[lease] no partial results (above: why)"
    collect
  fi
  echo "[lease] recipe exit $rc after $(elapsed) s (0: finished, 3: work left, call again while warm);" \
       "recipe.tar.gz holds $(tar tzf "$OUT/recipe.tar.gz" | wc -l) files"
}

# The probe's rule applied to its finished results: the recipe it leaves (scripts/probe_choice.py), written in the
# probe's folder, and the probe's figures and decision back as probe.tar.gz, with the probe's own carry.tar.gz
# (its finished runs: a fresh machine given it as PROBE_CARRY trains none of them again)
probe_choice() {
  local probe_out="$recipe_out"
  python3 scripts/probe_choice.py "$probe_out/efficiency/results.json" --recipe "$RECIPE" \
    --write-recipe "$probe_out/chosen-recipe.yaml" 2>&1 | tee "$probe_out/choice.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  python3 -m cxrdr.experiments.carry pack "$probe_out" "$probe_out/carry.tar.gz" --label "probe $(date -u +%FT%TZ)" \
    || echo "[lease] no carry of the probe's runs (above: why)"
  local members=(choice.txt chosen-recipe.yaml)
  [ -f "$probe_out/carry.tar.gz" ] && members+=(carry.tar.gz)
  (cd "$probe_out" && find "${members[@]}" efficiency -maxdepth 1 -type f \
     \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.txt' -o -name '*.yaml' -o -name '*.tar.gz' \) \
     | tar czf "$OUT/probe.tar.gz" -T -)
  RECIPE="$probe_out/chosen-recipe.yaml"
  recipe_out=$(recipe_folder) || return 1
}

case "$MODE" in
  recipe)
    RECIPE_S="${RECIPE_S:-540}"
    recipe_chunks "${CARRY:-}"
    recipe_report
    ;;
  probe-recipe)
    # the val probe first (PROBE; its runs from PROBE_CARRY, if one was brought back), then, in the time left, the
    # recipe its rule leaves: the probed recipe's folder, its finished runs reused where their setting stands
    RECIPE_S="${RECIPE_S:-540}"
    RECIPE="${PROBE:-configs/experiments/gpu-efficiency-probe.yaml}"
    recipe_out=$(recipe_folder) || exit 1
    recipe_chunks "${PROBE_CARRY:-}"
    if [ "$rc" -eq 0 ] && probe_choice; then
      echo "[lease] probe done after $(elapsed) s; the recipe goes on from $RECIPE"
      recipe_chunks "${CARRY:-}"
    elif [ "$rc" -eq 0 ]; then
      echo "[lease] the probe finished but its rule could not be applied (above: why)"; rc=1
    fi
    recipe_report
    ;;
  suite)
    if [ "${SUITE_PREFIX:-1}" = 1 ]; then
      pair
      python3 benchmarks/text_attention.py --device cuda
      # the compiled blocks as graphs (the compiled loop's first rows) replay what the compiled blocks compute?
      timeout 120 python3 benchmarks/block_graphs_check.py --device cuda --model D --compile-blocks
      layout
    fi
    python3 benchmarks/gpu_suite.py --device cuda --budget "${SUITE_S:-380}" --out-dir /tmp/suite-out ${SUITE_ARGS:-}
    cp /tmp/suite-out/*.json /tmp/suite-out/*.md "$OUT/"
    echo "[lease] suite done after $(elapsed) s"
    ;;
  heads)
    rm -rf /tmp/heads-out
    # the compiled loop for COMPILED's scopes after the graphs' section (skipped in a --tiny rehearsal: no CPU compile)
    COMPILED="${COMPILED-blocks+all-graphs}"
    heads_skip=build,students,loop,peer,train_step,table
    if [ -n "$COMPILED" ]; then
      compiled_args=(--compiled "$COMPILED"); heads_budget=400
    else
      compiled_args=(); heads_skip="$heads_skip,loop_compiled"; heads_budget=240
    fi
    python3 benchmarks/gpu_suite.py --device "${HEADS_DEVICE:-cuda}" --budget "${SUITE_S:-$heads_budget}" \
      --out-dir /tmp/heads-out --skip "$heads_skip" "${compiled_args[@]}" ${SUITE_ARGS:-}
    for f in /tmp/heads-out/*.json /tmp/heads-out/*.md; do cp "$f" "$OUT/heads-$(basename "$f")"; done
    echo "[lease] heads done after $(elapsed) s"
    # then where E's kernels go: A and E with every graph (so that the host hides least of the kernels; each row's
    # GPU busy % says how far), each without one part of its step, and with the token-region term in groups of 64
    # (A's row: the noise floor) (~80 s)
    parts_args="--size full --batch-size 256 --block 5 --steps 20 --warmup 10 --workers 8 --cuda-graphs"
    parts_args="$parts_args --cuda-graphs-text --cuda-graphs-heads --cuda-graphs-losses"
    python3 benchmarks/train_step.py --device "${HEADS_DEVICE:-cuda}" --only A,E --parts --teachers "" \
      --with loss.local_group_size=64 ${PARTS_ARGS:-$parts_args} --json-out "$OUT/heads-parts.json"
    echo "[lease] parts done after $(elapsed) s"
    ;;
  collect) collect ;;  # what an earlier recipe call left, again
  pair) pair ;;
  layout) layout ;;
  graphs) python3 benchmarks/graphs_real_run.py --device "${GRAPHS_DEVICE:-cuda}" --workers 8 \
            --json-out "$OUT/graphs-real-run.json" ${GRAPHS_ARGS:-} ;;
  *) echo "MODE must be recipe, probe-recipe, suite, heads, collect, pair, layout or graphs, got '$MODE'"; exit 2 ;;
esac
