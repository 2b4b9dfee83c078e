"""Bookkeeping beside the tars: the build plan, per-rank timing, and the merge step.

Files (all under the output folder):
- ``stats/plan.json``   written by every rank before any image work: settings, source and
  teacher descriptions, the shard list (index, split, record count, sha1 of the record ids).
  Every rank computes the same plan, so ranks and ``--resume`` agree on shard boundaries.
- ``stats/shard-NNNNNN.json``  one per completed shard (see ``cxrdr.reinforce.writer``).
- ``stats/rank-RRRRR.json``    timing of the last run of each rank.
- ``manifest.parquet``, ``sizes.json``, ``dataset.json``: written by ``merge`` once every
  shard of the plan is complete (automatically on rank 0, or ``reinforce merge DIR``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import pyarrow as pa
import pyarrow.parquet as pq
import typer

from cxrdr.common.atomic import replacing, write_json_atomic
from cxrdr.common.errors import UserError
from cxrdr.common.labels import CHEXPERT14
from cxrdr.common.locking import lock_folder, remove_stale_temp_files
from cxrdr.common.shards import DATASET_JSON, MANIFEST, SIZES_JSON, STATS_DIR
from cxrdr.reinforce.card import write_card
from cxrdr.reinforce.writer import is_shard_complete, read_shard_stats

PLAN_JSON = "plan.json"
# Plan fields that may differ between runs of one build without changing any shard's content.
_RUN_ONLY_FIELDS = ("world_size", "workers", "batch_size", "device")


def plan_path(out_dir: Path) -> Path:
    return Path(out_dir) / STATS_DIR / PLAN_JSON


def rank_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / STATS_DIR / f"rank-{rank:05d}.json"


def read_plan(out_dir: Path) -> dict:
    path = plan_path(out_dir)
    if not path.is_file():
        raise UserError(f"{out_dir} holds no build plan ({path} missing); run `reinforce build` first")
    return json.loads(path.read_text())


def plan_differences(old: dict, new: dict) -> list[str]:
    """Names of settings that differ between two plans (ignoring run-only fields)."""
    keys = (set(old) | set(new)) - set(_RUN_ONLY_FIELDS)
    return sorted(k for k in keys if old.get(k) != new.get(k))


def write_plan(out_dir: Path, plan: dict, resume: bool) -> None:
    """Record the plan; refuse to mix a different build into an existing folder."""
    path = plan_path(out_dir)
    plan = json.loads(json.dumps(plan))  # tuples -> lists, as a reread plan has them
    if path.is_file():
        old = json.loads(path.read_text())
        old.setdefault("compression", "none")  # plans from before the option wrote plain .tar shards
        diff = plan_differences(old, plan)
        if diff:
            hint = (f" (or pass --compression {old['compression']}, as it was built)"
                    if "compression" in diff and set(diff) <= {"compression", "shards"} else "")  # shard names
            raise UserError(f"{out_dir} already holds a build made with different settings "
                            f"({', '.join(diff)}); use another --out folder{hint}")
    write_json_atomic(path, plan)


def missing_shards(out_dir: Path, plan: dict) -> list[int]:
    return [s["index"] for s in plan["shards"] if not is_shard_complete(out_dir, s["index"])]


def wait_for_shards(out_dir: Path, plan: dict, timeout: float, poll: float = 2.0) -> None:
    """Block until every shard of the plan is complete (other ranks still writing)."""
    deadline = time.monotonic() + timeout
    while True:
        missing = missing_shards(out_dir, plan)
        if not missing:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"{i:06d}" for i in missing[:10])
            raise UserError(f"{len(missing)} shard(s) of {out_dir} are not complete after {timeout:.0f} s "
                            f"(shard {names}{' ...' if len(missing) > 10 else ''}); finish the other "
                            f"ranks (or rerun them with --resume), then run `reinforce merge {out_dir}`")
        time.sleep(poll)


def manifest_table(rows: list[dict]):
    """The manifest as a pyarrow Table with a fixed schema (labels as nullable int8)."""
    fields = [("key", pa.string()), ("id", pa.string()), ("shard", pa.string()),
              ("index_in_shard", pa.int32()), ("split", pa.string()), ("subject_id", pa.string()),
              ("study_id", pa.string()), ("view", pa.string())]
    fields += [(name, pa.int8()) for name in CHEXPERT14]
    fields += [("n_aug", pa.int32()), ("n_captions", pa.int32())]
    schema = pa.schema(fields)
    columns = {name: [row.get(name) for row in rows] for name, _ in fields}
    return pa.Table.from_pydict(columns, schema=schema)


def _max_errors(stats: list[dict]) -> dict:
    out: dict[str, dict[str, float]] = {}
    for s in stats:
        for teacher, parts in (s.get("int8_max_abs_error") or {}).items():
            for part, err in parts.items():
                cur = out.setdefault(teacher, {})
                cur[part] = max(cur.get(part, 0.0), err)
    return out


def _min_cosines(stats: list[dict]) -> dict:
    out: dict[str, float] = {}
    for s in stats:
        for teacher, cos in (s.get("int8_min_cosine") or {}).items():
            out[teacher] = min(out.get(teacher, 1.0), cos)
    return out


def _build_timing(out_dir: Path) -> dict:
    ranks = [json.loads(p.read_text()) for p in sorted((Path(out_dir) / STATS_DIR).glob("rank-*.json"))]
    if not ranks:
        return {}
    wall = max(r["wall_seconds"] for r in ranks)
    pipeline = max(r.get("pipeline_seconds", r["wall_seconds"]) for r in ranks)
    built = sum(r["samples_built"] for r in ranks)
    split = {}
    for r in ranks:
        for k, v in r["time_split_seconds"].items():
            split[k] = round(split.get(k, 0.0) + v, 3)
    return {"wall_seconds": round(wall, 3), "pipeline_seconds": round(pipeline, 3), "samples_built": built,
            "samples_per_second": round(built / pipeline, 3) if pipeline > 0 else None,
            "samples_per_second_including_setup": round(built / wall, 3) if wall > 0 else None,
            "time_split_seconds": split,
            "time_split_note": "pipeline = first batch requested to last shard written (the image "
                               "work); wall also counts opening the source and loading teachers; "
                               "decode_augment = CPU seconds summed over DataLoader workers; "
                               "teacher = main-process forward seconds; write = writer-thread seconds "
                               "writing tars (it packs the samples too: ranks' assemble_seconds); "
                               "loader_wait = main process waiting for workers; write_wait = main "
                               "process waiting for the writer thread; all summed over ranks. "
                               "Counts only the last run of each rank (a resumed build counts the "
                               "shards built by the resuming run).",
            "ranks": ranks}


def merge(out_dir: Path, wait_timeout: float = 0.0) -> dict:
    """Write manifest.parquet, sizes.json and dataset.json from the plan and per-shard stats."""
    out_dir = Path(out_dir)
    plan = read_plan(out_dir)
    wait_for_shards(out_dir, plan, wait_timeout)
    stats = [read_shard_stats(out_dir, s["index"]) for s in plan["shards"]]

    rows, seen = [], {}
    for s in stats:
        for row in s["rows"]:
            if row["key"] in seen:
                raise UserError(f"duplicate sample key {row['key']!r} in {seen[row['key']]} and {s['name']}")
            seen[row["key"]] = s["name"]
            rows.append(row)
    table = manifest_table(rows)
    with replacing(out_dir / MANIFEST) as tmp:
        pq.write_table(table, tmp)
    write_json_atomic(out_dir / SIZES_JSON, {s["name"]: s["samples"] for s in stats})

    total = sum(s["samples"] for s in stats)
    counts: dict[str, int] = {}
    for s in stats:
        counts[s["split"]] = counts.get(s["split"], 0) + s["samples"]
    part_bytes: dict[str, int] = {}
    for s in stats:
        for part, n in s["bytes"].items():
            part_bytes[part] = part_bytes.get(part, 0) + n
    bytes_per_sample = {p: round(n / total, 1) for p, n in part_bytes.items()} if total else {}
    bytes_per_sample["total"] = round(sum(part_bytes.values()) / total, 1) if total else 0.0
    build_skips = [entry for s in stats for entry in s["skipped"]]
    by_reason: dict[str, int] = {}
    for entry in build_skips:
        cat = entry["reason"].split(":", 1)[0]
        by_reason[cat] = by_reason.get(cat, 0) + 1

    header = {k: v for k, v in plan.items() if k not in ("shards", "source_skipped") + _RUN_ONLY_FIELDS}
    dataset = {
        **header,
        "counts": counts,
        "total_samples": total,
        "shards": [{"name": s["name"], "split": s["split"], "samples": s["samples"],
                    "records": s["records"]} for s in stats],
        "bytes_per_sample": bytes_per_sample,
        "int8_max_abs_error": _max_errors(stats) if plan.get("emb_dtype") == "int8" else None,
        "int8_min_cosine": _min_cosines(stats) if plan.get("emb_dtype") == "int8" else None,
        "skipped": {"source": plan.get("source_skipped", {}),
                    "build": {"count": len(build_skips), "by_reason": by_reason, "records": build_skips}},
        "build": _build_timing(out_dir),
    }
    write_json_atomic(out_dir / DATASET_JSON, dataset)

    write_card(out_dir, dataset)  # README.md: the dataset card, regenerated with every merge
    return dataset


def cli_merge(
    out_dir: Annotated[Path, typer.Argument(help="Shard folder written by `reinforce build` (all ranks).")],
    wait: Annotated[float, typer.Option(help="Seconds to wait for other ranks' shards to complete.")] = 0.0,
) -> None:
    """Merge per-shard stats of a (multi-rank) build into manifest.parquet, sizes.json and dataset.json."""
    if not out_dir.is_dir():
        raise UserError(f"shard folder not found: {out_dir}")

    with lock_folder(out_dir, "reinforce merge"):
        remove_stale_temp_files(out_dir)
        dataset = merge(out_dir, wait_timeout=wait)
    typer.echo(f"merged {len(dataset['shards'])} shards, {dataset['total_samples']} samples "
               f"({dataset['counts']}) into {out_dir / MANIFEST}, {out_dir / DATASET_JSON}, "
               f"{out_dir / SIZES_JSON}")
