"""Names: the files of a shard folder and the members of a sample (``<key>.<ext>``)."""
from __future__ import annotations

import re
from pathlib import Path

SCHEMA_VERSION = 3
READABLE_SCHEMA_VERSIONS = (1, 2, 3)  # readers accept all; builds write SCHEMA_VERSION
SHARD_PATTERN = "shard-{index:06d}.tar"
SHARD_RE = re.compile(r"^shard-(\d{6})\.tar(?:\.gz)?$")
# Shard compression -> file suffix. gzip (the default) stores the same tar as one gzip stream: the
# 512-byte member headers and the padding to 512 bytes, ~30% of a small-image shard, shrink to almost
# nothing (webdataset, open_clip_train and tar read .tar.gz as they are).
SHARD_SUFFIXES = {"gzip": ".tar.gz", "none": ".tar"}
DATASET_JSON = "dataset.json"
MANIFEST = "manifest.parquet"
SIZES_JSON = "sizes.json"
STATS_DIR = "stats"  # per-shard stats (and manifest rows) written beside the tars

IMAGE_EXTS = ("png", "jpg", "jpeg")  # the image member: dataset.json["image_format"] (jpg or png)
EMB_PARTS = ("img", "syn", "txt")  # K x D, S x D, D
EMB_DTYPES = ("float16", "float32", "int8")
TEACHER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def shard_name(index: int, compression: str = "none") -> str:
    """``shard-NNNNNN.tar`` (compression none) or ``shard-NNNNNN.tar.gz`` (gzip)."""
    if compression not in SHARD_SUFFIXES:
        raise ValueError(f"shard compression must be one of {sorted(SHARD_SUFFIXES)}, got {compression!r}")
    return SHARD_PATTERN.format(index=index)[:-len(".tar")] + SHARD_SUFFIXES[compression]


def shard_index(name: str) -> int:
    """``shard-000012.tar[.gz]`` -> 12 (ValueError for another name)."""
    match = SHARD_RE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a shard name (shard-NNNNNN.tar or shard-NNNNNN.tar.gz)")
    return int(match.group(1))


def shard_stats_path(shards_dir, index: int) -> Path:
    """``stats/shard-NNNNNN.json``: the build's record of one shard (size, member CRC-32s)."""
    return Path(shards_dir) / STATS_DIR / f"{Path(shard_name(index)).stem}.json"


def shard_compression(name: str) -> str:
    """The compression a shard's file name says: 'gzip' for .tar.gz, else 'none'."""
    return "gzip" if name.endswith(SHARD_SUFFIXES["gzip"]) else "none"


def teacher_ext(teacher: str) -> str:
    """Schema-2 extension of a teacher's one embedding member: '<teacher>.npy'."""
    return f"{teacher}.npy"


def emb_ext(teacher: str, part: str) -> str:
    """Schema-1 extension of one teacher embedding part: '<teacher>.<part>.npy'."""
    if part not in EMB_PARTS:
        raise ValueError(f"unknown embedding part {part!r}; expected one of {EMB_PARTS}")
    return f"{teacher}.{part}.npy"


def scale_ext(teacher: str, part: str) -> str:
    """Schema-1 extension of the per-row float32 scales that accompany int8 embeddings."""
    return f"{teacher}.{part}.scale.npy"


def part_of(ext: str) -> str:
    """Accounting bucket of a member: 'image', 'text', 'json' or the teacher's name."""
    if ext in IMAGE_EXTS:
        return "image"
    if ext == "txt":
        return "text"
    if ext == "json":
        return "json"
    return ext.split(".", 1)[0]  # '<teacher>.npy', schema 1 '<teacher>.<part>[.scale].npy'


def teacher_shapes(info: dict, teacher: dict, n_captions: int | None = None) -> dict[str, tuple]:
    """part -> decoded shape of one teacher's embeddings in the build described by ``info``.
    ``n_captions``: the sample's own caption count (a captioner build stores S..K*S per sample)."""
    K, D = info["n_aug"], teacher["embed_dim"]
    S = info["n_captions"] if n_captions is None else n_captions
    shapes = {"syn": (S, D), "txt": (D,)}
    if info.get("images", True) and teacher["kind"] == "clip":
        shapes = {"img": (K, D), **shapes}
    return shapes


def expected_members(info: dict, n_captions: int | None = None) -> dict[str, tuple | None]:
    """Every member ext of a sample -> its stored array shape (None for non-array members);
    ``n_captions``: the sample's own caption count where it varies (a build with a captioner)."""
    members: dict[str, tuple | None] = {"txt": None, "json": None}
    if info.get("images", True):
        members[info["image_format"]] = None
    for t in info["teachers"]:
        shapes = teacher_shapes(info, t, n_captions)
        if info.get("schema_version", 1) >= 2:
            rows = sum(shape[0] if len(shape) > 1 else 1 for shape in shapes.values())
            members[teacher_ext(t["name"])] = (rows,) if info["emb_dtype"] == "int8" else (rows, t["embed_dim"])
            continue
        for part, shape in shapes.items():
            members[emb_ext(t["name"], part)] = shape
            if info["emb_dtype"] == "int8":
                members[scale_ext(t["name"], part)] = shape[:-1] if len(shape) > 1 else (1,)
    return members
