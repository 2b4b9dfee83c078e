"""A report composed from labels, for rows that have labels but no report text (NIH ChestX-ray14).

The text is templated, not a radiologist's: sources mark such records ``text_source: labels`` (sample
meta ``extra`` and the dataset card). Positives become label-derived triples (finding words, no
location: labels carry none) that the RDF caption templates render; stated negatives follow in one
NegEx-style sentence ("No pneumothorax or mass."), which the students' local loss reads as negated.
"""
from __future__ import annotations

from cxrdr.reinforce.captions.rdf import NORMAL_CAPTIONS, frame, join_units, words

PRESENT = ("HAS_STATUS", "present")  # predicate/object of a label-derived triple (ignored by the templates)
TEXT_SOURCE_LABELS = "labels"
TEXT_SOURCE_REPORT = "report"
# a record without report text in a build with a captioner: its text is retrieved (cxrdr.reinforce.captioners)
TEXT_SOURCE_RETRIEVED = "retrieved"


def label_triples(findings: list[str]) -> list[tuple[str, str, str]]:
    """Finding words -> triples the caption templates group by finding ('pleural effusion' -> snake case)."""
    return [("_".join(f.lower().split()), *PRESENT) for f in findings]


def compose_report(positives: list[str], negatives: list[str] = (), normal: bool = False) -> str:
    """'Findings of cardiomegaly and pleural effusion. No pneumothorax or mass.'; a study labelled normal (no
    positives) opens with a normal study's first caption; otherwise only what the labels state is said."""
    parts = []
    if positives:
        parts.append(frame(join_units([words(p) for p in positives]), "Findings of {x}."))
    elif normal:
        parts.append(NORMAL_CAPTIONS[0])
    negatives = [words(n) for n in negatives if n not in positives]
    if negatives:
        tail = negatives[-1] if len(negatives) == 1 else ", ".join(negatives[:-1]) + " or " + negatives[-1]
        parts.append(f"No {tail}.")
    return " ".join(parts)


def report_from_labels(labels: dict) -> tuple[str, list[tuple[str, str, str]]] | None:
    """(composed report, label triples) from name -> 1/0/-1/None labels, or None when no label is 1 or 0.
    Uncertain (-1) labels are left out: a composed text states only what the labels assert."""
    positives = [words(n).lower() for n, v in labels.items() if v == 1 and n != "No Finding"]
    negatives = [words(n).lower() for n, v in labels.items() if v == 0 and n != "No Finding"]
    if not positives and labels.get("No Finding") != 1 and not negatives:
        return None
    return compose_report(positives, negatives, labels.get("No Finding") == 1), label_triples(positives)
