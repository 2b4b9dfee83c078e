"""The shard contract in code: names, schema version, and embedding encode/decode.

``shards/FORMAT.md`` is the authority in prose; this module is the one place both stages use
to name files and to turn stored embedding bytes back into arrays, so the two cannot drift.
"""
from __future__ import annotations

import io
import re

import numpy as np

SCHEMA_VERSION = 1
SHARD_PATTERN = "shard-{index:06d}.tar"
SHARD_RE = re.compile(r"^shard-(\d{6})\.tar$")
DATASET_JSON = "dataset.json"
MANIFEST = "manifest.parquet"
SIZES_JSON = "sizes.json"
STATS_DIR = "stats"  # per-shard stats (and manifest rows) written beside the tars

EMB_PARTS = ("img", "syn", "txt")  # K x D, S x D, D
EMB_DTYPES = ("float16", "float32", "int8")
TEACHER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def shard_name(index: int) -> str:
    return SHARD_PATTERN.format(index=index)


def emb_ext(teacher: str, part: str) -> str:
    """WebDataset extension of a teacher embedding: '<teacher>.<part>.npy'."""
    if part not in EMB_PARTS:
        raise ValueError(f"unknown embedding part {part!r}; expected one of {EMB_PARTS}")
    return f"{teacher}.{part}.npy"


def scale_ext(teacher: str, part: str) -> str:
    """Extension of the per-row float32 scales that accompany int8 embeddings."""
    return f"{teacher}.{part}.scale.npy"


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def npy_load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def encode_embedding(emb: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Encode float embeddings (rows L2-normalised) for storage; returns (data, scales or None).

    int8 uses a symmetric per-row scale ``max|row| / 127``; decode is ``data * scale``.
    """
    emb = np.asarray(emb, dtype=np.float32)
    if dtype == "float16":
        return emb.astype(np.float16), None
    if dtype == "float32":
        return emb, None
    if dtype == "int8":
        rows = emb.reshape(-1, emb.shape[-1])
        scale = np.abs(rows).max(axis=1) / 127.0
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
        return q.reshape(emb.shape), scale.reshape(emb.shape[:-1]) if emb.ndim > 1 else scale[:1]
    raise ValueError(f"unknown embedding dtype {dtype!r}; expected one of {EMB_DTYPES}")


def decode_embedding(data: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """Stored embedding -> float32 array of the same shape."""
    if data.dtype == np.int8:
        if scale is None:
            raise ValueError("int8 embedding without its scale array")
        return data.astype(np.float32) * np.asarray(scale, dtype=np.float32).reshape(
            data.shape[:-1] + (1,) if data.ndim > 1 else (1,))
    return data.astype(np.float32)


def sample_embedding(sample: dict, teacher: str, part: str) -> np.ndarray | None:
    """Read one teacher embedding from a raw WebDataset sample dict (bytes values).

    Returns None when this teacher has no such part (e.g. a text-only teacher's 'img').
    """
    ext = emb_ext(teacher, part)
    if ext not in sample:
        return None
    data = sample[ext]
    data = npy_load(data) if isinstance(data, (bytes, bytearray)) else data
    scale = sample.get(scale_ext(teacher, part))
    if scale is not None and isinstance(scale, (bytes, bytearray)):
        scale = npy_load(scale)
    return decode_embedding(data, scale)
