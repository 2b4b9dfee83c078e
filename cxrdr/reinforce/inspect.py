"""`reinforce inspect DIR`: what a shard folder holds, and one sample's captions and aug params (``--views``: drawn,
``views_sheet``; ``--teacher-check``: what each teacher's stored embeddings know, ``teacher_check``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.common.errors import UserError
from cxrdr.common.shards import (iter_tar_samples, load_meta, npy_load, read_dataset_info, sample_embeddings,
                                 teacher_ext)
from cxrdr.reinforce.card import replay_text
from cxrdr.reinforce.teacher_check import check_text
from cxrdr.reinforce.teacher_check import teacher_check as run_teacher_check
from cxrdr.reinforce.views_sheet import draw_views


def first_sample(shards_dir: Path, info: dict, key: str | None = None) -> tuple[str, dict] | None:
    """(shard name, raw sample) of the first sample, or of ``key`` when given."""
    for shard in info["shards"]:
        if not shard["samples"]:
            continue
        for k, sample in iter_tar_samples(Path(shards_dir) / shard["name"]):
            if key is None or k == key:
                return shard["name"], {"__key__": k, **sample}
    return None


def storage_lines(shards_dir: Path, info: dict, raw: dict | None) -> list[str]:
    """On-disk bytes per sample (tars, headers and padding included) against the payload, and per
    teacher the stored bytes per vector of the sample shown (int8: D + 4, the scale included)."""
    n = info["total_samples"]
    disk = sum((Path(shards_dir) / s["name"]).stat().st_size for s in info["shards"])
    payload = info["bytes_per_sample"].get("total", 0.0)
    members = len([e for e in raw if not e.startswith("__")]) if raw else None
    compression = info.get("compression", "none")  # folders from before the option are plain tars
    layout = (f"{members} members/sample, each with a 512-byte tar header and padding to 512"
              + ("; the tar gzip-compressed" if compression == "gzip" else ""))
    lines = [f"on disk: {disk / n if n else 0:.0f} bytes/sample for {payload:.0f} bytes/sample of payload "
             f"(x{disk / n / payload if n and payload else 0:.3f}; {layout})"]
    cosines = info.get("int8_min_cosine") or {}
    for t in info["teachers"]:
        data = (raw or {}).get(teacher_ext(t["name"]))
        if data is None:
            continue
        arr = npy_load(data)
        rows = arr.shape[0]
        header = len(data) - arr.nbytes
        extra = f", min cosine to float32 {cosines[t['name']]:.5f}" if t["name"] in cosines else ""
        lines.append(f"  {t['name']:<16} {arr.nbytes / rows:.0f} bytes/vector (D={t['embed_dim']}, "
                     f"{info['emb_dtype']}) x {rows} rows + {header} bytes npy header{extra}")
    return lines


def describe_text(shards_dir: Path, info: dict, sample: tuple[str, dict] | None, n_params: int = 3) -> str:
    lines = [f"shard folder: {shards_dir} (schema v{info['schema_version']})",
             f"source: {info['source'].get('name', info['source'])}  images: {info.get('images', True)}",
             f"samples: {info['total_samples']} in {len(info['shards'])} shards; per split: {info['counts']}",
             f"K={info['n_aug']} aug sets, S={info['n_captions']} captions, store_size={info['store_size']}, "
             f"image_format={info['image_format']}, emb_dtype={info['emb_dtype']}, seed={info['seed']}, "
             f"compression={info.get('compression', 'none')}",
             "teachers:"]
    for t in info["teachers"]:
        flag = "  [TEST ONLY]" if t.get("test_only") else ""
        lines.append(f"  {t['name']:<16} kind={t['kind']:<4} dim={t['embed_dim']:<5} "
                     f"logit_scale={t['logit_scale']:.2f} size={t.get('image_size')} "
                     f"fingerprint={t['fingerprint']}  ({t['spec']}){flag}")
    captioner = info.get("captioner")
    if captioner:
        bank = captioner.get("bank") or {}
        lines.append(f"captioner: {captioner['spec']} -> captions {captioner.get('caption_source')} by teacher "
                     f"{captioner.get('teacher')}, S={info['n_captions']} per view"
                     + (f"; bank {bank.get('sentences')} sentences from {bank.get('from')} in {bank.get('dir')}/"
                        if bank else ""))
    lines.append("bytes/sample by part:")
    for part, n in info["bytes_per_sample"].items():
        lines.append(f"  {part:<16} {n:>10.0f}")
    lines += storage_lines(shards_dir, info, sample[1] if sample else None)
    if info.get("int8_max_abs_error"):
        lines.append(f"int8 max abs error: {info['int8_max_abs_error']}")
    b = info.get("build") or {}
    if b:
        lines.append(f"build: {b.get('samples_per_second')} samples/s, wall {b.get('wall_seconds')} s, "
                     f"time split {b.get('time_split_seconds')}")
    if info.get("images", True):
        lines.append(f"replay: {replay_text(info)}")
    sk = info.get("skipped", {})
    lines.append(f"skipped: source {sk.get('source', {}).get('count', 0)} "
                 f"{sk.get('source', {}).get('by_reason', {})}, build {sk.get('build', {}).get('count', 0)} "
                 f"{sk.get('build', {}).get('by_reason', {})}")
    if sample is None:
        return "\n".join(lines)
    shard, raw = sample
    meta = load_meta(raw["json"])
    lines += ["", f"sample {raw['__key__']} (id {meta['id']}) in {shard}: split={meta['split']} "
                  f"subject={meta['subject_id']} study={meta['study_id']} view={meta['view']} "
                  f"image_size={meta['image_size']}",
              f"  report: {raw['txt'].decode('utf-8')[:300]}",
              "  positive labels: " + (", ".join(k for k, v in meta["labels"].items() if v == 1) or "none"),
              "  captions:"]
    lines += [f"    [{c['source']}] {c['text']}{_views_of(meta, i)}" for i, c in enumerate(meta["captions"])]
    lines.append(f"  aug params (first {min(n_params, len(meta['aug']))} of {len(meta['aug'])}):")
    lines += [f"    {json.dumps(p)}" for p in meta["aug"][:n_params]]
    for t in info["teachers"]:
        parts = sample_embeddings(raw, t["name"]) or {}
        shapes = {part: tuple(emb.shape) for part, emb in parts.items()}
        lines.append(f"  {t['name']} embeddings: {shapes}")
    return "\n".join(lines)


def _views_of(meta: dict, index: int) -> str:
    """'  (view 0 #1 cos 0.312, view 3 #2 cos 0.298; bank row 17)' for a captioner build's caption."""
    views = meta.get("caption_views")
    if not views:
        return ""
    where = [f"view {k} #{rank + 1} cos {meta['caption_scores'][k][rank]:.3f}"
             for k, ids in enumerate(views) for rank, i in enumerate(ids) if i == index]
    return f"  ({', '.join(where)}; bank row {meta['caption_bank_ids'][index]})"


def cli_inspect(
    shards_dir: Annotated[Path, typer.Argument(help="Shard folder written by `reinforce build`.")],
    key: Annotated[Optional[str], typer.Option(help="Show this sample key instead of the first one.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print dataset.json instead of the summary.")] = False,
    views: Annotated[Optional[Path], typer.Option(
        help="Also draw the sample's stored image and its K augmented views, as the student replays them, with "
             "the finding boxes carried into each view and where each image teacher ranks the sample's report "
             "among its shard's (PNG).")] = None,
    view_size: Annotated[Optional[int], typer.Option(
        help="Side of the drawn views in pixels (default: the first image teacher's input size, else the stored "
             "size).")] = None,
    teacher_check: Annotated[bool, typer.Option(
        "--teacher-check", help="Also rank, by each teacher's stored embeddings, every view's and caption's own "
                                "report among the split's reports: recall@1/5/10 and median rank beside chance "
                                "(what a teacher knows of this data, with no model loaded).")] = False,
    split: Annotated[str, typer.Option(help="Split of --teacher-check.")] = "test",
    limit: Annotated[int, typer.Option(help="--teacher-check reads at most this many samples of the split "
                                            "(0: all).")] = 2000,
) -> None:
    """Summarise a shard folder: counts, splits, teachers, bytes/sample, one sample's captions and aug params."""
    info = read_dataset_info(shards_dir)
    if as_json:
        typer.echo(json.dumps(info, indent=1))
        return
    sample = first_sample(shards_dir, info, key)
    if key is not None and sample is None:
        raise UserError(f"no sample with key {key!r} in {shards_dir}")
    typer.echo(describe_text(shards_dir, info, sample))
    if views is not None:
        if sample is None:
            raise UserError(f"{shards_dir} holds no sample to draw")
        drawn = draw_views(shards_dir, info, sample[0], sample[1], views, view_size)
        ranks = "; ".join(f"{t}: report #{'/'.join(map(str, r['ranks']))} of {r['n']}"
                          for t, r in drawn["ranks"].items()) or "no teacher with image embeddings"
        typer.echo(f"wrote {views}: {drawn['views']} views of {drawn['key']} at {drawn['size']} px; {ranks}")
    if teacher_check:
        typer.echo(check_text(run_teacher_check(shards_dir, info, split, limit or None)))
