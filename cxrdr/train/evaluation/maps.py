"""Heatmaps of one student forward on the patch grid: the mask (z) and text-to-patch attention."""
from __future__ import annotations

import numpy as np

from cxrdr.train.evaluation import localisation as loc


def grid_of(out) -> tuple[int, int]:
    gh, gw = out.grid_size
    return int(gh), int(gw)


def _patch_index(out, b: int, n: int):
    """Grid indices of the patches the heads' maps (mask, attention) refer to."""
    index = getattr(out, "head_index", None)
    index = getattr(out, "patch_index", None) if index is None else index
    return np.arange(n) if index is None else index[b].cpu().numpy()


def mask_heat(out, b: int) -> np.ndarray | None:
    """z ranking map on the full grid (soft scores z is made from; dropped patches NaN)."""
    scores = getattr(out, "mask_scores", None)
    scores = scores if scores is not None else getattr(out, "mask", None)
    if scores is None:
        return None
    values = scores[b].float().cpu().numpy()
    return loc.scatter_to_grid(values, _patch_index(out, b, len(values)), grid_of(out))


def mask_z(out, b: int) -> np.ndarray | None:
    z = getattr(out, "mask", None)
    if z is None:
        return None
    values = z[b].float().cpu().numpy()
    return loc.scatter_to_grid(values, _patch_index(out, b, len(values)), grid_of(out), fill=0.0)


def attn_heat(out, b: int, positions: list[int]) -> np.ndarray | None:
    attn = getattr(out, "local_attn", None)
    if attn is None:
        return None
    heat = loc.attention_heatmap(attn[b].float().cpu().numpy(), positions)
    if heat is None:
        return None
    return loc.scatter_to_grid(heat, _patch_index(out, b, len(heat)), grid_of(out))


class PhraseTokens:
    """Token ids of a phrase without the tokenizer's special tokens (cached)."""

    def __init__(self, student):
        self.student = student
        empty = student.tokenize([""])
        ids, mask = empty["input_ids"][0], empty["attention_mask"][0].bool()
        self.special = set(ids[mask].tolist())
        self.cache: dict[str, list[int]] = {}

    def __call__(self, phrase: str) -> list[int]:
        if phrase not in self.cache:
            tok = self.student.tokenize([phrase])
            ids = tok["input_ids"][0][tok["attention_mask"][0].bool()].tolist()
            self.cache[phrase] = [i for i in ids if i not in self.special]
        return self.cache[phrase]
