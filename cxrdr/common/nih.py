"""NIH ChestX-ray14 label vocabulary: its 14 labels, the 8 box findings (BBox_List_2017) and the words
both stages use for them (the composed reports of stage 1, the prompts and grounded words of the benchmark).

The box list spells one finding ``Infiltrate`` and the label list ``Infiltration``: ``canonical_finding``
makes them one. Each label maps to its CheXpert-14 name where one exists (the label vector of the shards):
``Infiltration`` to ``Lung Opacity`` (CheXpert has no infiltrate), ``Mass`` and ``Nodule`` to ``Lung Lesion``.
"""
from __future__ import annotations

# the 8 findings that have boxes, in the order of Wang et al. 2017's tables
BOX_FINDINGS: tuple[str, ...] = ("Atelectasis", "Cardiomegaly", "Effusion", "Infiltrate", "Mass", "Nodule",
                                 "Pneumonia", "Pneumothorax")
# every NIH label -> (report words, CheXpert-14 name or None)
LABELS: dict[str, tuple[str, str | None]] = {
    "Atelectasis": ("atelectasis", "Atelectasis"),
    "Cardiomegaly": ("cardiomegaly", "Cardiomegaly"),
    "Effusion": ("pleural effusion", "Pleural Effusion"),
    "Infiltrate": ("infiltrate", "Lung Opacity"),
    "Mass": ("mass", "Lung Lesion"),
    "Nodule": ("nodule", "Lung Lesion"),
    "Pneumonia": ("pneumonia", "Pneumonia"),
    "Pneumothorax": ("pneumothorax", "Pneumothorax"),
    "Consolidation": ("consolidation", "Consolidation"),
    "Edema": ("edema", "Edema"),
    "Emphysema": ("emphysema", None),
    "Fibrosis": ("fibrosis", None),
    "Pleural_Thickening": ("pleural thickening", "Pleural Other"),
    "Hernia": ("hiatal hernia", None),
}
ALIASES = {"infiltration": "Infiltrate", "pleural effusion": "Effusion", "pleural thickening": "Pleural_Thickening",
           "no finding": "No Finding"}


def canonical_finding(name: str) -> str:
    """'Infiltration' / 'infiltrate' -> 'Infiltrate'; 'pleural_effusion' -> 'Effusion'; unknown names as given."""
    key = str(name).strip().replace("_", " ").lower()
    if key in ALIASES:
        return ALIASES[key]
    return next((n for n in LABELS if n.replace("_", " ").lower() == key), str(name).strip())


def finding_words(name: str) -> str:
    """The words a report uses for a finding ('Effusion' -> 'pleural effusion')."""
    canon = canonical_finding(name)
    return LABELS[canon][0] if canon in LABELS else canon.replace("_", " ").lower()


def chexpert_labels(nih_labels) -> dict[str, int | None]:
    """NIH label list (exhaustive: a label not listed is absent) -> CheXpert-14 values (1/0, None where NIH
    does not annotate the CheXpert label: Enlarged Cardiomediastinum, Fracture, Support Devices)."""
    present = {canonical_finding(n) for n in nih_labels}
    out: dict[str, int | None] = {}
    for name, (_, chexpert) in LABELS.items():
        if chexpert is not None:
            out[chexpert] = max(out.get(chexpert) or 0, int(name in present))
    out["No Finding"] = int(not (present & set(LABELS)))
    return out
