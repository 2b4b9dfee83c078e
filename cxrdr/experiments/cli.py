"""`train experiment efficiency|ablation|reinforcement --config FILE`: the 12M-style studies at any scale.

efficiency (MobileCLIP DataCompDR-12M style): plain vs reinforced vs online teacher over seeds
  (cxrdr/experiments/efficiency.py: mean ± 95 % CI, samples to plain's final mean R, break-even runs, bars).
ablation: students A-E trained alike and evaluated alike plus a k_ratio sweep (cxrdr/experiments/ablation.py).
reinforcement: K stored views, B_syn, caption source, 1 vs 2 teachers, lambda; equal samples, over seeds
  (cxrdr/experiments/reinforcement.py).

The recipe (cxrdr/experiments/recipe.py; every key documented in configs/experiments/cpu-demo.yaml) names
the shards, built when missing; finished runs and evaluations are reused (cxrdr/experiments/runs.py).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.errors import UserError
from cxrdr.experiments.ablation import ablation_experiment
from cxrdr.experiments.efficiency import efficiency_experiment
from cxrdr.experiments.recipe import load_recipe
from cxrdr.experiments.reinforcement import reinforcement_experiment

EXPERIMENTS = {"efficiency": efficiency_experiment, "ablation": ablation_experiment,
               "reinforcement": reinforcement_experiment}


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
) -> None:
    """Run an experiment recipe: build shards if missing, train every run, evaluate, write tables and plots."""
    if name not in EXPERIMENTS:
        raise UserError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    try:
        recipe = load_recipe(config)
    except (FileNotFoundError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if fresh:
        recipe["reuse_runs"] = False
    if quiet:
        recipe.setdefault("train", {})["progress"] = False
    out_dir = out or Path(recipe.get("out", f"runs/experiments/{recipe['name']}")) / name
    started = time.perf_counter()
    EXPERIMENTS[name](recipe, Path(out_dir), progress=not quiet)
    typer.echo(f"{name} finished in {time.perf_counter() - started:.0f} s; wrote {out_dir}/results.json, "
               f"table.md and plots")
