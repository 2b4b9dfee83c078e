"""What a build is asked to do: its options, their validation, and the source, teachers, rank and
device they resolve to."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from cxrdr.common.errors import UserError
from cxrdr.common.shards import EMB_DTYPES, SHARD_SUFFIXES, TEACHER_NAME_RE
from cxrdr.reinforce.sources import open_source
from cxrdr.teachers import load_teachers

DEFAULT_OUT = Path("shards")


@dataclass
class BuildOptions:
    source: str = "phantom"
    teachers: str = "random:tiny"
    out: Path = DEFAULT_OUT
    n_aug: int = 10
    n_captions: int = 5
    store_size: int = 256
    image_format: str = "jpg"
    jpeg_quality: int = 95
    emb_dtype: str = "float16"
    shard_size: int = 1000
    compression: str = "gzip"  # gzip: shard-NNNNNN.tar.gz; none: shard-NNNNNN.tar
    seed: int = 0
    workers: int = 2
    batch_size: int = 32
    device: str = "auto"
    model_cache: Optional[str] = None
    resume: bool = False
    rank: Optional[int] = None
    world_size: Optional[int] = None
    limit: Optional[int] = None
    aug: object = None  # AugConfig; None -> defaults
    source_options: dict = field(default_factory=dict)
    merge_timeout: float = 3600.0
    progress: bool = True
    engine: str = "local"  # local (this process, or torchrun ranks) or ray (reinforce.ray_engine)
    ray_actors: Optional[int] = None  # default: one per GPU of the cluster, else CPUs / max(1, workers)
    ray_retries: int = 3


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """--rank/--world-size, else torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    if world_size < 1 or not 0 <= rank < world_size:
        raise UserError(f"invalid rank {rank} for world size {world_size} (need 0 <= rank < world size)")
    return rank, world_size


def resolve_device(device: str) -> str:
    if device == "auto":
        if torch.cuda.is_available():
            return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    return device


def open_source_of(opts: BuildOptions):
    options = {k: v for k, v in opts.source_options.items() if v is not None}
    try:
        return open_source(opts.source, **options)
    except UserError as exc:
        raise UserError(f"--source {opts.source}: {exc}") from exc
    except (ValueError, FileNotFoundError, KeyError, OSError, TypeError) as exc:
        raise UserError(f"--source {opts.source}: {exc}") from exc


def load_build_teachers(opts: BuildOptions, device: str):
    if not opts.teachers or not opts.teachers.strip(","):
        raise UserError("--teachers is empty; give at least one teacher spec (e.g. random:tiny)")
    try:
        teachers = load_teachers(opts.teachers, device=device, model_cache=opts.model_cache)
    except UserError as exc:
        raise UserError(f"--teachers {opts.teachers}: {exc}") from exc
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        raise UserError(f"--teachers {opts.teachers}: {exc}") from exc
    names = [t.name for t in teachers]
    if len(set(names)) != len(names):
        raise UserError(f"--teachers {opts.teachers}: two teachers share a name ({names})")
    for name in names:
        if not TEACHER_NAME_RE.match(name):
            raise UserError(f"teacher name {name!r} is not file-safe (lowercase letters, digits, '-', '_')")
    return teachers


def validate_options(opts: BuildOptions) -> None:
    checks = [
        (opts.n_aug >= 1, f"--n-aug must be >= 1 (got {opts.n_aug})"),
        (opts.n_captions >= 1, f"--n-captions must be >= 1 (got {opts.n_captions})"),
        (opts.store_size >= 16, f"--store-size must be >= 16 (got {opts.store_size})"),
        (opts.image_format in ("jpg", "png"), f"--image-format must be jpg or png (got {opts.image_format!r})"),
        (1 <= opts.jpeg_quality <= 100, f"--jpeg-quality must be in 1..100 (got {opts.jpeg_quality})"),
        (opts.emb_dtype in EMB_DTYPES, f"--emb-dtype must be one of {', '.join(EMB_DTYPES)} "
                                       f"(got {opts.emb_dtype!r})"),
        (opts.shard_size >= 1, f"--shard-size must be >= 1 (got {opts.shard_size})"),
        (opts.compression in SHARD_SUFFIXES, f"--compression must be one of {', '.join(sorted(SHARD_SUFFIXES))} "
                                             f"(got {opts.compression!r})"),
        (opts.workers >= 0, f"--workers must be >= 0 (got {opts.workers})"),
        (opts.batch_size >= 1, f"--batch-size must be >= 1 (got {opts.batch_size})"),
        (opts.limit is None or opts.limit >= 1, f"--limit must be >= 1 (got {opts.limit})"),
        (opts.device == "auto" or opts.device == "cpu" or opts.device.startswith("cuda"),
         f"--device must be auto, cpu or cuda[:N] (got {opts.device!r})"),
        (opts.engine in ("local", "ray"), f"--engine must be local or ray (got {opts.engine!r})"),
        (opts.ray_actors is None or opts.ray_actors >= 1, f"--ray-actors must be >= 1 (got {opts.ray_actors})"),
        (opts.ray_retries >= 0, f"--ray-retries must be >= 0 (got {opts.ray_retries})"),
        (opts.engine != "ray" or (opts.world_size or 1) == 1,
         "--engine ray schedules the shards itself: drop --rank/--world-size (they are for torchrun)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
