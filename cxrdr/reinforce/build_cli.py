"""`reinforce build` command line: flags -> BuildOptions -> build -> summary."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.augment import AugConfig
from cxrdr.common.errors import UserError
from cxrdr.reinforce.build import build
from cxrdr.reinforce.options import DEFAULT_OUT, BuildOptions
from cxrdr.reinforce.summary import summary_text


def _pair(text: str, flag: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise UserError(f"{flag} expects MIN,MAX (e.g. 0.6,1.0), got {text!r}") from None
    if not 0 < lo <= hi:
        raise UserError(f"{flag} expects 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def cli_build(
    source: Annotated[str, typer.Option(help="Source spec: phantom[:N], mimic:PATH.jsonl, iu-xray:DIR, "
                                             "nih-bbox:PATH.jsonl, "
                                             "jsonl:PATH, csv:PATH.")] = "phantom",
    teachers: Annotated[str, typer.Option(help="Comma-separated teacher specs, e.g. "
                                               "biomedclip,text:minilm (random:tiny is for tests).")] = "biomedclip",
    out: Annotated[Path, typer.Option(help="Output shard folder.")] = DEFAULT_OUT,
    n_aug: Annotated[int, typer.Option(help="K augmentation parameter sets per image.")] = 10,
    n_captions: Annotated[int, typer.Option(help="S synthetic captions per sample.")] = 5,
    store_size: Annotated[int, typer.Option(help="Short side of the stored image in pixels.")] = 256,
    image_format: Annotated[str, typer.Option(help="Stored image format: jpg or png.")] = "jpg",
    jpeg_quality: Annotated[int, typer.Option(help="JPEG quality of stored images.")] = 95,
    emb_dtype: Annotated[str, typer.Option(help="Embedding storage: float16, int8 (per-row scale) "
                                                "or float32.")] = "float16",
    shard_size: Annotated[int, typer.Option(help="Samples (records) per shard.")] = 1000,
    compression: Annotated[str, typer.Option(help="Shard files: gzip (.tar.gz, compact) or none (.tar).")] = "gzip",
    seed: Annotated[int, typer.Option(help="Seed of augmentation and caption sampling.")] = 0,
    workers: Annotated[int, typer.Option(help="DataLoader workers decoding and augmenting.")] = 2,
    batch_size: Annotated[int, typer.Option(help="Records per teacher batch (K*B crops per image "
                                                 "forward).")] = 32,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N] for the teachers.")] = "auto",
    model_cache: Annotated[Optional[str], typer.Option(help="Folder with local teacher weights.")] = None,
    resume: Annotated[bool, typer.Option(help="Skip shards already complete in --out.")] = False,
    rank: Annotated[Optional[int], typer.Option(help="This process's rank (default: $RANK or 0).")] = None,
    world_size: Annotated[Optional[int], typer.Option(help="Number of ranks (default: $WORLD_SIZE or 1); "
                                                           "shard i is built by rank i % world.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Use only the first N records of the source.")] = None,
    merge_timeout: Annotated[float, typer.Option(help="Seconds rank 0 waits for other ranks to merge.")] = 3600.0,
    crop_scale: Annotated[Optional[str], typer.Option(help="RandomResizedCrop area fraction MIN,MAX "
                                                           "[default: 0.6,1.0].")] = None,
    crop_ratio: Annotated[Optional[str], typer.Option(help="RandomResizedCrop aspect ratio w/h MIN,MAX "
                                                           "[default: 3/4,4/3].")] = None,
    max_angle: Annotated[Optional[float], typer.Option(help="Max rotation in degrees [default: 7].")] = None,
    randaugment: Annotated[Optional[int], typer.Option(help="RandAugment-style photometric ops per set "
                                                            "[default: 0 = off].")] = None,
    randaugment_magnitude: Annotated[Optional[float], typer.Option(help="RandAugment magnitude 0..10 "
                                                                        "[default: 5].")] = None,
    image_root: Annotated[Optional[str], typer.Option(help="Source: folder image paths are relative to.")] = None,
    col_id: Annotated[Optional[str], typer.Option(help="Source column: record id.")] = None,
    col_image: Annotated[Optional[str], typer.Option(help="Source column: image path.")] = None,
    col_report: Annotated[Optional[str], typer.Option(help="Source column: report text.")] = None,
    col_findings: Annotated[Optional[str], typer.Option(help="Source column: findings.")] = None,
    col_impression: Annotated[Optional[str], typer.Option(help="Source column: impression.")] = None,
    col_labels: Annotated[Optional[str], typer.Option(help="Source column: labels.")] = None,
    col_split: Annotated[Optional[str], typer.Option(help="Source column: split.")] = None,
    col_subject: Annotated[Optional[str], typer.Option(help="Source column: subject id.")] = None,
    col_study: Annotated[Optional[str], typer.Option(help="Source column: study id.")] = None,
    col_view: Annotated[Optional[str], typer.Option(help="Source column: view position.")] = None,
    labels_format: Annotated[Optional[str], typer.Option(help="Source: how the labels column is "
                                                              "encoded.")] = None,
    scene_graphs: Annotated[Optional[str], typer.Option(help="Source (mimic): Chest ImaGenome scene "
                                                             "graphs.")] = None,
    frontal_only: Annotated[Optional[bool], typer.Option("--frontal-only/--all-views",
                                                         help="Source: keep frontal views only.")] = None,
    min_report_chars: Annotated[Optional[int], typer.Option(help="Source: shortest usable report.")] = None,
    phantom_size: Annotated[Optional[int], typer.Option(help="Source (phantom): rendered image size.")] = None,
    source_seed: Annotated[Optional[int], typer.Option(help="Source (phantom): generator seed.")] = None,
    engine: Annotated[str, typer.Option(help="local: this process (or torchrun ranks); ray: shards on a Ray "
                                             "actor pool ($RAY_ADDRESS, else a local Ray).")] = "local",
    ray_actors: Annotated[Optional[int], typer.Option(help="--engine ray: actors, each with its own teachers "
                                                           "(default: one per GPU, else CPUs / workers).")] = None,
    ray_retries: Annotated[int, typer.Option(help="--engine ray: retries of a shard whose actor died or "
                                                  "that raised.")] = 3,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Build reinforced WebDataset shards: stored images, captions, aug params, teacher embeddings."""
    aug = _aug_config(crop_scale, crop_ratio, max_angle, randaugment, randaugment_magnitude)
    source_options = dict(image_root=image_root, col_id=col_id, col_image=col_image, col_report=col_report,
                          col_findings=col_findings, col_impression=col_impression, col_labels=col_labels,
                          col_split=col_split, col_subject=col_subject, col_study=col_study,
                          col_view=col_view, labels_format=labels_format, scene_graphs=scene_graphs,
                          frontal_only=frontal_only, min_report_chars=min_report_chars,
                          size=phantom_size, seed=source_seed)
    opts = BuildOptions(source=source, teachers=teachers, out=out, n_aug=n_aug, n_captions=n_captions,
                        store_size=store_size, image_format=image_format.lower().replace("jpeg", "jpg"),
                        jpeg_quality=jpeg_quality, emb_dtype=emb_dtype, shard_size=shard_size, compression=compression,
                        seed=seed, workers=workers, batch_size=batch_size, device=device, model_cache=model_cache,
                        resume=resume, rank=rank, world_size=world_size, limit=limit, aug=aug,
                        source_options=source_options, merge_timeout=merge_timeout, progress=not quiet,
                        engine=engine, ray_actors=ray_actors, ray_retries=ray_retries)
    _print_result(build(opts), out)


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
