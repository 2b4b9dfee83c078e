"""`reinforce add-teacher DIR --teachers SPEC`: add a teacher's embeddings to existing shards.

For each shard: read every sample, decode its stored image (the same PIL decode stage 2 uses),
replay its stored aug params at the new teacher's input size, re-embed its stored report and
captions, and rewrite the shard (temp name + rename) with the original members' bytes
unchanged plus one new ``<teacher>.npy`` member per teacher. Images, captions, params and
the other teachers' embeddings are never recomputed. An older folder is upgraded on the way to the
current schema, so a folder never mixes layouts: schema-1 per-part members are repacked losslessly
into one member per teacher (same stored values), and a schema-1 or 2 json member is rewritten in the
schema-3 form (``encode_meta``: same meaning, one type per field).

Resumable: a shard whose stats already list the teacher is skipped; a shard interrupted
between its rename and its stats update is redone (existing members of the teacher are
replaced, not duplicated). dataset.json is re-merged at the end.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import typer
from tqdm import tqdm

from cxrdr.common.checksums import checksum_record, member_checksums
from cxrdr.common.errors import UserError
from cxrdr.common.locking import lock_folder, remove_stale_temp_files
from cxrdr.common.shards import (SCHEMA_VERSION, encode_meta, encode_teacher, iter_tar_samples, load_meta,
                                 merge_int8_quality, meta_member, part_of, read_dataset_info, repack_v1_teacher,
                                 shard_compression, shard_index, teacher_ext)
from cxrdr.reinforce import manifest
from cxrdr.reinforce.embed import embed_batch
from cxrdr.reinforce.options import BuildOptions, load_build_teachers, resolve_device, resolve_replay
from cxrdr.reinforce.prepare import decode_stored_image, json_safe, pad_cat, replay_on_device, views_or_pixels
from cxrdr.reinforce.writer import TMP_SUFFIX, TarOut, read_shard_stats, stats_path, write_json_atomic


def _embed_shard_samples(samples: list[tuple[str, dict]], teachers, info: dict, replay: str = "cpu",
                         device: str = "cpu") -> list[dict]:
    """Every teacher's rows of these samples. ``replay`` as the build's (``options.resolve_replay``):
    ``cpu`` replays each image's views here, ``device`` the whole batch's views at once on ``device``."""
    images = info.get("images", True)
    sizes = sorted({t.image_size for t in teachers if t.has_images}) if images else []
    prepared = []
    for key, sample in samples:
        meta = load_meta(sample["json"])
        texts = [sample["txt"].decode("utf-8")] + [c["text"] for c in meta["captions"]]
        entry = {"key": key, "texts": texts, "crops": {}, "aug": meta["aug"], "image_size": None}
        if sizes:
            pixels = np.asarray(decode_stored_image(sample[info["image_format"]]))
            entry.update(views_or_pixels(pixels, meta["aug"], sizes, replay), image_size=pixels.shape[::-1])
        prepared.append(entry)
    if replay == "device" and sizes:
        pixels = pad_cat([entry.pop("pixels") for entry in prepared])
        return embed_batch(teachers, prepared, images, crops=replay_on_device(pixels, prepared, sizes, device))
    return embed_batch(teachers, prepared, images)


def rewrite_shard(shards_dir: Path, shard: dict, teachers, info: dict, batch_size: int, replay: str = "cpu",
                  device: str = "cpu") -> dict:
    """Add ``teachers`` to one shard; returns its updated stats."""
    index = shard_index(shard["name"])
    path = shards_dir / shard["name"]
    stats = read_shard_stats(shards_dir, index)
    new_names = {t.name for t in teachers}
    old_names = [t["name"] for t in info["teachers"] if t["name"] not in new_names]
    upgrade = info.get("schema_version", 1) < 2
    upgrade_json = info.get("schema_version", 1) < 3
    tmp = path.with_name(path.name + TMP_SUFFIX)
    errors = stats.get("int8_max_abs_error") or {}
    cosines = stats.get("int8_min_cosine") or {}
    part_bytes: dict[str, int] = {}
    checksums: dict[str, dict[str, str]] = {}
    with open(tmp, "wb") as f:
        tar = TarOut(f, shard_compression(shard["name"]))  # the shard keeps its compression
        pending: list[tuple[str, dict]] = []

        def flush():
            embs = _embed_shard_samples(pending, teachers, info, replay, device)
            for (key, sample), emb in zip(pending, embs):
                out = {"__key__": key}
                # Keep every original member byte-for-byte; drop stale members of the new teachers.
                out.update({ext: data for ext, data in sample.items() if part_of(ext) not in new_names})
                if upgrade:  # schema 1 -> 2: the old teachers' part members become one member each
                    for name in old_names:
                        packed = repack_v1_teacher(sample, name)
                        if packed is not None:  # None: this shard was upgraded by an interrupted run
                            out = {ext: data for ext, data in out.items() if part_of(ext) != name}
                            out[teacher_ext(name)] = packed
                meta = load_meta(sample["json"])
                if upgrade_json:  # schema 1/2 -> 3: the same metadata in the stored types of schema 3
                    out["json"] = meta_member(encode_meta(meta))
                for teacher, parts in emb.items():
                    data, quality = encode_teacher(parts, info["emb_dtype"], len(meta["aug"]), len(meta["captions"]))
                    merge_int8_quality(errors, cosines, teacher, quality)
                    out[teacher_ext(teacher)] = data
                for ext, data in out.items():
                    if not ext.startswith("__"):
                        part_bytes[part_of(ext)] = part_bytes.get(part_of(ext), 0) + len(data)
                tar.write(out)
                checksums[key] = member_checksums(out)
            pending.clear()

        for key, sample in iter_tar_samples(path):
            pending.append((key, sample))
            if len(pending) >= batch_size:
                flush()
        if pending:
            flush()
        tar.close()
        f.flush()
        os.fsync(f.fileno())
    stats["bytes"] = part_bytes
    stats["teachers"] = [n for n in stats.get("teachers", []) if n not in new_names] + sorted(new_names)
    stats["tar_bytes"] = tmp.stat().st_size
    stats["checksums"] = checksum_record(checksums)
    if info["emb_dtype"] == "int8":
        stats["int8_max_abs_error"], stats["int8_min_cosine"] = errors, cosines
    os.replace(tmp, path)
    write_json_atomic(stats_path(shards_dir, index), stats, indent=None)
    return stats


def add_teachers(shards_dir: Path, specs: str, device: str = "auto", model_cache: str | None = None,
                 batch_size: int = 32, progress: bool = True, teachers: list | None = None,
                 replay: str = "auto") -> dict:
    """Add the teachers in ``specs`` to every shard of ``shards_dir``; returns the new dataset.json.

    ``teachers``: already loaded teachers for ``specs`` (tests reuse them); default: load them.
    ``replay``: where the stored views are replayed, as ``reinforce build --replay`` (auto: on a CUDA
    device the whole batch's views at once there, else image by image on the CPU).
    """
    shards_dir = Path(shards_dir)
    info = read_dataset_info(shards_dir)  # before locking: a missing folder is not created
    with lock_folder(shards_dir, "reinforce add-teacher"):
        remove_stale_temp_files(shards_dir)
        return _add_teachers(shards_dir, info, specs, device, model_cache, batch_size, progress, teachers, replay)


def _add_teachers(shards_dir: Path, info: dict, specs: str, device: str, model_cache: str | None,
                  batch_size: int, progress: bool, teachers: list | None, replay: str = "auto") -> dict:
    """``add_teachers`` while holding the folder lock."""
    plan = manifest.read_plan(shards_dir)
    missing = manifest.missing_shards(shards_dir, plan)
    if missing:
        raise UserError(f"{shards_dir} has incomplete shards ({missing[:5]}); finish the build first")
    device = resolve_device(device)
    if teachers is None:
        teachers = load_build_teachers(BuildOptions(teachers=specs, model_cache=model_cache), device)
    replay = resolve_replay(replay, device)
    existing = {t["name"] for t in plan["teachers"]}
    clash = sorted({t.name for t in teachers} & existing)
    if clash:
        raise UserError(f"{shards_dir} already has teacher(s) {clash}; add a differently named one "
                        f"(spec option ?name=NEW) or rebuild")
    started = time.perf_counter()
    names = {t.name for t in teachers}
    todo = [s for s in info["shards"]
            if not names <= set(read_shard_stats(shards_dir, shard_index(s["name"])).get("teachers", []))]
    for shard in tqdm(todo, unit="shard", desc="add-teacher", disable=not progress):
        rewrite_shard(shards_dir, shard, teachers, info, batch_size, replay, device)
    plan["teachers"] = plan["teachers"] + [json_safe(t.describe()) for t in teachers]
    if plan.get("schema_version", 1) < SCHEMA_VERSION:  # rewrite_shard upgraded every shard
        plan.setdefault("upgraded_from_schema_version", plan.get("schema_version", 1))
        plan["schema_version"] = SCHEMA_VERSION
    plan.setdefault("teacher_additions", []).append(
        {"teachers": [t.name for t in teachers], "spec": specs, "shards_rewritten": len(todo), "replay": replay,
         "seconds": round(time.perf_counter() - started, 3)})
    write_json_atomic(manifest.plan_path(shards_dir), plan)
    return manifest.merge(shards_dir)


def cli_add_teacher(
    shards_dir: Annotated[Path, typer.Argument(help="Shard folder written by `reinforce build`.")],
    teachers: Annotated[str, typer.Option(help="Comma-separated teacher specs to add.")],
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
    model_cache: Annotated[str | None, typer.Option(help="Folder with local teacher weights.")] = None,
    batch_size: Annotated[int, typer.Option(help="Samples per teacher batch.")] = 32,
    replay: Annotated[str, typer.Option(help="Where the stored views are replayed: auto (device on CUDA), cpu "
                                             "(image by image), device (each batch's views at once there).")] = "auto",
) -> None:
    """Add teacher embeddings to existing shards by replaying their stored aug params and captions."""
    if not shards_dir.is_dir():
        raise UserError(f"shard folder not found: {shards_dir}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1 (got {batch_size})")
    if replay not in ("auto", "cpu", "device"):
        raise UserError(f"--replay must be auto, cpu or device (got {replay!r})")
    dataset = add_teachers(shards_dir, teachers, device=device, model_cache=model_cache, batch_size=batch_size,
                           replay=replay)
    typer.echo(f"{shards_dir}: teachers now {[t['name'] for t in dataset['teachers']]}; "
               f"bytes/sample {dataset['bytes_per_sample']}")
