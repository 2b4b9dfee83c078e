"""`reinforce build` command line: flags -> BuildOptions -> build -> summary. The flags are derived
from BuildOptions (``cxrdr.reinforce.options.cli_flags``: each field's name, type, default and help)."""
from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.augment import AugConfig
from cxrdr.common.errors import UserError
from cxrdr.reinforce.build import build
from cxrdr.reinforce.options import BuildOptions, cli_flags
from cxrdr.reinforce.summary import summary_text


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} expects MIN,MAX (e.g. 0.6,1.0), got {text!r}") from None
    if not 0 < lo <= hi:
        raise UserError(f"{flag} expects 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def _parameters() -> list[inspect.Parameter]:
    """One typer option per `cli_flags()` entry (bools: --x/--no-x switches unless spelled otherwise)."""
    params = []
    for flag in cli_flags():
        tp = flag.type
        if flag.default is None and typing.get_origin(tp) is not typing.Union:
            tp = Optional[tp]
        annotation = Annotated[tp, typer.Option(*flag.flags, help=flag.help)]
        params.append(inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=flag.default,
                                        annotation=annotation))
    return params


def build_options(values: dict) -> BuildOptions:
    """Parsed flags -> BuildOptions (aug and source flags gathered; only aug flags given override)."""
    options, aug, source = {}, {}, {}
    for flag in cli_flags():
        value = values[flag.name]
        kind, key = flag.target
        if kind == "field":
            options[key] = (not value) if flag.invert else value
        elif kind == "aug":
            aug[flag.name] = value
        else:
            source[key] = value
    options["image_format"] = str(options["image_format"]).lower().replace("jpeg", "jpg")
    return BuildOptions(**options, aug=_aug_config(**aug), source_options=source)


def cli_build(**values) -> None:
    """Build reinforced WebDataset shards: stored images, captions, aug params, teacher embeddings."""
    opts = build_options(values)
    _print_result(build(opts), opts.out)


_params = _parameters()
cli_build.__signature__ = inspect.Signature(_params)
cli_build.__annotations__ = {p.name: p.annotation for p in _params}


def _aug_config(crop_scale, crop_ratio, max_angle, randaugment, randaugment_magnitude) -> AugConfig:
    """Only flags given override AugConfig's defaults (so a CLI build equals a default-config build)."""
    given = {"scale": _pair(crop_scale, "--crop-scale") if crop_scale else None,
             "ratio": _pair(crop_ratio, "--crop-ratio") if crop_ratio else None,
             "max_angle": max_angle, "randaugment_n": randaugment,
             "randaugment_magnitude": randaugment_magnitude}
    aug = AugConfig(**{k: v for k, v in given.items() if v is not None})
    if aug.max_angle < 0 or aug.randaugment_n < 0 or not 0 <= aug.randaugment_magnitude <= 10:
        raise UserError("--max-angle and --randaugment must be >= 0 and --randaugment-magnitude in 0..10")
    return aug


def _print_result(result: dict, out: Path) -> None:
    if "total_samples" in result:
        typer.echo(summary_text(result))
        typer.echo(f"wrote {out}")
    else:
        typer.echo(f"rank {result['rank']}: built {result['samples_built']} samples in "
                   f"{result['shards_built']} shards; rank 0 merges")
