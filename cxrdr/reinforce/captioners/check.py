"""`reinforce verify` of a captioner build's caption fields (``cxrdr.common.shards.CAPTIONER_META_TYPES``)."""
from __future__ import annotations

import math
from pathlib import Path

from cxrdr.reinforce.captioners.bank import BANK_DIR, read_bank

SCORE_SLACK = 1e-3  # cosines of float32 rows stored rounded to 6 decimals


def load_bank_sentences(shards_dir: Path, info: dict) -> tuple[list[str] | None, list[str]]:
    """(the bank's sentences or None, problems) of a build whose dataset.json has a ``captioner``
    with a bank (retrieval); (None, []) for one without a bank."""
    bank = (info.get("captioner") or {}).get("bank")
    if not bank:
        return None, []
    try:
        sentences, embeddings, _ = read_bank(shards_dir)
    except (OSError, ValueError) as exc:
        return None, [f"{BANK_DIR}: unreadable ({type(exc).__name__}: {exc})"]
    problems = []
    if len(sentences) != bank.get("sentences") or embeddings.shape != (len(sentences), bank.get("dim")):
        problems.append(f"{BANK_DIR}: {len(sentences)} sentences, embeddings {embeddings.shape}; dataset.json says "
                        f"{bank.get('sentences')} of dim {bank.get('dim')}")
    return sentences, problems


def caption_problems(where: str, meta: dict, info: dict, bank: list[str] | None) -> list[str]:
    """What is wrong with one sample's captions and their per-view provenance."""
    K, S = info["n_aug"], info["n_captions"]
    source = info["captioner"].get("caption_source")
    captions, views, scores = meta["captions"], meta["caption_views"], meta["caption_scores"]
    ids = meta["caption_bank_ids"]
    problems = []
    if not S <= len(captions) <= K * S:
        problems.append(f"{where}: {len(captions)} captions, expected {S}..{K * S} (the distinct captions of "
                        f"{K} views x {S})")
    if len({c["text"] for c in captions}) != len(captions):
        problems.append(f"{where}: captions repeat a text")
    if meta["caption_source"] != source or any(c["source"] != source for c in captions):
        problems.append(f"{where}: caption source is not the captioner's {source!r}")
    if len(views) != K or any(len(v) != S for v in views):
        return problems + [f"{where}: caption_views is not {K} lists of {S}"]
    if len(scores) != K or any(len(v) != S for v in scores):
        return problems + [f"{where}: caption_scores is not {K} lists of {S}"]
    for k, (view, row) in enumerate(zip(views, scores)):
        if any(not 0 <= i < len(captions) for i in view) or len(set(view)) != S:
            problems.append(f"{where}: caption_views[{k}] {view} are not {S} distinct caption indexes")
        if any(not math.isfinite(s) or abs(s) > 1 + SCORE_SLACK for s in row) or \
                any(a < b for a, b in zip(row, row[1:])):
            problems.append(f"{where}: caption_scores[{k}] {row} are not cosines best first")
    if {i for v in views for i in v} != set(range(len(captions))):
        problems.append(f"{where}: a caption belongs to no view")
    if len(ids) != len(captions):
        problems.append(f"{where}: {len(ids)} caption_bank_ids for {len(captions)} captions")
    elif bank is not None:
        wrong = [i for i, c in zip(ids, captions) if not 0 <= i < len(bank) or bank[i] != c["text"]]
        if wrong:
            problems.append(f"{where}: caption_bank_ids {wrong[:3]} do not name the captions' bank sentences")
    return problems
