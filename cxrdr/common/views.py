"""View positions: which views are frontal, and the one-frontal-image-per-study rule.

One definition for both stages: stage 1 filters sources with ``frontal_only``, stage 2 picks the
retrieval rows of ``train eval`` and of the in-training validation with :func:`one_per_study`.
The set is the union of what the stages used to count: the projections (PA, AP, AP/PA axial),
the positions a source spells out (AP supine, AP/PA erect, antero-posterior, ...), and the
decubitus frontal films (PA LLD, AP LLD: MIMIC-CXR ``ViewPosition`` values; a decubitus film
is still a frontal projection). Spellings are normalised (case, '_' and repeated spaces), so
'AP_SUPINE' and 'ap supine' are one view.
"""
from __future__ import annotations

FRONTAL_VIEWS = frozenset({
    "pa", "ap", "frontal", "ap axial", "pa axial", "ap supine", "ap erect", "pa erect",
    "antero-posterior", "postero-anterior", "pa lld", "ap lld",
})


def normalise_view(view) -> str:
    """'AP_Supine ' -> 'ap supine' (lowercase, '_' as space, single spaces)."""
    return " ".join(str(view).replace("_", " ").lower().split())


def is_frontal(view) -> bool:
    """True for a frontal view; False for a lateral, another view, or no view."""
    return view is not None and normalise_view(view) in FRONTAL_VIEWS


def one_per_study(keys: list, study_ids: list, views: list) -> list[int]:
    """Row indices (ascending) of one image per study: its first frontal image in key order, else
    its first image in key order. An unknown view counts as frontal (sources without a view
    column hold frontal images); a row without a study id is its own study (its key).

    Key order, not row order, so a loader's worker interleaving cannot change the choice.
    """
    chosen: dict = {}
    for i in sorted(range(len(keys)), key=lambda i: keys[i]):
        study = str(study_ids[i] or keys[i])
        frontal = views[i] is None or is_frontal(views[i])
        if study not in chosen or (frontal and not chosen[study][1]):
            chosen[study] = (i, frontal)
    return sorted(i for i, _ in chosen.values())
