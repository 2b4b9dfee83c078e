"""`train` command line: `run` (its flags derived from TrainConfig), `eval`, `export`, `curves`."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.errors import OutOfDeviceMemory, UserError, run_app
from cxrdr.train.config import TrainConfig, cli_fields

app = typer.Typer(
    help="Stage 2 of cxrdr: train the Patch-IB student from reinforced shards, evaluate it, "
         "and run the efficiency/ablation experiments.",
    no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

FINAL_EVAL_KEYS = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "probe_mean_auc", "score")


def _param_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _run_parameters() -> list[inspect.Parameter]:
    """--config, then one option per `cli_fields()` entry (switches for bools)."""
    config = inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[Path], typer.Option("--config", help="Training YAML (TrainConfig fields; flags override it).")])
    params = [config]
    for _, flags, tp, help_text in cli_fields():
        if tp is bool:
            annotation, default = Annotated[bool, typer.Option(*flags, help=help_text)], False
        else:
            annotation, default = Annotated[Optional[tp], typer.Option(*flags, help=help_text)], None
        params.append(inspect.Parameter(_param_name(flags[0]), inspect.Parameter.KEYWORD_ONLY,
                                        default=default, annotation=annotation))
    return params


def _overrides(values: dict) -> dict:
    """TrainConfig.load overrides from the parsed flags: unset options and switches left off are None;
    a --no-X switch sets X false."""
    out = {}
    for path, flags, tp, _ in cli_fields():
        value = values[_param_name(flags[0])]
        if tp is bool:
            value = (not flags[0].startswith("--no-")) if value else None
        out[path] = value
    return out


def _in_validation(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside a validation pass (the Trainer's ``evaluate`` or the
    evaluation package), not a training step: another batch size and other advice."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "evaluate" or "/evaluation/" in code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


def train_oom_line(cfg: TrainConfig, exc: BaseException) -> str:
    """One line for a batch of `train run` that did not fit: its batch size, the device memory and
    peak, what is saved and the flags that help (`cxrdr.common.oom`)."""
    from cxrdr.common.oom import out_of_memory_line

    last = Path(cfg.out) / "last.pt"
    saved = (f"{last} from the last save is intact" if last.is_file()
             else f"no checkpoint of {cfg.out} was saved yet")
    if _in_validation(exc):
        what = f"a validation pass of {cfg.out} at --eval-batch-size {cfg.eval_batch_size}"
        advice = f"{saved}: continue with --resume and a smaller --eval-batch-size (changeable on resume)"
    else:
        what = (f"a training step of {cfg.out} at --batch-size {cfg.batch_size} x --accum-steps "
                f"{cfg.accum_steps} (micro-batches per step)")
        fresh = ("start afresh (--overwrite) with a smaller --batch-size and a larger --accum-steps (the same "
                 "samples per step)")
        if cfg.grad_checkpointing:
            advice = f"{saved}: continue with --resume on a device with more memory, or {fresh}"
        else:
            advice = (f"{saved}: continue with --resume --grad-checkpointing (less memory, the same steps; "
                      f"changeable on resume), or {fresh}")
    return out_of_memory_line(what, exc, cfg.device, advice)


def cli_run(**values) -> None:
    """Train the Patch-IB student on reinforced shards (distillation from stored teacher embeddings).

    Writes RUN/config.yaml, RUN/metrics.jsonl (loss terms, their gradient norms on the shared trunk,
    lr, logit scale, step time, samples/s; validation retrieval R@K and probe AUC), RUN/last.pt (full
    resume state), RUN/best.pt (best early-stopping score w*mean Recall + (1-w)*mean AUC) and
    RUN/summary.json. Multi-GPU: `torchrun --nproc_per_node N -m cxrdr.train.cli run ...`.
    """
    from cxrdr.train import distributed as dist_utils  # lazy: torch only once a command runs
    from cxrdr.train.loop import train
    from cxrdr.train.runfolder import json_default

    try:
        cfg = TrainConfig.load(values.pop("config"), **_overrides(values))
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if not Path(cfg.shards).is_dir():
        raise UserError(f"--shards {cfg.shards}: no such folder")
    try:
        summary = train(cfg)
    except Exception as exc:
        from cxrdr.common.oom import is_out_of_memory

        if not is_out_of_memory(exc):
            raise
        raise OutOfDeviceMemory(train_oom_line(cfg, exc)) from exc
    if dist_utils.is_main():
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "final_eval"}, indent=1,
                              default=json_default))
        final = summary.get("final_eval") or {}
        if final:
            typer.echo("validation: " + ", ".join(f"{k}={final[k]:.3f}" for k in FINAL_EVAL_KEYS
                                                  if isinstance(final.get(k), (int, float))))
        typer.echo(f"its curves: train curves {cfg.out}")
    dist_utils.cleanup()


_params = _run_parameters()
cli_run.__signature__ = inspect.Signature(_params)
cli_run.__annotations__ = {p.name: p.annotation for p in _params}


def cli_export(
    checkpoint: Annotated[Path, typer.Argument(help="Student checkpoint written by `train run` (RUN/best.pt).")],
    out: Annotated[Path, typer.Option(help="Output folder (an open_clip local-dir model).")],
    format: Annotated[str, typer.Option("--format", help="Export format: open_clip.")] = "open_clip",
    check: Annotated[bool, typer.Option(help="Load the export with open_clip and compare embeddings.")] = True,
) -> None:
    """Export a student's global CLIP part (towers, projections, logit scale) as an open_clip model."""
    # imported here: open_clip costs every `train` process ~1.5 s, and only an export needs it
    from cxrdr.train.export import FORMATS, export_open_clip

    if format not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)} (got {format!r})")
    if not checkpoint.is_file():
        raise UserError(f"checkpoint not found: {checkpoint}")
    try:
        summary = export_open_clip(checkpoint, out, check=check)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    typer.echo(f"wrote open_clip model to {out} ({summary['variant']}, {summary['image_tower']} + "
               f"{summary['text_tower']}, D={summary['embed_dim']})"
               + (f"; check: max embedding difference {summary['max_embedding_difference']:.1e}" if check else "")
               + f"\nload it with open_clip.create_model_and_transforms('local-dir:{out.resolve()}') "
                 f"or as a teacher: --teachers openclip:local-dir:{out.resolve()}")


def cli_curves(
    runs: Annotated[list[Path], typer.Argument(help="Run folders written by `train run` (each holds metrics.jsonl).")],
    out: Annotated[Optional[Path], typer.Option(help="PNG to write (default: RUN/curves.png for one run; "
                                                     "required for several).")] = None,
    label: Annotated[Optional[list[str]], typer.Option(help="A legend name per run, in order (default: the "
                                                             "shortest trailing paths that tell them apart).")] = None,
    x: Annotated[str, typer.Option(help="Across: samples (samples seen) or step.")] = "samples",
    smooth: Annotated[float, typer.Option(help="Moving average of the training curves, 0 to <1 (TensorBoard's; "
                                               "each record is one step's values). 0: as logged.")] = 0.0,
) -> None:
    """Plot runs' training curves side by side: loss terms, val mean recall, lr, logit scale, gradient norms."""
    from cxrdr.train.curves import load_run, plot_curves, run_labels

    if out is None and len(runs) > 1:
        raise UserError(f"{len(runs)} runs: give --out FILE.png for their figure")
    if label and len(label) != len(runs):
        raise UserError(f"--label given {len(label)} time(s) for {len(runs)} run(s): one a run, in order")
    curves = [load_run(run, name, x) for run, name in zip(runs, label or run_labels(runs))]
    out = out or runs[0] / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = plot_curves(curves, out, x, smooth=smooth)
    typer.echo(f"wrote {out}: {len(panels)} panels, {len(curves)} run(s)")


def _register() -> None:
    # lazy: `train --help` should not import torch through every command's module
    from cxrdr.train.evaluation import cli as eval_cli

    app.command("run")(cli_run)
    app.command("eval")(eval_cli.cli_eval)
    app.command("export")(cli_export)
    app.command("curves")(cli_curves)


_register()


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
