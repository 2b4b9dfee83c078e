"""`train experiment efficiency|ablation|reinforcement --config FILE`: the 12M-style studies at any scale.

efficiency (MobileCLIP DataCompDR-12M style): plain vs reinforced vs online teacher over seeds
  (cxrdr/experiments/efficiency.py: mean ± 95 % CI, samples to plain's final mean R, break-even runs, bars).
ablation: students A-E trained alike and evaluated alike plus a k_ratio sweep (cxrdr/experiments/ablation.py).
reinforcement: K stored views, B_syn, caption source, 1 vs 2 teachers, lambda; equal samples, over seeds
  (cxrdr/experiments/reinforcement.py).

The recipe (read by cxrdr/experiments/recipe_file.py, its runs' configs made by recipe.py; every key documented in
configs/experiments/cpu-demo.yaml) names the shards, built when missing; finished runs and evaluations are reused
(cxrdr/experiments/runs.py).
In chunks (a GPU lent for a few minutes per command): ``--chunk-s N`` stops between units of work after N
seconds (exit 3: rerun to continue), ``--status`` lists what is done and what is left (efficiency;
cxrdr/experiments/chunks.py, status.py; scripts/gpu-experiment.sh runs both).
"""
from __future__ import annotations

import pkgutil
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.errors import UserError
from cxrdr.experiments.chunks import ChunkTimeUp, start_chunk
from cxrdr.experiments.recipe_file import load_recipe, recipe_out

# the experiments' modules import the trainer and the evaluation (torch, timm, transformers: ~5 s on a 2-core box):
# imported by the command that runs one, not by every `train` command's start (`train --help`, `train run`)
EXPERIMENTS = {"efficiency": "cxrdr.experiments.efficiency:efficiency_experiment",
               "ablation": "cxrdr.experiments.ablation:ablation_experiment",
               "reinforcement": "cxrdr.experiments.reinforcement:reinforcement_experiment"}
WORK_LEFT = 3  # exit code of a chunk that stopped with work left, and of --status while work is left


def cli_experiment(
    name: Annotated[str, typer.Argument(help="efficiency (plain vs reinforced vs online teacher, same "
                                             "samples seen, over seeds), ablation (students A-E + k_ratio "
                                             "sweep) or reinforcement (K, B_syn, captions, teachers, lambda).")],
    config: Annotated[Path, typer.Option(help="Experiment recipe YAML, e.g. configs/experiments/cpu-demo.yaml, "
                                              "or a shipped recipe's name (cpu-demo).")],
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default: the recipe's 'out' / NAME).")] = None,
    fresh: Annotated[bool, typer.Option(help="Retrain every run even when a finished identical run "
                                             "exists.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    chunk_s: Annotated[Optional[float], typer.Option(
        help="Stop cleanly before the next unit of work (shard build, teacher, add-teacher, run, evaluation, "
             "step benchmark) once this many seconds have passed; at least one unit runs. Exit 3 when work is "
             "left: rerun to continue (interrupted runs continue from their last.pt with resume_runs: true).")] = None,
    chunk_hard_s: Annotated[Optional[float], typer.Option(
        help="With --chunk-s: when the caller kills the command (scripts/gpu-experiment.sh: HARD_S). A run whose "
             "training and evaluation would outlast it, by this command's own measured step and evaluation "
             "times, does not start.")] = None,
    status: Annotated[bool, typer.Option(help="Only list the units done and left (efficiency), with what the done "
                                              "ones measured; exit 0 when nothing is left, 3 otherwise.")] = False,
    partial: Annotated[bool, typer.Option(help="Only write the results of the runs finished so far to OUT/partial/ "
                                               "(efficiency; a recipe cut short): nothing is built, trained, "
                                               "evaluated or timed.")] = False,
) -> None:
    """Run an experiment recipe: build shards if missing, train every run, evaluate, write tables and plots."""
    if name not in EXPERIMENTS:
        raise UserError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    from cxrdr.experiments.partial import partial_results
    from cxrdr.experiments.status import efficiency_status, format_status, left

    experiment = pkgutil.resolve_name(EXPERIMENTS[name])
    try:
        recipe = load_recipe(config)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if fresh:
        recipe["reuse_runs"] = False
    if quiet:
        recipe.setdefault("train", {})["progress"] = False
    out_dir = Path(out or recipe_out(recipe) / name)
    if status:
        if name != "efficiency":
            raise UserError("--status lists the units of the efficiency experiment only")
        units = efficiency_status(recipe, out_dir)
        typer.echo(format_status(recipe, out_dir, units))
        raise typer.Exit(WORK_LEFT if left(units) else 0)
    if partial:
        if name != "efficiency":
            raise UserError("--partial reports the efficiency experiment's finished runs only")
        if fresh:
            raise UserError("--partial reads the finished runs as they are: leave out --fresh (it would retrain)")
        result = partial_results(recipe, out_dir)
        typer.echo(f"{name}: {result['partial']['note']} Wrote {out_dir}/partial/results.json, table.md and plots")
        return
    started = time.perf_counter()
    start_chunk(chunk_s, chunk_hard_s)
    try:
        experiment(recipe, out_dir, progress=not quiet)
    except ChunkTimeUp as stop:
        typer.echo(f"{name}: {stop} ({time.perf_counter() - started:.0f} s); rerun the command to continue", err=True)
        if name == "efficiency":
            typer.echo(format_status(recipe, out_dir, efficiency_status(recipe, out_dir)))
        raise typer.Exit(WORK_LEFT)
    finally:
        start_chunk(None)
    typer.echo(f"{name} finished in {time.perf_counter() - started:.0f} s; wrote {out_dir}/results.json, "
               f"table.md and plots")
