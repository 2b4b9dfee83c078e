"""`train experiment reinforcement`: what each part of the reinforcement buys, at equal samples seen.

MobileCLIP's ablation on the CPU phantom world: one student, a base reinforced run (recipe
``reinforcement.train`` over ``train``) and studies that change one TrainConfig field at a time:

    K          aug_limit        the first k of the K stored augmentations (1, 2, 4, 8)
    B_syn      loss.use_syn     CLIP + distillation also on (view, synthetic caption) pairs
    captions   caption_sources  RDF-template vs report-sentence synthetic captions
    teachers   teachers         1 vs 2 stored teachers (the ensemble)
    lambda     loss.lambda_distill 0 (reinforced data, CLIP only), 0.3, 0.7, 1.0 (distillation only)
    (any other TrainConfig key the recipe names, e.g. loss.w_affinity for the relational distillation)

Every setting runs for every seed in ``reinforcement.seeds`` (>= 2), quality as mean ± sd and 95 % CI over
seeds on the test split (chance next to mean R). Identical settings (the base appears in every study) are
trained once; two copies of the command split the runs (each claims a run folder). Outputs: results.json
(per study, per value: final_mean_recall list and the mean row), table.md.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import typer

from cxrdr.common.atomic import write_text_atomic
from cxrdr.experiments.recipe import recipe_seeds, set_threads, train_config
from cxrdr.experiments.runs import claimed_in_turn, evaluate_run, result_row, run_training
from cxrdr.experiments.stats import t_interval
from cxrdr.experiments.teacher_prep import students_and_teachers
from cxrdr.train.evaluation.report import markdown_table_sd, seed_summary, write_json

QUALITY = ["i2t_R@1", "t2i_R@1", "mean_recall", "chance_mean_recall", "probe_auc", "zeroshot_auc"]
DEFAULT_STUDIES = {
    "K": {"key": "aug_limit", "values": [1, 2, 4, 8]},
    "B_syn": {"key": "loss.use_syn", "values": [True, False]},
    "captions": {"key": "caption_sources", "values": [["rdf", "normal"], ["report"]]},
    "lambda": {"key": "loss.lambda_distill", "values": [0.0, 0.3, 0.7, 1.0]},
}


def setting_overrides(base: dict, key: str, value) -> dict:
    """``base`` TrainConfig overrides with ``key`` (``loss.X`` / ``optim.X`` for nested dicts) set to ``value``."""
    out = json.loads(json.dumps(base))
    if "." in key:
        group, field = key.split(".", 1)
        out.setdefault(group, {})[field] = value
    else:
        out[key] = value
    return out


def _run_name(recipe: dict, shards: Path, overrides: dict) -> str:
    """Folder name of a setting: a hash of its resolved TrainConfig, so settings that resolve alike (e.g. the
    base's lambda in the lambda study and use_syn on in the B_syn study) are trained once."""
    cfg = train_config(recipe, shards, Path("."), overrides, "reinforcement").to_dict()
    cfg.pop("out", None)
    return hashlib.sha1(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:10]


def reinforcement_experiment(recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    set_threads(recipe)
    shards, teachers = students_and_teachers(recipe, progress, experiment="reinforcement")
    spec = recipe.get("reinforcement") or {}
    seeds = recipe_seeds(recipe, spec, default=[0, 1])
    base = {"mode": "reinforced", **(spec.get("train") or {})}
    studies = spec.get("studies") or DEFAULT_STUDIES
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {}  # (study, value) -> its run folders, one per seed; identical settings (the base recurs in
    configs = {}   # every study) share them. run folder -> (label, seed, TrainConfig)
    for study, s in studies.items():
        for value in s["values"]:
            overrides = setting_overrides(base, s["key"], value)
            name = _run_name(recipe, shards, overrides)
            settings[study, _short(value)] = []
            for seed in seeds:
                cfg = train_config(recipe, shards, out_dir / "runs" / name / f"seed-{seed}",
                                   {**overrides, "seed": seed}, "reinforcement")
                configs.setdefault(Path(cfg.out), (f"{study} {s['key']}={_short(value)}", seed, cfg))
                settings[study, _short(value)].append(Path(cfg.out))
    reuse = recipe.get("reuse_runs", True)

    def train_and_evaluate(run_dir: Path, lock) -> dict:
        label, seed, cfg = configs[run_dir]
        typer.echo(f"[reinforcement] {label} seed {seed}", err=True)
        summary = run_training(cfg, reuse, lock=lock)
        results = evaluate_run(recipe, run_dir, shards, False, efficiency=False)
        return {**result_row("", summary, results, cfg.batch_size * cfg.accum_steps), "seed": seed}

    def busy(run_dir: Path) -> None:
        typer.echo(f"[reinforcement] {configs[run_dir][0]} seed {configs[run_dir][1]}: another process has "
                   f"it; later", err=True)

    # two copies of the command split the runs (each claims a run folder for training and evaluation)
    done = claimed_in_turn(list(configs), train_and_evaluate, busy)
    tables = {}
    for study, s in studies.items():
        tables[study] = [
            _setting_row(f"{s['key']}={_short(value)}", [done[run_dir] for run_dir in settings[study, _short(value)]])
            for value in s["values"]]
    result = {"experiment": "reinforcement", "recipe": recipe, "shards": str(shards), "seeds": seeds,
              "base": base, "teachers": teachers, "studies": tables}
    write_json(result, out_dir / "results.json")
    md = reinforcement_markdown(recipe, shards, seeds, base, studies, tables)
    write_text_atomic(out_dir / "table.md", "\n".join(md))
    typer.echo("\n".join(md))
    return result


def _setting_row(label: str, seed_rows: list[dict]) -> dict:
    row = seed_summary(label, seed_rows, QUALITY + ["samples_seen"])
    for col in QUALITY:
        row[f"{col}_ci"] = t_interval(row[f"{col}_seeds"])[1]
    row["final_mean_recall"] = row["mean_recall_seeds"]
    return row


def _short(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def reinforcement_markdown(recipe, shards, seeds, base, studies, tables) -> list[str]:
    md = [f"# Reinforcement ablation `{recipe['name']}`", "",
          f"shards `{shards}`; seeds {seeds}; base reinforced run `{json.dumps(base)}`; every setting sees the same "
          f"samples; test split, mean ± sd over seeds (95 % CI in results.json); chance = a random ranking.", ""]
    for study, rows in tables.items():
        md += [f"## {study} (`{studies[study]['key']}`)", "", markdown_table_sd(rows, QUALITY + ["samples_seen"]), ""]
    return md
