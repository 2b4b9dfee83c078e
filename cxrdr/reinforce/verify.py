"""`reinforce verify DIR`: check every shard against dataset.json, manifest.parquet and sizes.json.

Checks: every tar listed in dataset.json exists, reads to its end-of-archive marker (so a
truncated tar is caught even when it was cut between two members) and matches the size its
stats file recorded; every sample has all its parts; embedding shapes and dtypes match
dataset.json (K, S, D per teacher, int8 scales), values are finite and rows L2-normalised;
metadata agrees with its shard (key, split, K params, S captions, image size) and, from schema 3,
has every field in its declared type; a captioner build's captions: S..K*S distinct, K per-view lists of S
indexes and scores (cosines, best first), each caption its bank sentence; stored images decode; every member's bytes match the CRC-32 the build recorded in the shard's stats (bit rot); the manifest lists exactly the tars' keys in order and sizes.json their counts.
Any problem -> exit 1, one line per problem naming the shard and key.
"""
from __future__ import annotations

import io
import json
import tarfile
from collections import OrderedDict
from pathlib import Path
from typing import Annotated

import numpy as np
import pyarrow.parquet as pq
import typer
from PIL import Image
from tqdm import tqdm

from cxrdr.common.checksums import checksum_problems
from cxrdr.common.errors import UserError
from cxrdr.reinforce.captioners.check import caption_problems, load_bank_sentences
from cxrdr.common.shards import (DATASET_JSON, MANIFEST, SHARD_RE, SIZES_JSON, check_stored_meta, decode_meta, emb_ext,
                                 expected_members, int8_row_dtype, iter_tar_samples, npy_load, read_dataset_info,
                                 sample_embeddings, scale_ext, teacher_ext, teacher_shapes)
from cxrdr.reinforce.writer import stats_path

NORM_TOLERANCE = {"float32": 1e-3, "float16": 5e-3, "int8": 5e-2}


def _stored_dtype(info: dict, t: dict) -> np.dtype:
    if info["emb_dtype"] == "int8" and info.get("schema_version", 1) >= 2:
        return int8_row_dtype(t["embed_dim"])
    return np.dtype(info["emb_dtype"])


def _check_stored(where: str, sample: dict, info: dict, t: dict, expected: dict) -> list[str]:
    """Shapes and dtypes of the stored arrays of one teacher (before decoding)."""
    if info.get("schema_version", 1) >= 2:
        members = {teacher_ext(t["name"]): _stored_dtype(info, t)}
    else:
        members = {emb_ext(t["name"], p): _stored_dtype(info, t) for p in teacher_shapes(info, t)}
        if info["emb_dtype"] == "int8":
            members.update({scale_ext(t["name"], p): np.dtype(np.float32) for p in teacher_shapes(info, t)})
    for ext, dtype in members.items():
        try:
            arr = npy_load(sample[ext])
        except ValueError as exc:
            return [f"{where}: {ext} is not a readable .npy ({exc})"]
        if arr.shape != expected[ext]:
            return [f"{where}: {ext} has shape {arr.shape}, expected {expected[ext]}"]
        if arr.dtype != dtype:
            return [f"{where}: {ext} has dtype {arr.dtype}, expected {dtype}"]
    return []


def _caption_count(sample: dict, info: dict) -> int:
    """The sample's own number of captions in a captioner build (S..K*S), else dataset.json's S."""
    if not info.get("captioner"):
        return info["n_captions"]
    try:
        return len(json.loads(sample["json"]).get("captions") or [])
    except (KeyError, ValueError, AttributeError):
        return info["n_captions"]  # the json check below names the problem


def check_sample(shard: dict, key: str, sample: dict, info: dict, expected: dict,
                 bank: list[str] | None = None) -> list[str]:
    where = f"{shard['name']}: key {key}"
    n_captions = _caption_count(sample, info)
    if n_captions != info["n_captions"]:
        expected = expected_members(info, n_captions)
    problems = [f"{where}: missing {ext}" for ext in expected if ext not in sample]
    problems += [f"{where}: unexpected member {key}.{ext}" for ext in sample if ext not in expected]
    if problems:
        return problems
    dtype = info["emb_dtype"]
    for t in info["teachers"]:
        stored = _check_stored(where, sample, info, t, expected)
        if stored:
            problems += stored
            continue
        parts = sample_embeddings(sample, t["name"], info["n_aug"] if info.get("images", True) else 0,
                                  n_captions)
        for part, values in parts.items():
            ext = f"{t['name']}.{part}"
            if not np.isfinite(values).all():
                problems.append(f"{where}: {ext} contains NaN or inf")
                continue
            norms = np.linalg.norm(values.reshape(-1, values.shape[-1]), axis=1)
            if np.abs(norms - 1).max() > NORM_TOLERANCE[dtype]:
                problems.append(f"{where}: {ext} rows are not L2-normalised (norms {norms.min():.3f}.."
                                f"{norms.max():.3f})")
    try:
        member = json.loads(sample["json"])
        if info.get("schema_version", 1) >= 3:  # one type per field, as the dataset card declares
            check_stored_meta(member, captioned=bool(info.get("captioner")))
        meta = decode_meta(member)
    except (ValueError, AttributeError) as exc:
        return problems + [f"{where}: json is not valid ({exc})"]
    if meta.get("key") != key:
        problems.append(f"{where}: json key is {meta.get('key')!r}")
    if meta.get("split") != shard["split"]:
        problems.append(f"{where}: split {meta.get('split')!r} in a {shard['split']} shard")
    if info.get("captioner"):
        problems += caption_problems(where, meta, info, bank)
    elif len(meta.get("captions", [])) != info["n_captions"]:
        problems.append(f"{where}: {len(meta.get('captions', []))} captions, expected {info['n_captions']}")
    if len(meta.get("aug", [])) != info["n_aug"]:
        problems.append(f"{where}: {len(meta.get('aug', []))} aug param sets, expected {info['n_aug']}")
    if info.get("images", True):
        try:
            image = Image.open(io.BytesIO(sample[info["image_format"]]))
            image.load()
            if list(image.size) != list(meta.get("image_size") or []):
                problems.append(f"{where}: image is {image.size}, json image_size {meta.get('image_size')}")
            elif min(image.size) != info["store_size"]:
                problems.append(f"{where}: image short side {min(image.size)} != store_size {info['store_size']}")
        except Exception as exc:  # noqa: BLE001 - any decode failure is a finding
            problems.append(f"{where}: stored image does not decode ({type(exc).__name__}: {exc})")
    return problems


def _sizes_and_manifest(shards_dir: Path, problems: list[str]) -> tuple[dict, list[dict] | None]:
    """sizes.json ({} when unreadable) and the manifest's rows (None when unreadable), noting problems."""
    sizes, manifest_rows = {}, None
    try:
        sizes = json.loads((shards_dir / SIZES_JSON).read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"{SIZES_JSON}: unreadable ({exc})")
    try:
        manifest_rows = pq.read_table(shards_dir / MANIFEST).to_pylist()
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{MANIFEST}: unreadable ({exc})")
    return sizes, manifest_rows


def verify(shards_dir: Path, on_shard=None) -> tuple[list[str], dict]:
    """All problems found (empty = valid) and a few totals."""
    shards_dir = Path(shards_dir)
    try:
        info = read_dataset_info(shards_dir)
    except UserError as exc:
        return [str(exc)], {}
    problems: list[str] = []
    sizes, manifest_rows = _sizes_and_manifest(shards_dir, problems)
    by_shard: dict[str, list[dict]] = OrderedDict()
    for row in manifest_rows or []:
        by_shard.setdefault(row["shard"], []).append(row)

    expected = expected_members(info)
    bank, bank_problems = load_bank_sentences(shards_dir, info)  # a captioner build's caption-bank/
    problems += bank_problems
    listed = {s["name"] for s in info["shards"]}
    on_disk = {p.name for p in shards_dir.glob("shard-*") if SHARD_RE.match(p.name)}
    problems += [f"{name}: tar on disk but not listed in {DATASET_JSON}" for name in sorted(on_disk - listed)]
    seen_keys: dict[str, str] = {}
    total, counts = 0, {}
    for shard in info["shards"]:
        name, path = shard["name"], shards_dir / shard["name"]
        if on_shard:
            on_shard(name)
        if not path.is_file():
            problems.append(f"{name}: tar missing")
            continue
        if sizes and sizes.get(name) != shard["samples"]:
            problems.append(f"{name}: {SIZES_JSON} says {sizes.get(name)} samples, {DATASET_JSON} "
                            f"says {shard['samples']}")
        index = int(SHARD_RE.match(name).group(1))
        spath = stats_path(shards_dir, index)
        checksums = None
        if spath.is_file():
            stats = json.loads(spath.read_text())
            recorded, checksums = stats.get("tar_bytes"), stats.get("checksums")
            if recorded is not None and recorded != path.stat().st_size:
                problems.append(f"{name}: file is {path.stat().st_size} bytes, the build wrote {recorded} "
                                f"(truncated or modified)")
        keys, last = [], None
        try:
            for key, sample in iter_tar_samples(path):
                last = key
                keys.append(key)
                if key in seen_keys:
                    problems.append(f"{name}: key {key}: duplicate (also in {seen_keys[key]})")
                seen_keys[key] = name
                problems += check_sample(shard, key, sample, info, expected, bank)
                problems += checksum_problems(f"{name}: key {key}", key, sample, checksums)
        except (tarfile.TarError, EOFError, OSError) as exc:
            after = f" after key {last}" if last else ""
            problems.append(f"{name}: unreadable tar{after} ({exc})")
        if len(keys) != shard["samples"]:
            problems.append(f"{name}: holds {len(keys)} samples, {DATASET_JSON} says {shard['samples']}")
        if manifest_rows is not None:
            mkeys = [r["key"] for r in by_shard.get(name, [])]
            if mkeys != keys:
                missing = sorted(set(mkeys) - set(keys))[:3]
                extra = sorted(set(keys) - set(mkeys))[:3]
                problems.append(f"{name}: manifest keys differ from the tar (manifest-only {missing}, "
                                f"tar-only {extra}{', order differs' if not missing and not extra else ''})")
            bad_split = [r["key"] for r in by_shard.get(name, []) if r["split"] != shard["split"]]
            if bad_split:
                problems.append(f"{name}: key {bad_split[0]}: manifest split differs from shard split "
                                f"{shard['split']}")
        total += len(keys)
        counts[shard["split"]] = counts.get(shard["split"], 0) + len(keys)
    if manifest_rows is not None:
        unknown = sorted(set(by_shard) - listed)
        problems += [f"{MANIFEST}: rows for unknown shard {n}" for n in unknown]
    if {k: v for k, v in counts.items() if v} != {k: v for k, v in info.get("counts", {}).items() if v}:
        problems.append(f"{DATASET_JSON}: counts {info.get('counts')} but the tars hold {counts}")
    return problems, {"shards": len(info["shards"]), "samples": total, "counts": counts}


def cli_verify(
    shards_dir: Annotated[Path, typer.Argument(help="Shard folder written by `reinforce build`.")],
    max_problems: Annotated[int, typer.Option(help="Print at most this many problems.")] = 50,
) -> None:
    """Check every shard against dataset.json, manifest.parquet and sizes.json (exit 1 on any problem)."""
    if not shards_dir.is_dir():
        raise UserError(f"shard folder not found: {shards_dir}")
    bar = tqdm(unit="shard", desc="verify", leave=False)
    problems, totals = verify(shards_dir, on_shard=lambda name: bar.update(1))
    bar.close()
    if problems:
        for line in problems[:max_problems]:
            typer.echo(f"FAIL {line}")
        if len(problems) > max_problems:
            typer.echo(f"... and {len(problems) - max_problems} more")
        typer.echo(f"verify: {len(problems)} problem(s) in {shards_dir}")
        raise typer.Exit(code=1)
    typer.echo(f"verify: OK - {totals['shards']} shards, {totals['samples']} samples {totals['counts']} "
               f"in {shards_dir}")
