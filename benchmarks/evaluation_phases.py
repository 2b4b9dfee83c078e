"""Where a student's final evaluation spends its time: `evaluate` with the GPU recipe's `eval:` options on a student
with the recipe's model and heads, phase by phase (``meta.phase_s``), optionally under cProfile.

    python benchmarks/evaluation_phases.py                                  # ViT-S/16 D at 224, as docs/gpu.md
    python benchmarks/evaluation_phases.py --model tiny-D --size 64 --students 200 --report 40   # a quick look
    python benchmarks/evaluation_phases.py --profile 25                     # + the 25 costliest functions

Builds (once, into --work) a students' phantom set (source seed 0) and a report phantom (source seed 103, all test)
with the random:tiny placeholder teacher, trains the student 2 steps (its weights do not matter to the cost), then
times one evaluation on ``--threads`` CPU threads. Prints the whole and each phase's seconds; with --profile, the
functions that took the most time themselves (the model's ``linear`` and attention lead on a CPU). At the defaults it
took 346.6 s on one thread of a 2-core box, 334 s of it in the model's forward passes (stop 59, docs/gpu.md).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

RECIPE_HEADS = dict(k_anneal_steps=60, local_attention="cosine", local_attention_temperature=0.1, head_layer=0,
                    head_conv_depth=2, local_text_layer=0)  # configs/experiments/gpu-efficiency.yaml's train
RECIPE_EVAL = dict(text_section="both", min_positives=5, probe_max_train=2000, n_localisation=200,
                   n_faithfulness=16, faith_steps=8, n_plots=6)  # its eval: (efficiency off)


def build_sets(work: Path, size: int, students: int, report: int) -> None:
    from cxrdr.reinforce.build import BuildOptions, build

    def options(out: Path, source: str, source_options: dict, n_aug: int, n_captions: int) -> BuildOptions:
        return BuildOptions(source=source, teachers="random:tiny", out=out, n_aug=n_aug, n_captions=n_captions,
                            store_size=size, shard_size=500, workers=0, batch_size=64, device="cpu", progress=False,
                            source_options=source_options, image_format="jpg", emb_dtype="float16")

    if not (work / "students" / "dataset.json").is_file():
        build(options(work / "students", f"phantom:{students}", {"size": size, "seed": 0}, 2, 2))
    if not (work / "report" / "dataset.json").is_file():
        build(options(work / "report", f"phantom:{report}", {"size": size, "seed": 103, "split": "test"}, 2, 1))


def time_one_evaluation(args, work: Path, run: Path) -> None:
    """One evaluation of ``run`` with the recipe's options: its whole and each phase's seconds printed."""
    from cxrdr.train.evaluation.runner import evaluate

    profiler = cProfile.Profile() if args.profile else None
    started = time.perf_counter()
    if profiler:
        profiler.enable()
    results = evaluate(str(run / "last.pt"), work / "report", "test", work / "eval", progress=False, quiet=True,
                       efficiency=False, train_shards=work / "students", device="cpu", threads=args.threads,
                       **RECIPE_EVAL)
    if profiler:
        profiler.disable()
    total = time.perf_counter() - started
    meta = results["meta"]
    print(f"{args.model} at {args.size} px, {meta['n_samples']} report images, probe on "
          f"{(results.get('probe') or {}).get('n_train')} train images, {meta['threads']} thread(s): {total:.1f} s")
    print(json.dumps(meta["phase_s"]))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/cxrdr-evaluation-phases"))
    parser.add_argument("--model", default="D")
    parser.add_argument("--size", type=int, default=224, help="image size of the sets and the student")
    parser.add_argument("--students", type=int, default=1500, help="studies of the students' set (probe: its train)")
    parser.add_argument("--report", type=int, default=300, help="studies of the report set")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", type=int, default=0, help="print this many costliest functions (cProfile)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="evaluations in this one process, as a recipe's runs are (the later ones reuse the views "
                             "the first decoded: cxrdr.train.evaluation.embedding.cached_full_views)")
    args = parser.parse_args(argv)

    from cxrdr.train.loop import train

    work = args.work / f"{args.model}-{args.size}-{args.students}-{args.report}"
    build_sets(work, args.size, args.students, args.report)
    run = work / "run"
    if not (run / "last.pt").is_file():
        train(dict(shards=str(work / "students"), model=args.model, out=str(run), steps=2, batch_size=4, workers=0,
                   log_every=1, save_every=2, eval_every=0, device="cpu", progress=False, mode="plain",
                   model_overrides={**RECIPE_HEADS, "image_size": args.size}))
    for _ in range(args.repeat):
        time_one_evaluation(args, work, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
