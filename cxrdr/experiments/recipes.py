"""`train experiment efficiency|ablation --config FILE`: the 12M-style studies at any scale.

efficiency (MobileCLIP DataCompDR-12M style): train/efficiency_experiment.py (plain vs reinforced vs
  online teacher over seeds: mean ± 95 % CI, samples to plain's final mean R, break-even runs, bars).
reinforcement: train/reinforcement_ablation.py (K stored views, B_syn, caption source, 1 vs 2 teachers,
  lambda; equal samples, over seeds).
ablation: students A-E trained alike and evaluated alike (quality table: retrieval, AUC,
  localisation; cost table: throughput, step ms, latency, peak memory, GFLOPs, patch usage),
  plus a k_ratio sweep (1.0, 0.75, 0.5, 0.25) with k_ratio vs R@1 / step time / memory plots.

The recipe YAML names the shards (reused when ``dataset.json`` exists, built otherwise through
``cxrdr.reinforce.build.build``), the shared training config (``cxrdr.train.config.TrainConfig`` fields),
per-run overrides and the evaluation options; see configs/experiments/cpu-demo.yaml for every
key, documented. Finished runs (RUN/summary.json + RUN/last.pt with the same config) are reused,
so an interrupted experiment continues where it stopped.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

EXPERIMENTS = ("efficiency", "ablation", "reinforcement")
TOP_KEYS = {"name", "out", "threads", "device", "shards", "train", "eval", "efficiency", "ablation",
            "reuse_runs", "isolated_efficiency", "teachers", "reinforcement"}
DEFAULT_EFFICIENCY_RUNS = {"plain": {"mode": "plain"}, "reinforced": {"mode": "reinforced"}}
DEFAULT_VARIANTS = {"A": "cpu-A", "B": "cpu-B", "C": "cpu-C", "D": "cpu-D", "E": "cpu-E"}
CURVE_METRICS = ("mean_recall", "i2t_R@1", "t2i_R@1", "probe_mean_auc")


# --------------------------------------------------------------------------- recipe


def load_recipe(path: str | Path) -> dict:
    from cxrdr.common.yamlio import read_yaml_mapping

    path = Path(path)
    data = read_yaml_mapping(path, "experiment keys (name, shards, train, eval, efficiency, ablation)")
    unknown = sorted(set(data) - TOP_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown experiment key(s) {unknown}; known: {sorted(TOP_KEYS)}")
    if "shards" not in data or not isinstance(data["shards"], dict) or "dir" not in data["shards"]:
        raise ValueError(f"{path}: 'shards: {{dir: ...}}' is required (folder to reuse or build)")
    data.setdefault("name", path.stem)
    data["_path"] = str(path)
    return data


def ensure_shards(spec: dict, progress: bool = True) -> Path:
    """The recipe's shard folder: reused when complete, else built (or resumed) with its options."""
    from cxrdr.reinforce.build import BuildOptions, build

    out = Path(spec["dir"])
    if (out / "dataset.json").is_file() and not spec.get("rebuild", False):
        return out
    options = dict(spec.get("build") or {})
    if not options:
        raise ValueError(f"shards {out} do not exist and the recipe gives no 'shards.build' options")
    if "aug" in options and isinstance(options["aug"], dict):
        from cxrdr.common.augment import AugConfig

        options["aug"] = AugConfig.from_json(options["aug"])
    known = set(BuildOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"shards.build: unknown build option(s) {unknown}; known: {sorted(known)}")
    resume = (out / "stats").is_dir()
    if spec.get("rebuild") and out.exists():
        import shutil

        shutil.rmtree(out)
        resume = False
    typer.echo(f"building shards in {out} ({options.get('source', 'phantom')}, "
               f"teachers {options.get('teachers', 'random:tiny')})", err=True)
    build(BuildOptions(out=out, resume=resume, progress=progress, **options))
    return out


def train_config(recipe: dict, shards: Path, run_dir: Path, overrides: dict, experiment: str | None = None):
    """TrainConfig = recipe['train'] < recipe[experiment]['train'] < per-run overrides; shards/out forced."""
    from cxrdr.train.config import TrainConfig

    data = copy.deepcopy(recipe.get("train") or {})
    layered = dict((recipe.get(experiment) or {}).get("train") or {}) if experiment else {}
    layered.update(overrides or {})
    for key, value in layered.items():
        if key == "model_overrides":
            data.setdefault("model_overrides", {}).update(value)
        else:
            data[key] = value
    data.update(shards=str(shards), out=str(run_dir))
    if recipe.get("device"):
        data.setdefault("device", recipe["device"])
    return TrainConfig.load(None, **data)


def run_training(cfg, reuse: bool = True) -> dict:
    """Train (or reuse a finished identical run); returns the loop summary plus wall seconds."""
    import yaml

    from cxrdr.train.loop import train

    run_dir = Path(cfg.out)
    summary_path = run_dir / "summary.json"
    if reuse and summary_path.is_file() and (run_dir / "last.pt").is_file() \
            and (run_dir / "config.yaml").is_file():
        previous = yaml.safe_load((run_dir / "config.yaml").read_text())
        if previous == yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False)):
            summary = json.loads(summary_path.read_text())
            summary.setdefault("wall_s", None)
            summary["reused"] = True
            return summary
    if run_dir.exists():  # a different or unfinished run: start it afresh
        import shutil

        shutil.rmtree(run_dir)
    started = time.perf_counter()
    summary = train(cfg)
    summary["wall_s"] = round(time.perf_counter() - started, 2)
    summary_path.write_text(json.dumps(summary, indent=1, default=str))
    return summary


def eval_curve(run_dir: Path, samples_per_step: int) -> list[dict]:
    """The loop's validation records as points of metric vs samples seen."""
    path = Path(run_dir) / "metrics.jsonl"
    points = []
    if not path.is_file():
        return points
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "eval":
            points.append({"step": rec["step"], "samples_seen": rec["step"] * samples_per_step,
                           **{k: rec.get(k) for k in CURVE_METRICS}})
    return points


def evaluate_run(recipe: dict, run_dir: Path, shards: Path, isolated: bool, efficiency: bool = True) -> dict:
    """Full evaluation of RUN/last.pt on the test split (cost measured in a fresh process on CPU,
    and only when ``efficiency`` and the recipe's eval options allow it)."""
    import torch

    from cxrdr.train.evaluation.efficiency import measure_in_subprocess
    from cxrdr.train.evaluation.report import write_json
    from cxrdr.train.evaluation.runner import evaluate, summary_row

    opts = dict(recipe.get("eval") or {})
    split = opts.pop("split", "test")
    eff_batch = int(opts.pop("efficiency_batch", 32))
    measure = bool(opts.pop("efficiency", True)) and efficiency
    ckpt = run_dir / "last.pt"
    request = {"split": split, "efficiency_batch": eff_batch, "efficiency": measure, "isolated": isolated, **opts}
    previous = _previous_evaluation(run_dir / f"eval-{split}", ckpt, request)
    if previous is not None:
        return previous
    use_subprocess = measure and isolated and not torch.cuda.is_available()
    results = evaluate(str(ckpt), shards, split, run_dir / f"eval-{split}", progress=False, quiet=True,
                       efficiency=measure and not use_subprocess, efficiency_batch=eff_batch, **opts)
    if use_subprocess:
        results["efficiency"] = measure_in_subprocess(str(ckpt), batch_size=eff_batch)
        results["summary"] = summary_row(results)
        write_json(results, run_dir / f"eval-{split}" / "eval.json")
    write_json(request, run_dir / f"eval-{split}" / "eval_request.json")
    return results


def _previous_evaluation(eval_dir: Path, ckpt: Path, request: dict) -> dict | None:
    """The eval.json of an identical earlier request on this very checkpoint (a reused run), else None."""
    from cxrdr.train.evaluation.report import jsonable

    done, asked = eval_dir / "eval.json", eval_dir / "eval_request.json"
    if not (done.is_file() and asked.is_file() and ckpt.is_file()):
        return None
    if done.stat().st_mtime < ckpt.stat().st_mtime or json.loads(asked.read_text()) != jsonable(request):
        return None
    return json.loads(done.read_text())


def _row(name: str, summary: dict, results: dict, batch: int) -> dict:
    row = {"run": name, **results["summary"]}
    row.update({"samples_seen": summary.get("samples_seen"), "wall_s": summary.get("wall_s"),
                "step_ms": summary.get("mean_step_ms"),
                "train_img_per_s": (1000.0 * batch / summary["mean_step_ms"]
                                    if summary.get("mean_step_ms") else None)})
    return row


def _set_threads(recipe: dict) -> None:
    if recipe.get("threads"):
        import torch

        torch.set_num_threads(int(recipe["threads"]))


# --------------------------------------------------------------------------- efficiency


def interleaved_step_ms(cfgs: dict, steps: int = 10, warmup: int = 2) -> dict:
    """Median ms per optimiser step of each training config, steps interleaved round-robin.

    The runs' own mean step time depends on whatever else the machine did meanwhile; here every
    config takes one step in turn, so all see the same background load and the ratios hold.
    Uses the loop's Trainer (data loading + online teacher + forward + losses + backward + AdamW).
    """
    import torch

    from cxrdr.train.loop import Trainer

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    trainers = {}
    for name, cfg in cfgs.items():
        trainer = Trainer(cfg)
        trainers[name] = (trainer, trainer._batches())
    times: dict = {name: [] for name in trainers}
    for round_ in range(warmup + steps):
        for name, (trainer, batches) in trainers.items():
            sync()
            t0 = time.perf_counter()
            trainer.train_step(batches, log_balance=False)
            sync()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * sorted(t)[len(t) // 2] for name, t in times.items()}


# --------------------------------------------------------------------------- ablation


ABLATION_QUALITY = ["i2t_R@1", "t2i_R@1", "mean_recall", "chance_mean_recall", "probe_auc", "zeroshot_auc",
                    "pointing_z", "chance_pointing_z", "iou_z", "pointing_attn", "chance_pointing_attn", "iou_attn",
                    "deletion_auc", "insertion_auc", "sparsity", "train_img_per_s", "step_ms"]


def _train_and_evaluate_seeds(recipe: dict, shards: Path, run_root: Path, model: str, model_overrides: dict,
                              seeds: list[int], label: str) -> tuple[list[dict], list[dict]]:
    """One model trained and evaluated once per seed; cost (efficiency) measured on the first seed only,
    since it is a property of the architecture. Returns (per-seed rows, per-seed run records)."""
    reuse = recipe.get("reuse_runs", True)
    isolated = recipe.get("isolated_efficiency", True)
    rows, runs = [], []
    for seed in seeds:
        overrides = {"model": model, "seed": int(seed)}
        if model_overrides:
            overrides["model_overrides"] = model_overrides
        cfg = train_config(recipe, shards, run_root / f"seed-{seed}", overrides, "ablation")
        typer.echo(f"[ablation] {label}: {model} seed {seed}, {cfg.steps} steps", err=True)
        summary = run_training(cfg, reuse)
        results = evaluate_run(recipe, Path(cfg.out), shards, isolated, efficiency=seed == seeds[0])
        rows.append(_row(label, summary, results, cfg.batch_size * cfg.accum_steps))
        runs.append({"seed": int(seed), "train_summary": summary, "final": results["summary"]})
    return rows, runs


def ablation_experiment(recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    """Students A-E trained alike over ``ablation.seeds`` (mean ± sd), then the k_ratio sweep (first seed)."""
    from cxrdr.train.evaluation.report import write_json

    _set_threads(recipe)
    shards = ensure_shards(recipe["shards"], progress)
    spec = recipe.get("ablation") or {}
    variants = spec.get("variants") or DEFAULT_VARIANTS
    if isinstance(variants, list):
        variants = {str(v).split("-")[-1]: v for v in variants}
    seeds = [int(s) for s in spec.get("seeds") or [int((recipe.get("train") or {}).get("seed", 0))]]
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, per_run = [], {}
    for label, model in variants.items():
        seed_rows, runs = _train_and_evaluate_seeds(recipe, shards, out_dir / "runs" / f"variant-{label}",
                                                    model, {}, seeds, label)
        rows.append(_over_seeds(label, seed_rows))
        per_run[label] = {"model": model, "seeds": runs}

    sweep = spec.get("k_ratio_sweep") or {}
    sweep_rows = []
    for k in (sweep.get("values", [1.0, 0.75, 0.5, 0.25]) if sweep else []):
        model = sweep.get("model", "cpu-E")
        mo = {"k_ratio": float(k)}
        if sweep.get("tie_keep_rate", True):
            mo["keep_rate"] = float(k)
        seed_rows, runs = _train_and_evaluate_seeds(recipe, shards, out_dir / "runs" / f"k_ratio-{k}", model, mo,
                                                    seeds[:1], f"k={k}")
        row = _over_seeds(f"k={k}", seed_rows)
        row["k_ratio"] = float(k)
        sweep_rows.append(row)
        per_run[f"k_ratio-{k}"] = {"model": model, "overrides": mo, "seeds": runs}
    relative = _relative_to(rows, "A")
    result = {"experiment": "ablation", "recipe": recipe, "shards": str(shards), "seeds": seeds, "table": rows,
              "k_ratio_sweep": sweep_rows, "relative_to_A": relative, "runs": per_run}
    write_json(result, out_dir / "results.json")
    md = _ablation_markdown(recipe, shards, seeds, rows, relative, sweep, sweep_rows, out_dir)
    (out_dir / "table.md").write_text("\n".join(md))
    typer.echo("\n".join(md))
    return result


def _over_seeds(label: str, seed_rows: list[dict]) -> dict:
    """Quality as mean ± sd over seeds; cost columns from the seed that measured them."""
    from cxrdr.train.evaluation.report import COST_COLUMNS, seed_summary

    row = seed_summary(label, seed_rows, ABLATION_QUALITY)
    for col in COST_COLUMNS:
        row[col] = next((r[col] for r in seed_rows if r.get(col) is not None), None)
    for metric, chance in (("mean_recall", "chance_mean_recall"), ("pointing_z", "chance_pointing_z"),
                           ("pointing_attn", "chance_pointing_attn")):
        if row.get(metric) is not None and row.get(chance):
            row[f"{metric}_x_chance"] = row[metric] / row[chance]
    return row


def _ablation_markdown(recipe, shards, seeds, rows, relative, sweep, sweep_rows, out_dir: Path) -> list[str]:
    from cxrdr.train.evaluation.report import COST_COLUMNS, markdown_table, markdown_table_sd, plot_bars

    md = [f"# Ablation `{recipe['name']}`", "",
          f"shards `{shards}`; every variant trained with the same recipe and samples, seeds {seeds} "
          f"(mean ± sd over seeds); test split. *chance*: a random ranking (mean R) or a random heatmap "
          f"on the same grid and boxes (pointing game).", "",
          "## Quality", "", markdown_table_sd(rows, ABLATION_QUALITY[:-2]), "",
          "Against chance (mean over seeds):", "",
          markdown_table(rows, ["mean_recall_x_chance", "pointing_z_x_chance", "pointing_attn_x_chance"],
                         first="run"), "",
          "## Cost", "",
          "infer img/s, synth step ms, latency, GFLOPs, peak MB: synthetic inputs at the model size and at E's "
          "target keep rate (peak MB: CUDA max allocated, or peak RSS of a fresh process on CPU); loop step ms / "
          "train img/s: the training loop's mean step (data + forward + backward + update), mean over seeds.", "",
          markdown_table_sd(rows, COST_COLUMNS + ["step_ms", "train_img_per_s"]), ""]
    if relative.get("E"):
        md += ["E relative to A: " + "; ".join(f"{k} {v:.2f}x" for k, v in relative["E"].items()
                                              if v is not None), ""]
    if sweep_rows:
        md += [f"## k_ratio sweep ({sweep.get('model', 'cpu-E')}, seed {seeds[0]}, keep_rate tied: "
               f"{sweep.get('tie_keep_rate', True)})", "",
               markdown_table(sweep_rows, ["k_ratio", "i2t_R@1", "t2i_R@1", "mean_recall", "probe_auc",
                                           "pointing_z", "pointing_attn", "step_ms", "peak_memory_mb",
                                           "step_memory_delta_mb", "gflops_per_img", "inference_img_per_s"],
                              first="run"), "", "![k_ratio sweep](k_ratio_sweep.png)", ""]
        _plot_sweep(sweep_rows, out_dir / "k_ratio_sweep.png")
    plot_bars({r["run"]: r.get("inference_img_per_s") for r in rows}, "images / s",
              "inference throughput", out_dir / "throughput.png")
    plot_bars({r["run"]: r.get("step_ms") for r in rows}, "ms / step", "training step time",
              out_dir / "step_time.png")
    md += ["![throughput](throughput.png)", "", "![step time](step_time.png)", ""]
    return md


def _relative_to(rows: list[dict], base: str) -> dict:
    by = {r["run"]: r for r in rows}
    if base not in by:
        return {}
    keys = ("inference_img_per_s", "train_img_per_s", "synthetic_train_img_per_s", "step_ms", "latency_ms",
            "peak_memory_mb", "gflops_per_img")
    out = {}
    for name, row in by.items():
        out[name] = {k: (row[k] / by[base][k] if row.get(k) is not None and by[base].get(k) else None)
                     for k in keys}
    return out


def _plot_sweep(rows: list[dict], path: Path) -> None:
    from cxrdr.train.evaluation.report import _plt

    plt = _plt()
    ks = [r["k_ratio"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    import torch

    cuda = torch.cuda.is_available()
    memory = ("peak_memory_mb", "peak CUDA memory MB") if cuda else \
        ("step_memory_delta_mb", "train-step memory MB (RSS above start)")
    for ax, (key, label) in zip(axes, (("i2t_R@1", "i2t R@1 (test)"), ("step_ms", "train step ms"), memory)):
        ax.plot(ks, [np_nan(r.get(key)) for r in rows], "-o", label=key.replace("_", " "))
        if key == "i2t_R@1":
            ax.plot(ks, [np_nan(r.get("t2i_R@1")) for r in rows], "-s", label="t2i R@1")
            ax.legend(fontsize=7)
        ax.set_xlabel("k_ratio")
        ax.set_ylabel(label)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def np_nan(v):
    return float("nan") if v is None else v


# --------------------------------------------------------------------------- CLI


def cli_experiment(
    name: Annotated[str, typer.Argument(help="efficiency (plain vs reinforced vs online teacher, same "
                                             "samples seen, over seeds), ablation (students A-E + k_ratio "
                                             "sweep) or reinforcement (K, B_syn, captions, teachers, lambda).")],
    config: Annotated[Path, typer.Option(help="Experiment recipe YAML, e.g. "
                                              "configs/experiments/cpu-demo.yaml.")],
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default: the recipe's 'out' / NAME).")] = None,
    fresh: Annotated[bool, typer.Option(help="Retrain every run even when a finished identical run "
                                             "exists.")] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> None:
    """Run an experiment recipe: build shards if missing, train every run, evaluate, write tables and plots."""
    from cxrdr.common.errors import UserError

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
    from cxrdr.experiments.efficiency import efficiency_experiment
    from cxrdr.experiments.reinforcement import reinforcement_experiment

    run = {"efficiency": efficiency_experiment, "ablation": ablation_experiment,
           "reinforcement": reinforcement_experiment}[name]
    run(recipe, Path(out_dir), progress=not quiet)
    typer.echo(f"{name} finished in {time.perf_counter() - started:.0f} s; wrote {out_dir}/results.json, "
               f"table.md and plots")
