"""What a build is asked to do: its options, their validation, and the source, teachers, rank and
device they resolve to."""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

from cxrdr.common.errors import UserError
from cxrdr.common.host_threads import gpu_host_workers
from cxrdr.common.shards import EMB_DTYPES, SHARD_SUFFIXES, TEACHER_NAME_RE
from cxrdr.reinforce.captioners import parse_captioner_spec
from cxrdr.reinforce.sources import open_source
from cxrdr.teachers import load_teachers

DEFAULT_OUT = Path("shards")


def _opt(default=None, help: str = "", factory=None, **cli) -> object:
    """A BuildOptions field with its `reinforce build` flag: ``help``, and in ``cli`` the flag's own
    ``flags`` (spellings), ``name`` (parameter name) and ``cli_default`` where they differ from the field's."""
    metadata = {"help": help, **cli}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class BuildOptions:
    """What a build is asked to do. Each field's metadata is its `reinforce build` flag (help, and
    spelling or CLI default where they differ): the one source of the flags (``cli_flags``)."""
    source: str = _opt("phantom", "Source spec: phantom[:N], mimic:PATH.jsonl, iu-xray:DIR, nih-bbox:PATH.jsonl, "
                                   "jsonl:PATH, csv:PATH.")
    # the library's default teacher is the test one; the command line's is BiomedCLIP
    teachers: str = _opt("random:tiny", "Comma-separated teacher specs, e.g. biomedclip,text:minilm "
                                        "(random:tiny is for tests).", cli_default="biomedclip")
    out: Path = _opt(DEFAULT_OUT, "Output shard folder.")
    n_aug: int = _opt(10, "K augmentation parameter sets per image.")
    n_captions: int = _opt(5, "S synthetic captions per sample (with --captioner: per stored view).")
    # None: captions from each record's own text (report sentences, RDF/label templates), byte-identical
    # to builds before the option; retrieval:BANK: cxrdr.reinforce.captioners
    captioner: Optional[str] = _opt(None, "Synthetic captions from the image-text teacher instead of the record's "
                                          "own text: retrieval:train (the source's train reports) or "
                                          "retrieval:PATH.jsonl|.txt (a report file); top-S sentences per view. "
                                          "Keeps image-only records (no report).")
    store_size: int = _opt(256, "Short side of the stored image in pixels.")
    image_format: str = _opt("jpg", "Stored image format: jpg or png.")
    jpeg_quality: int = _opt(95, "JPEG quality of stored images.")
    emb_dtype: str = _opt("float16", "Embedding storage: float16, int8 (per-row scale) or float32.")
    shard_size: int = _opt(1000, "Samples (records) per shard.")
    # gzip: shard-NNNNNN.tar.gz; none: shard-NNNNNN.tar
    compression: str = _opt("gzip", "Shard files: gzip (.tar.gz, compact) or none (.tar).")
    seed: int = _opt(0, "Seed of augmentation and caption sampling.")
    workers: Optional[int] = _opt(None, "DataLoader workers decoding and augmenting (default: 2; with CUDA teachers "
                                        "every core but two, at most 16: a GPU teacher waits on preparation). With "
                                        "a CPU teacher the build times its first two batches and may prepare in "
                                        "its own process instead (it prints why).")
    batch_size: int = _opt(32, "Records per teacher batch (K*B crops per image forward).")
    device: str = _opt("auto", "auto, cpu or cuda[:N] for the teachers.")
    # where the K views are replayed (resolve_replay); the teachers' inputs agree within 1/255 per pixel either way
    replay: str = _opt("auto", "Where the teachers' K views are replayed: cpu (each image's views in the preparing "
                               "workers), device (the batch's views at once on the teachers' device; the workers "
                               "only decode) or auto (device when the teachers run on CUDA, else cpu).")
    model_cache: Optional[str] = _opt(None, "Folder with local teacher weights.")
    resume: bool = _opt(False, "Skip shards already complete in --out.")
    rank: Optional[int] = _opt(None, "This process's rank (default: $RANK or 0).")
    world_size: Optional[int] = _opt(None, "Number of ranks (default: $WORLD_SIZE or 1); shard i is built "
                                           "by rank i % world.")
    limit: Optional[int] = _opt(None, "Use only the first N records of the source.")
    aug: object = None  # AugConfig; None -> defaults. Flags: AUG_FLAGS
    source_options: dict = field(default_factory=dict)  # flags: SOURCE_FLAGS
    merge_timeout: float = _opt(3600.0, "Seconds rank 0 waits for other ranks to merge.")
    progress: bool = _opt(True, "No progress bar.", name="quiet", invert=True)  # --quiet
    # local (this process, or torchrun ranks) or ray (reinforce.ray_engine)
    engine: str = _opt("local", "local: this process (or torchrun ranks); ray: shards on a Ray actor pool "
                                "($RAY_ADDRESS, else a local Ray).")
    # default: one per GPU of the cluster, else CPUs / max(1, workers)
    ray_actors: Optional[int] = _opt(None, "--engine ray: actors, each with its own teachers "
                                           "(default: one per GPU, else CPUs / workers).")
    ray_retries: int = _opt(3, "--engine ray: retries of a shard whose actor died or that raised.")


# Flags that are not BuildOptions fields: (flag name, type, help) -> the AugConfig field they set
# (only when given: a CLI build equals a default-config build) and the source option they pass.
AUG_FLAGS = {
    "crop_scale": ("scale", str, "RandomResizedCrop area fraction MIN,MAX [default: 0.6,1.0]."),
    "crop_ratio": ("ratio", str, "RandomResizedCrop aspect ratio w/h MIN,MAX [default: 3/4,4/3]."),
    "max_angle": ("max_angle", float, "Max rotation in degrees [default: 7]."),
    "randaugment": ("randaugment_n", int, "RandAugment-style photometric ops per set [default: 0 = off]."),
    "randaugment_magnitude": ("randaugment_magnitude", float, "RandAugment magnitude 0..10 [default: 5]."),
}
SOURCE_FLAGS = {
    "image_root": ("image_root", str, "Source: folder image paths are relative to."),
    "col_id": ("col_id", str, "Source column: record id."),
    "col_image": ("col_image", str, "Source column: image path."),
    "col_report": ("col_report", str, "Source column: report text."),
    "col_findings": ("col_findings", str, "Source column: findings."),
    "col_impression": ("col_impression", str, "Source column: impression."),
    "col_labels": ("col_labels", str, "Source column: labels."),
    "col_split": ("col_split", str, "Source column: split."),
    "col_subject": ("col_subject", str, "Source column: subject id."),
    "col_study": ("col_study", str, "Source column: study id."),
    "col_view": ("col_view", str, "Source column: view position."),
    "labels_format": ("labels_format", str, "Source: how the labels column is encoded."),
    "scene_graphs": ("scene_graphs", str, "Source (mimic): Chest ImaGenome scene graphs."),
    "frontal_only": ("frontal_only", bool, "Source: keep frontal views only."),
    "min_report_chars": ("min_report_chars", int, "Source: shortest usable report."),
    "phantom_size": ("size", int, "Source (phantom): rendered image size."),
    "source_seed": ("seed", int, "Source (phantom): generator seed."),
}
# spellings other than --flag-name
FLAG_SPELLINGS = {"frontal_only": ("--frontal-only/--all-views",)}


@dataclass(frozen=True)
class CliFlag:
    """One `reinforce build` flag: ``name`` (parameter), ``flags`` (spellings), type, default, help, and
    where its value goes: ``("field", name)``, ``("aug", AugConfig field)`` or ``("source", option)``."""
    name: str
    flags: tuple[str, ...]
    type: object
    default: object
    help: str
    target: tuple[str, str]
    invert: bool = False


def cli_flags() -> list[CliFlag]:
    """Every `reinforce build` flag, in the BuildOptions fields' order (the aug and source flags in the
    place of ``aug`` and ``source_options``), from the fields' metadata and defaults."""
    hints = typing.get_type_hints(BuildOptions)
    out: list[CliFlag] = []
    for f in fields(BuildOptions):
        if f.name == "aug":
            for name, (key, tp, help_text) in AUG_FLAGS.items():
                out.append(CliFlag(name, FLAG_SPELLINGS.get(name, ()), tp, None, help_text, ("aug", key)))
            continue
        if f.name == "source_options":
            for name, (key, tp, help_text) in SOURCE_FLAGS.items():
                out.append(CliFlag(name, FLAG_SPELLINGS.get(name, ()), tp, None, help_text, ("source", key)))
            continue
        meta = f.metadata
        tp = hints[f.name]
        default = meta.get("cli_default", f.default)
        if meta.get("invert"):
            default = not default
        out.append(CliFlag(meta.get("name", f.name), tuple(meta.get("flags", ())), tp, default,
                           meta.get("help", ""), ("field", f.name), bool(meta.get("invert"))))
    return out


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


REPLAYS = ("auto", "cpu", "device")


def resolve_workers(workers: int | None, device: str) -> int:
    """--workers, or its default for teachers on ``device``: 2 on the CPU (the teacher needs the cores),
    every core but two (at most 16) on CUDA, where one ViT-B/16 forward outruns several workers' K views
    (the first H100 build kept its teacher busy 27 % of the time with 12)."""
    if workers is not None:
        return workers
    if str(device).startswith("cuda"):
        return gpu_host_workers(os.cpu_count() or 4)
    return 2


def resolve_replay(replay: str, device: str) -> str:
    """--replay for teachers on ``device``: ``cpu`` or ``device`` (auto: device on CUDA, where per-image CPU
    replay of K views cannot keep the teacher busy; on a CPU device batching gains nothing)."""
    if replay == "auto":
        return "device" if str(device).startswith("cuda") else "cpu"
    return replay


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
        (opts.workers is None or opts.workers >= 0, f"--workers must be >= 0 (got {opts.workers})"),
        (opts.batch_size >= 1, f"--batch-size must be >= 1 (got {opts.batch_size})"),
        (opts.limit is None or opts.limit >= 1, f"--limit must be >= 1 (got {opts.limit})"),
        (opts.device == "auto" or opts.device == "cpu" or opts.device.startswith("cuda"),
         f"--device must be auto, cpu or cuda[:N] (got {opts.device!r})"),
        (opts.replay in REPLAYS, f"--replay must be one of {', '.join(REPLAYS)} (got {opts.replay!r})"),
        (opts.engine in ("local", "ray"), f"--engine must be local or ray (got {opts.engine!r})"),
        (opts.ray_actors is None or opts.ray_actors >= 1, f"--ray-actors must be >= 1 (got {opts.ray_actors})"),
        (opts.ray_retries >= 0, f"--ray-retries must be >= 0 (got {opts.ray_retries})"),
        (opts.engine != "ray" or not opts.captioner,
         "--captioner runs in the build's own process: use --engine local (torchrun ranks work)"),
        (opts.engine != "ray" or (opts.world_size or 1) == 1,
         "--engine ray schedules the shards itself: drop --rank/--world-size (they are for torchrun)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if opts.captioner:
        parse_captioner_spec(opts.captioner)  # a bad spec fails before any teacher is loaded
