"""`reinforce inspect DIR --teacher-check`: what each stored teacher knows of this data, read from its stored
embeddings alone (no model is loaded).

For every teacher, over one split's samples: how well each stored view finds its own report among the split's
reports (image-text teachers), and how well each stored caption does (every teacher: the captions' targets in
B_syn). Recall@1/5/10 and the median rank beside chance. A teacher whose views rank their reports about halfway
(chance) has nothing image-specific to distil, whatever its own loss curve said. Reports with the same text score
alike and tie in the own report's favour (as ``train eval``'s "same text" recall does).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cxrdr.common.errors import UserError
from cxrdr.common.shards import decode_sample, iter_tar_samples

RECALL_AT = (1, 5, 10)


def own_ranks(queries: np.ndarray, candidates: np.ndarray, own: np.ndarray) -> np.ndarray:
    """Rank (1 = first) of candidate ``own[i]`` for each query row i by cosine: 1 + the candidates that score
    strictly higher (ties go to the own candidate). ``queries`` (M, D), ``candidates`` (N, D), ``own`` (M,)."""
    scores = unit(queries) @ unit(candidates).T
    mine = scores[np.arange(len(own)), own]
    return 1 + (scores > mine[:, None]).sum(axis=1)


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (float64), as cosines need."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def rank_summary(ranks: np.ndarray, n: int) -> dict:
    """Recall@k, the median rank and their chance values (a random ranking of ``n`` candidates)."""
    out = {f"R@{k}": float((ranks <= k).mean()) for k in RECALL_AT}
    out.update({f"chance_R@{k}": min(k, n) / n for k in RECALL_AT})
    out.update({"median_rank": float(np.median(ranks)), "chance_median_rank": (n + 1) / 2, "queries": int(len(ranks))})
    return out


def stored_embeddings(path: Path, names: list[str]):
    """(sample, {teacher: its decoded parts}) of every sample of one shard, in order; a teacher whose embeddings
    lack the report's row ('txt') is left out of that sample's dict."""
    for key, members in iter_tar_samples(path):
        sample = decode_sample({"__key__": key, "__url__": str(path), **members})
        parts = {t: sample.embeddings(t) or {} for t in names}
        yield sample, {t: p for t, p in parts.items() if "txt" in p}


def split_embeddings(shards_dir: Path, info: dict, split: str, limit: int | None = None) -> dict[str, dict]:
    """{teacher: {"txt": [(D,)], "img": [((K, D), sample index)], "syn": [((S, D), sample index)]}} of the first
    ``limit`` samples of ``split`` (all when None), in shard order."""
    names = [t["name"] for t in info["teachers"]]
    out: dict[str, dict] = {t: {"txt": [], "img": [], "syn": []} for t in names}
    n = 0
    for shard in info["shards"]:
        if shard.get("split") != split or not shard["samples"]:
            continue
        for sample, by_teacher in stored_embeddings(Path(shards_dir) / shard["name"], names):
            if limit is not None and n >= limit:
                return out
            if sample.split != split:
                continue
            for t, parts in by_teacher.items():
                index = len(out[t]["txt"])
                out[t]["txt"].append(parts["txt"])
                for part in ("img", "syn"):
                    if parts.get(part) is not None and len(parts[part]):
                        out[t][part].append((parts[part], index))
            n += 1
    return out


def teacher_check(shards_dir: Path, info: dict, split: str = "test", limit: int | None = 2000) -> dict:
    """Each teacher's ranks on ``split``: {"split", "teachers": {name: {"reports": N, "views"?: summary,
    "captions"?: summary}}}. UserError when the split holds no sample."""
    if not info["counts"].get(split):
        raise UserError(f"--teacher-check: split {split!r} holds no sample in {shards_dir} "
                        f"(splits: {', '.join(s for s, c in info['counts'].items() if c) or 'none'})")
    stored = split_embeddings(shards_dir, info, split, limit)
    teachers = {}
    for name, parts in stored.items():
        if not parts["txt"]:
            continue
        reports = np.stack(parts["txt"])
        row = {"reports": len(reports)}
        for part, label in (("img", "views"), ("syn", "captions")):
            if parts[part]:
                queries = np.concatenate([rows for rows, _ in parts[part]])
                own = np.concatenate([np.full(len(rows), i) for rows, i in parts[part]])
                row[label] = rank_summary(own_ranks(queries, reports, own), len(reports))
        teachers[name] = row
    return {"split": split, "limit": limit, "teachers": teachers}


def check_text(result: dict) -> str:
    """The check as a table: one row per teacher and query kind, chance beside each figure."""
    lines = [f"teacher check on split {result['split']!r} (stored embeddings; each view or caption ranks its own "
             "report among the split's; chance in brackets):"]
    for name, row in result["teachers"].items():
        n = row["reports"]
        for label in ("views", "captions"):
            s = row.get(label)
            if s is None:
                if label == "views":
                    lines.append(f"  {name:<16} views     (a text-only teacher: no image embeddings)")
                continue
            recalls = "  ".join(f"R@{k} {s[f'R@{k}']:.3f} [{s[f'chance_R@{k}']:.3f}]" for k in RECALL_AT)
            lines.append(f"  {name:<16} {label:<9} {recalls}  median rank {s['median_rank']:.0f} of {n} "
                         f"[{s['chance_median_rank']:.0f}]  ({s['queries']} queries)")
    return "\n".join(lines)
