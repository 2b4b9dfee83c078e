"""Embedding members: encode float rows for storage and decode stored arrays back to float32.

Schema 2: one ``<teacher>.npy`` per teacher, rows img (K), syn (S), txt (1) in that order.
float16/float32 are plain ``(R, D)`` arrays; int8 is a structured ``(R,)`` array of ``(q int8[D],
scale float32)`` records. Schema 1 (one member per part, int8 scales in ``.scale.npy``) is read.
"""
from __future__ import annotations

import io
import json

import numpy as np

from cxrdr.common.shards.members import EMB_DTYPES, EMB_PARTS, emb_ext, scale_ext, teacher_ext


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


def int8_row_dtype(dim: int) -> np.dtype:
    """Schema-2 int8 record: the quantised row and its float32 scale (D + 4 bytes)."""
    return np.dtype([("q", "i1", (int(dim),)), ("scale", "<f4")])


def encode_rows(rows: np.ndarray, dtype: str) -> np.ndarray:
    """(R, D) float rows -> the stored schema-2 array of ``dtype`` (see the module docstring)."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"expected (rows, dim) embeddings, got shape {rows.shape}")
    data, scale = encode_embedding(rows, dtype)
    if scale is None:
        return data
    out = np.empty(rows.shape[0], dtype=int8_row_dtype(rows.shape[1]))
    out["q"], out["scale"] = data, scale
    return out


def stack_parts(parts: dict) -> np.ndarray:
    """{'img'?: (K, D), 'syn': (S, D), 'txt': (D,)} -> (R, D) rows in schema-2 order."""
    rows = [np.asarray(parts[p], dtype=np.float32).reshape(-1, np.shape(parts[p])[-1])
            for p in EMB_PARTS if parts.get(p) is not None]
    return np.concatenate(rows, axis=0)


def decode_embedding(data: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """Stored embedding array -> float32. The one place stored values become floats (both schemas).

    float16/float32 keep their shape; a schema-2 int8 record array (R,) gives (R, D); a schema-1
    int8 array needs its separate ``scale`` array.
    """
    if data.dtype.names == ("q", "scale"):
        return data["q"].astype(np.float32) * data["scale"].astype(np.float32)[:, None]
    if data.dtype == np.int8:
        if scale is None:
            raise ValueError("int8 embedding without its scale array")
        return data.astype(np.float32) * np.asarray(scale, dtype=np.float32).reshape(
            data.shape[:-1] + (1,) if data.ndim > 1 else (1,))
    if data.dtype.kind != "f":
        raise ValueError(f"embedding array has dtype {data.dtype}; expected float16, float32 or int8")
    return data.astype(np.float32)


def split_rows(rows: np.ndarray, n_aug: int, n_captions: int, where: str = "embedding") -> dict:
    """(R, D) schema-2 rows -> {'img'?: (K, D), 'syn': (S, D), 'txt': (D,)}.

    R = K + S + 1 (image-text teacher on an image build) or S + 1 (text-only teacher or build).
    """
    n = rows.shape[0]
    if rows.ndim != 2 or n not in (n_aug + n_captions + 1, n_captions + 1):
        raise ValueError(f"{where}: {rows.shape[0] if rows.ndim else 0} rows of shape {rows.shape}, expected "
                         f"K+S+1 = {n_aug + n_captions + 1} or S+1 = {n_captions + 1} rows of (R, D)")
    k = n - n_captions - 1
    out = {"syn": rows[k:k + n_captions], "txt": rows[-1]}
    if k:
        out["img"] = rows[:k]
    return out


def _meta_counts(sample: dict) -> tuple[int, int]:
    meta = sample.get("json")
    if isinstance(meta, (bytes, bytearray, str)):
        meta = json.loads(meta)
    if not isinstance(meta, dict):
        raise ValueError(f"sample {sample.get('__key__')!r}: no json metadata to size its embedding rows")
    return len(meta.get("aug") or []), len(meta.get("captions") or [])


def _array(value) -> np.ndarray:
    return npy_load(value) if isinstance(value, (bytes, bytearray)) else np.asarray(value)


def sample_embeddings(sample: dict, teacher: str, n_aug: int | None = None,
                      n_captions: int | None = None) -> dict | None:
    """Every reader's entry point: one teacher's decoded float32 parts of a raw sample dict.

    Returns {'img'?: (K, D), 'syn': (S, D), 'txt': (D,)} or None when the sample has no embedding
    of this teacher. Reads schema 2 (``<teacher>.npy``) and schema 1 (``<teacher>.<part>.npy``).
    K and S default to the lengths of the sample json's ``aug`` and ``captions``.
    """
    where = f"sample {sample.get('__key__')!r}: {teacher_ext(teacher)}"
    if teacher_ext(teacher) in sample:
        if n_aug is None or n_captions is None:
            n_aug, n_captions = _meta_counts(sample)
        rows = decode_embedding(_array(sample[teacher_ext(teacher)]))
        return split_rows(rows, n_aug, n_captions, where)
    out = {}
    for part in EMB_PARTS:  # schema 1
        if emb_ext(teacher, part) in sample:
            scale = sample.get(scale_ext(teacher, part))
            out[part] = decode_embedding(_array(sample[emb_ext(teacher, part)]),
                                         None if scale is None else _array(scale))
    return out or None


def sample_embedding(sample: dict, teacher: str, part: str) -> np.ndarray | None:
    """One part of :func:`sample_embeddings` (None when absent, e.g. a text-only teacher's 'img')."""
    if part not in EMB_PARTS:
        raise ValueError(f"unknown embedding part {part!r}; expected one of {EMB_PARTS}")
    parts = sample_embeddings(sample, teacher)
    return None if parts is None else parts.get(part)


def repack_v1_teacher(sample: dict, teacher: str) -> bytes | None:
    """Schema-1 members of a teacher -> the schema-2 member bytes, losslessly (no re-quantisation)."""
    if emb_ext(teacher, "txt") not in sample:
        return None
    arrays = [(_array(sample[emb_ext(teacher, p)]), sample.get(scale_ext(teacher, p)))
              for p in EMB_PARTS if emb_ext(teacher, p) in sample]
    rows = [a.reshape(-1, a.shape[-1]) for a, _ in arrays]
    data = np.concatenate(rows)
    if data.dtype == np.int8:
        packed = np.empty(data.shape[0], dtype=int8_row_dtype(data.shape[1]))
        packed["q"] = data
        packed["scale"] = np.concatenate([_array(s).reshape(-1).astype(np.float32) for _, s in arrays])
        data = packed
    return npy_bytes(data)


def encode_teacher(parts: dict, dtype: str, n_aug: int, n_captions: int) -> tuple[bytes, dict | None]:
    """A teacher's float parts -> (schema-2 member bytes, int8 quality or None).

    The quality of an int8 encoding is measured on the float32 input: ``{"max_abs_error": {part:
    err}, "min_cosine": c}`` (lowest cosine of a decoded row to its float32 row).
    """
    rows = stack_parts(parts)
    stored = encode_rows(rows, dtype)
    if dtype != "int8":
        return npy_bytes(stored), None
    decoded = decode_embedding(stored)
    err = split_rows(np.abs(decoded - rows), n_aug, n_captions)
    cos = (decoded * rows).sum(1) / np.maximum(np.linalg.norm(decoded, axis=1) * np.linalg.norm(rows, axis=1), 1e-12)
    return npy_bytes(stored), {"max_abs_error": {p: float(v.max()) for p, v in err.items()},
                               "min_cosine": float(cos.min())}


def merge_int8_quality(errors: dict, cosines: dict, teacher: str, quality: dict | None) -> None:
    """Accumulate :func:`encode_teacher` qualities: max abs error per teacher and part into
    ``errors``, lowest cosine per teacher into ``cosines``."""
    if quality is None:
        return
    cur = errors.setdefault(teacher, {})
    for part, err in quality["max_abs_error"].items():
        cur[part] = max(cur.get(part, 0.0), err)
    cosines[teacher] = min(cosines.get(teacher, 1.0), quality["min_cosine"])
