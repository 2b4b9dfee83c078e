"""`train experiment ablation`: students A-E trained alike and evaluated alike, plus a k_ratio sweep.

Quality table: retrieval, AUC, localisation (mean ± sd over ``ablation.seeds``); cost table: throughput,
step ms, latency, peak memory, GFLOPs, patch usage (measured on the first seed: a property of the
architecture); the k_ratio sweep (1.0, 0.75, 0.5, 0.25) plots k_ratio vs R@1 / step time / memory.
"""
from __future__ import annotations

from pathlib import Path

import torch
import typer

from cxrdr.common.atomic import write_text_atomic
from cxrdr.common.plots import pyplot, save_figure
from cxrdr.experiments.margins import eval_hit_blocks, margins_markdown, pooled_margins
from cxrdr.experiments.recipe import recipe_seeds, set_threads, train_config
from cxrdr.experiments.runs import (claimed_in_turn, ensure_shards, evaluate_run, report_set, result_row,
                                   run_training)
from cxrdr.experiments.stats import t_interval
from cxrdr.train.evaluation.report import (COST_COLUMNS, markdown_table, markdown_table_sd, plot_bars, seed_summary,
                                           write_json)

DEFAULT_VARIANTS = {"A": "cpu-A", "B": "cpu-B", "C": "cpu-C", "D": "cpu-D", "E": "cpu-E"}
ABLATION_QUALITY = ["i2t_R@1", "t2i_R@1", "mean_recall", "chance_mean_recall", "oracle_mean_recall",
                    "mean_recall_findings", "probe_auc", "zeroshot_auc",
                    "pointing_z", "chance_pointing_z", "prior_pointing_z", "train_prior_pointing_z", "iou_z",
                    "pointing_z_pathology", "train_prior_pointing_z_pathology",
                    "pointing_attn", "chance_pointing_attn", "prior_pointing_attn", "train_prior_pointing_attn",
                    "iou_attn",
                    "deletion_auc", "insertion_auc", "sparsity", "train_img_per_s", "step_ms"]


def _train_and_evaluate_seeds(recipe: dict, shards: Path, run_root: Path, model: str, model_overrides: dict,
                              seeds: list[int], label: str) -> tuple[list[dict], list[dict], dict]:
    """One model trained and evaluated once per seed; cost (efficiency) measured on the first seed only,
    since it is a property of the architecture. Returns (per-seed rows, per-seed run records, the pointing
    games' margins over the train-box prior pooled over the seeds)."""
    reuse = recipe.get("reuse_runs", True)
    isolated = recipe.get("isolated_efficiency", True)
    configs = {}
    for seed in seeds:
        overrides = {"model": model, "seed": int(seed)}
        if model_overrides:
            overrides["model_overrides"] = model_overrides
        cfg = train_config(recipe, shards, run_root / f"seed-{seed}", overrides, "ablation")
        configs[Path(cfg.out)] = (seed, cfg)

    def train_and_evaluate(run_dir: Path, lock) -> tuple:
        seed, cfg = configs[run_dir]
        typer.echo(f"[ablation] {label}: {model} seed {seed}, {cfg.steps} steps", err=True)
        summary = run_training(cfg, reuse, lock=lock)
        return cfg, summary, evaluate_run(recipe, run_dir, shards, isolated, efficiency=seed == seeds[0])

    def busy(run_dir: Path) -> None:
        typer.echo(f"[ablation] {label}: seed {configs[run_dir][0]} is being trained by another process; later",
                   err=True)

    finished = claimed_in_turn(list(configs), train_and_evaluate, busy)
    done = {configs[run_dir][0]: result for run_dir, result in finished.items()}
    rows, runs = [], []
    for seed in seeds:
        cfg, summary, results = done[seed]
        rows.append(result_row(label, summary, results, cfg.batch_size * cfg.accum_steps))
        runs.append({"seed": int(seed), "train_summary": summary, "final": results["summary"]})
    return rows, runs, pooled_margins([eval_hit_blocks(done[seed][2]) for seed in seeds])


def ablation_experiment(recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    """Students A-E trained alike over ``ablation.seeds`` (mean ± sd), then the k_ratio sweep (first seed)."""
    set_threads(recipe)
    shards = ensure_shards(recipe["shards"], progress)
    spec = recipe.get("ablation") or {}
    variants = spec.get("variants") or DEFAULT_VARIANTS
    if isinstance(variants, list):
        variants = {str(v).split("-")[-1]: v for v in variants}
    seeds = recipe_seeds(recipe, spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, per_run, margins = [], {}, {}
    for label, model in variants.items():
        seed_rows, runs, margins[label] = _train_and_evaluate_seeds(
            recipe, shards, out_dir / "runs" / f"variant-{label}", model, {}, seeds, label)
        rows.append(_over_seeds(label, seed_rows))
        per_run[label] = {"model": model, "seeds": runs}
    sweep = spec.get("k_ratio_sweep") or {}
    sweep_rows = _k_ratio_sweep(recipe, shards, out_dir, sweep, seeds[0], per_run)
    relative = _relative_to(rows, "A")
    bars = ladder_bars(rows, spec.get("bars"))
    report_shards, report_split = report_set(recipe, progress=False)
    result = {"experiment": "ablation", "recipe": recipe, "shards": str(shards), "seeds": seeds, "table": rows,
              "bars": bars, "protocol": {"report_shards": str(report_shards), "report_split": report_split,
                                         "selection": recipe.get("selection") or {}},
              "k_ratio_sweep": sweep_rows, "relative_to_A": relative, "runs": per_run,
              "margins_over_train_prior": {k: v for k, v in margins.items() if v}}
    write_json(result, out_dir / "results.json")
    md = _ablation_markdown(recipe, shards, seeds, rows, relative, sweep, sweep_rows, out_dir,
                            (report_shards, report_split))
    md += ["## Bars", ""] + [f"- {b['bar']}: {_fmt(b['value'])} (limit {_fmt(b['limit'])}): "
                             f"{'MET' if b['met'] else 'MISSED' if b['met'] is False else 'n/a'}" for b in bars]
    md += [""] + margins_markdown(result["margins_over_train_prior"])
    write_text_atomic(out_dir / "table.md", "\n".join(md))
    typer.echo("\n".join(md))
    return result


# The ladder's localisation bars (issue 28): the headline variants' seed-mean pointing games on the report set,
# each an absolute floor and a margin over its train-box prior (the strongest image-blind baseline).
LADDER_BARS = {"variants": ["D", "E"], "pointing_z": 0.80, "pointing_attn": 0.70, "over_train_prior": 0.15}


def ladder_bars(rows: list[dict], spec: dict | None = None) -> list[dict]:
    """Each bar measured: ``met`` True/False, None where a figure is missing."""
    spec = {**LADDER_BARS, **(spec or {})}
    out = []
    for row in rows:
        if row["run"] not in spec["variants"]:
            continue
        for metric in ("pointing_z", "pointing_attn"):
            value, prior = row.get(metric), row.get(f"train_prior_{metric}")
            floor = spec[metric]
            limit = None if prior is None else max(floor, prior + spec["over_train_prior"])
            out.append({"bar": f"{row['run']} {metric} >= {floor} and >= train prior + {spec['over_train_prior']}",
                        "value": value, "ci": row.get(f"{metric}_ci"), "train_prior": prior, "limit": limit,
                        "met": None if value is None or limit is None else value >= limit})
    return out


def _k_ratio_sweep(recipe: dict, shards: Path, out_dir: Path, sweep: dict, seed: int, per_run: dict) -> list[dict]:
    """``sweep['model']`` (cpu-E) at each k_ratio (keep_rate tied to it unless told), one seed; records the
    runs in ``per_run``."""
    rows = []
    for k in (sweep.get("values", [1.0, 0.75, 0.5, 0.25]) if sweep else []):
        model = sweep.get("model", "cpu-E")
        mo = {"k_ratio": float(k)}
        if sweep.get("tie_keep_rate", True):
            mo["keep_rate"] = float(k)
        seed_rows, runs, _ = _train_and_evaluate_seeds(recipe, shards, out_dir / "runs" / f"k_ratio-{k}", model,
                                                       mo, [seed], f"k={k}")
        row = _over_seeds(f"k={k}", seed_rows)
        row["k_ratio"] = float(k)
        rows.append(row)
        per_run[f"k_ratio-{k}"] = {"model": model, "overrides": mo, "seeds": runs}
    return rows


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _over_seeds(label: str, seed_rows: list[dict]) -> dict:
    """Quality as mean ± sd over seeds; cost columns from the seed that measured them."""
    row = seed_summary(label, seed_rows, ABLATION_QUALITY)
    for col in ABLATION_QUALITY:
        row[f"{col}_ci"] = t_interval(row.get(f"{col}_seeds") or [])[1]
    for col in COST_COLUMNS:
        row[col] = next((r[col] for r in seed_rows if r.get(col) is not None), None)
    for metric, chance in (("mean_recall", "chance_mean_recall"), ("pointing_z", "chance_pointing_z"),
                           ("pointing_attn", "chance_pointing_attn")):
        if row.get(metric) is not None and row.get(chance):
            row[f"{metric}_x_chance"] = row[metric] / row[chance]
    return row


def _ablation_markdown(recipe, shards, seeds, rows, relative, sweep, sweep_rows, out_dir: Path,
                       report: tuple[Path, str]) -> list[str]:
    md = [f"# Ablation `{recipe['name']}`", "",
          f"shards `{shards}`; every variant trained with the same recipe and samples, seeds {seeds} "
          f"(**mean ± 95 % CI**, t-interval over seeds); the report set (`{report[0]}`, split {report[1]}: no "
          f"setting was chosen on it). *chance*: a random ranking (mean R) "
          f"or a random heatmap on the same grid and boxes (pointing game); *prior*: the leave-one-out mean of the "
          f"model's own maps; *train prior*: one fixed map of the train split's box frequency (class-agnostic for "
          f"z, per label for attention), the strongest image-blind baseline.", "",
          "## Quality", "", markdown_table_sd(rows, ABLATION_QUALITY[:-2], spread="ci"), "",
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
    plt = pyplot()
    ks = [r["k_ratio"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    cuda = torch.cuda.is_available()
    memory = ("peak_memory_mb", "peak CUDA memory MB") if cuda else \
        ("step_memory_delta_mb", "train-step memory MB (RSS above start)")
    for ax, (key, label) in zip(axes, (("i2t_R@1", "i2t R@1 (test)"), ("step_ms", "train step ms"), memory)):
        ax.plot(ks, [_nan(r.get(key)) for r in rows], "-o", label=key.replace("_", " "))
        if key == "i2t_R@1":
            ax.plot(ks, [_nan(r.get("t2i_R@1")) for r in rows], "-s", label="t2i R@1")
            ax.legend(fontsize=7)
        ax.set_xlabel("k_ratio")
        ax.set_ylabel(label)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def _nan(v):
    return float("nan") if v is None else v
