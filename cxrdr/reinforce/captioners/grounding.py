"""Are retrieved captions about what the image shows? On data whose findings are known per image (the
phantom), the fraction of retrieved sentences that assert a finding the image has, beside the same
fraction for a sentence drawn at random from the bank (the base rate a blind captioner would reach).

A sentence *asserts* the CheXpert findings whose words it contains, unless it is a negation or a normal
statement ("No pleural effusion.", "Heart size is normal.", "The lungs are clear."): keyword rules that
fit the phantom's templated reports, not a general labeller. A retrieved sentence is a *hit* when any
finding it asserts is positive (label 1) in the sample; sentences asserting nothing are counted apart.
"""
from __future__ import annotations

import re
from pathlib import Path

from cxrdr.common.shards import iter_tar_samples, load_meta, read_dataset_info
from cxrdr.reinforce.captioners.bank import read_bank

FINDING_WORDS = {
    "Cardiomegaly": r"cardiomegaly|enlarged (?:heart|cardiac)|heart is enlarged",
    "Pleural Effusion": r"effusion",
    "Pneumothorax": r"pneumothorax",
    "Edema": r"edema",
    "Consolidation": r"consolidation",
    "Lung Opacity": r"opacit(?:y|ies)",
    "Lung Lesion": r"nodule|mass\b",
    "Atelectasis": r"atelectasis",
    "Support Devices": r"\btube\b|catheter|\bleads\b|\bline\b",
}
NEGATION = re.compile(r"\b(?:no|without|negative for|normal|clear|resolved)\b", re.I)


def sentence_findings(text: str) -> frozenset[str]:
    """CheXpert names a sentence asserts (empty for a negated or normal statement)."""
    if NEGATION.search(text):
        return frozenset()
    return frozenset(name for name, words in FINDING_WORDS.items() if re.search(words, text, re.I))


def grounding(bank: list[str], samples: list[tuple[set[str], list[list[int]]]]) -> dict:
    """``samples``: (positive finding names, per view the bank rows retrieved) -> the retrieved hit rate
    among finding-asserting sentences, the random-bank base rate over the same (sample, view, slot)s, and
    how often retrieved and bank sentences assert any finding at all."""
    asserts = [sentence_findings(s) for s in bank]
    asserting = [a for a in asserts if a]
    hits = slots = nothing = 0
    base = 0.0
    for positives, views in samples:
        base_rate = sum(bool(a & positives) for a in asserting) / len(asserting) if asserting else 0.0
        for rows in views:
            for row in rows:
                if not asserts[row]:
                    nothing += 1
                    continue
                slots += 1
                hits += bool(asserts[row] & positives)
                base += base_rate
    total = slots + nothing
    return {"retrieved_sentences": total, "asserting_a_finding": slots,
            "hit_rate": hits / slots if slots else None, "bank_base_rate": base / slots if slots else None,
            "retrieved_asserting_fraction": slots / total if total else None,
            "bank_asserting_fraction": len(asserting) / len(bank) if bank else None}


def shard_grounding(shards_dir: Path, split: str | None = None, labels: dict | None = None) -> dict:
    """:func:`grounding` of a captioner build with a bank (labels from each sample's json; ``labels``:
    record id -> its labels instead, e.g. the true findings of records whose labels a build hid)."""
    info = read_dataset_info(shards_dir)
    if not (info.get("captioner") or {}).get("bank"):
        raise ValueError(f"{shards_dir}: not a build with a retrieval captioner (dataset.json captioner.bank)")
    bank, _, _ = read_bank(shards_dir)
    samples = []
    for shard in info["shards"]:
        if split is not None and shard["split"] != split:
            continue
        for _, raw in iter_tar_samples(Path(shards_dir) / shard["name"]):
            meta = load_meta(raw["json"])
            known = meta["labels"] if labels is None else labels.get(meta["id"], {})
            positives = {name for name, value in known.items() if value == 1}
            ids = meta["caption_bank_ids"]
            samples.append((positives, [[ids[i] for i in view] for view in meta["caption_views"]]))
    return {"split": split or "all", "samples": len(samples), **grounding(bank, samples)}
