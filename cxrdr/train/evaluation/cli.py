"""`train eval`: run the evaluation suite on a checkpoint (or any teacher spec) and write the tables."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def default_out_dir(ckpt: str | None, model: str | None, split: str) -> Path:
    """<ckpt dir>/eval-<split>; for a non-checkpoint model spec, ./eval-<sanitised spec>-<split>."""
    if ckpt:
        return Path(ckpt).resolve().parent / f"eval-{split}"
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in str(model)).strip("-")
    return Path(f"eval-{safe}-{split}")


def recorded_shards(ckpt: Path) -> tuple[Path, str | None]:
    """The shard folder the run that wrote ``ckpt`` trained on, and its content identity then: the
    resolved path the checkpoint records under ``data`` (``train run`` since the identity check),
    else its ``train_config`` ``shards`` as typed (relative to where that run started)."""
    from cxrdr.common.errors import UserError
    from cxrdr.train.checkpoint import read_checkpoint

    data = read_checkpoint(ckpt)
    source = data.get("data") if isinstance(data.get("data"), dict) else {}
    shards = source.get("shards") or (data.get("train_config") or {}).get("shards")
    if not shards:
        raise UserError(f"--ckpt {ckpt} records no shard folder (not written by `train run`?); pass --shards DIR")
    return Path(shards), source.get("identity")


def default_shards(ckpt: Path) -> Path:
    """--shards left out with --ckpt: the run's own shard folder, said on stderr; one line naming the
    recorded path and --shards when the folder is gone or moved."""
    from cxrdr.common.errors import UserError
    from cxrdr.common.shards import DATASET_JSON, dataset_identity, read_dataset_info

    shards, identity = recorded_shards(ckpt)
    if not (shards / DATASET_JSON).is_file():
        raise UserError(f"--ckpt {ckpt} was trained on shards {shards}, which holds no {DATASET_JSON} now (moved "
                        f"or deleted?); pass --shards DIR to name the shard folder")
    now = dataset_identity(read_dataset_info(shards))
    changed = (f"; it holds other data than when the run trained (content {identity} -> {now})"
               if identity and identity != now else "")
    typer.echo(f"note: no --shards: using {shards}, the shard folder {ckpt} was trained on{changed}", err=True)
    return shards


def cli_eval(
    ckpt: Annotated[Optional[Path], typer.Option(help="Checkpoint written by `train run` (e.g. RUN/best.pt).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Instead of --ckpt: any model spec, ckpt:PATH, "
                                                      "openclip:ARCH[:PRETRAINED], biomedclip (global "
                                                      "metrics only for non-student models).")] = None,
    shards: Annotated[Optional[Path], typer.Option(help="Shard folder written by `reinforce build` (default: with "
                                                        "--ckpt the folder its run trained on, else ./shards).")] = None,
    split: Annotated[str, typer.Option(help="Split to evaluate: test, val or train.")] = "test",
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default: <ckpt dir>/eval-<split>).")] = None,
    train_split: Annotated[str, typer.Option(help="Split the linear probe is fitted on.")] = "train",
    text_section: Annotated[str, typer.Option(help="Retrieval text: both (findings + impression, falling "
                                                   "back to the report), report, findings or impression.")] = "both",
    prompts: Annotated[Optional[Path], typer.Option(help="Zero-shot prompt YAML (default "
                                                         "configs/prompts.yaml).")] = None,
    batch_size: Annotated[int, typer.Option(help="Embedding batch size.")] = 64,
    max_samples: Annotated[Optional[int], typer.Option(help="Use only the first N samples of the split.")] = None,
    probe_max_train: Annotated[int, typer.Option(help="At most N train images for the linear probe "
                                                      "(even stride over the split).")] = 10000,
    min_positives: Annotated[int, typer.Option(help="Skip labels with fewer positives (probe, zero-shot).")] = 5,
    n_localisation: Annotated[int, typer.Option(help="Images with boxes used for localisation.")] = 64,
    n_faithfulness: Annotated[int, typer.Option(help="Images used for deletion/insertion and "
                                                     "cross-view consistency.")] = 16,
    faith_steps: Annotated[int, typer.Option(help="Points on the deletion/insertion curves.")] = 10,
    efficiency: Annotated[bool, typer.Option("--efficiency/--no-efficiency",
                                             help="Measure throughput, latency, memory and GFLOPs.")] = True,
    n_plots: Annotated[int, typer.Option(help="Rows in the heatmap figure.")] = 6,
    seed: Annotated[int, typer.Option(help="Seed of the 5x200 subset and random baselines.")] = 0,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    benchmark: Annotated[Optional[str], typer.Option(help="Instead of --shards: the NIH ChestX-ray14 box "
                                                          "benchmark, nih-bbox:PATH/nih_bbox.jsonl (zero-shot AUC "
                                                          "and localisation of the 8 box findings; writes "
                                                          "benchmark.json/.md, heatmaps.png).")] = None,
) -> None:
    """Evaluate a checkpoint: retrieval, linear probe, zero-shot, localisation, faithfulness, geometry, cost."""
    from cxrdr.common.errors import UserError

    if (ckpt is None) == (model is None):
        raise UserError("give exactly one of --ckpt PATH or --model SPEC")
    if ckpt is not None and not ckpt.is_file():
        raise UserError(f"--ckpt {ckpt}: checkpoint not found")
    if benchmark is not None:
        _run_benchmark(ckpt, model, benchmark, split, out, batch_size, n_plots, device, quiet)
        return
    if shards is None:
        shards = default_shards(ckpt) if ckpt is not None else Path("shards")
    if not shards.is_dir():
        raise UserError(f"--shards {shards}: not a folder")
    if text_section not in ("both", "report", "findings", "impression"):
        raise UserError(f"--text-section must be both, report, findings or impression, got {text_section!r}")
    import torch

    from cxrdr.train.evaluation.runner import evaluate

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = out or default_out_dir(str(ckpt) if ckpt else None, model, split)
    evaluate(str(ckpt) if ckpt else model, shards, split, out_dir, train_split=train_split,
             text_section=text_section, batch_size=batch_size, max_samples=max_samples,
             probe_max_train=probe_max_train, prompts=prompts, min_positives=min_positives,
             n_localisation=n_localisation, n_faithfulness=n_faithfulness, faith_steps=faith_steps,
             efficiency=efficiency, n_plots=n_plots, seed=seed, device=device, progress=not quiet)


def _run_benchmark(ckpt, model, benchmark: str, split: str, out, batch_size: int, n_plots: int, device, quiet: bool):
    import torch

    from cxrdr.common.errors import UserError
    from cxrdr.train.evaluation.benchmark import parse_benchmark, run_benchmark
    from cxrdr.train.evaluation.report import fmt

    try:
        parse_benchmark(benchmark)
    except ValueError as exc:
        raise UserError(f"--benchmark: {exc}") from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = out or default_out_dir(str(ckpt) if ckpt else None, model, f"nih-{split}")
    results = run_benchmark(str(ckpt) if ckpt else model, benchmark, split, out_dir, batch_size=batch_size,
                            n_plots=n_plots, device=device, progress=not quiet)
    s = results["summary"]
    typer.echo(f"{benchmark} {split}: {s['n_images']} images, {s['n_boxes']} boxes; zero-shot AUC "
               f"{fmt(s['zero_shot_auc_mean'])}; PG z {fmt(s['pg_z'])} (chance {fmt(s['pg_z_chance'])}, prior "
               f"{fmt(s['pg_z_prior'])}, train prior {fmt(s['pg_z_train_prior'])}); PG attention "
               f"{fmt(s['pg_attention'])} (chance {fmt(s['pg_attention_chance'])}, prior "
               f"{fmt(s['pg_attention_prior'])}, train prior {fmt(s['pg_attention_train_prior'])}) -> {out_dir}")
