"""A captioner's per-view captions -> the sample's stored json fields, its texts to embed and its row.

``captions`` holds the distinct captions of all K views in first-seen order (view 0's best first), so
every teacher's ``syn`` rows embed each text once; ``caption_views[k]`` lists view k's S captions as
indexes into it, best first, ``caption_scores[k]`` their scores and ``caption_bank_ids`` each caption's
bank row (-1: not from a bank).
"""
from __future__ import annotations

from cxrdr.common.shards import with_caption_provenance


def attach_view_captions(prepared: dict, per_view: list[list[tuple[str, float, int]]], caption_source: str,
                         report: str | None = None) -> None:
    """Update a prepared sample (``prepare_record``'s dict) in place with the captions of its views;
    ``report``: the text of a record that had none (its ``txt`` member and embedding row)."""
    index: dict[str, int] = {}
    captions, bank_ids, views, scores = [], [], [], []
    for view in per_view:
        ids = []
        for text, _, bank_id in view:
            if text not in index:
                index[text] = len(captions)
                captions.append({"text": text, "source": caption_source})
                bank_ids.append(int(bank_id))
            ids.append(index[text])
        views.append(ids)
        scores.append([round(float(score), 6) for _, score, _ in view])
    if report is not None:
        prepared["report"] = report
    prepared["meta"] = with_caption_provenance(prepared["meta"], captions, {
        "caption_source": caption_source, "caption_views": views, "caption_scores": scores,
        "caption_bank_ids": bank_ids})
    prepared["texts"] = [prepared["report"]] + [c["text"] for c in captions]
    prepared["row"]["n_captions"] = len(captions)
