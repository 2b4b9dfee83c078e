"""Zero-shot prompts of the benchmark's findings, in the words the composed reports use (``cxrdr.common.nih``)."""
from __future__ import annotations

from cxrdr.common.nih import BOX_FINDINGS, finding_words

POSITIVE = ("{w}.", "there is {w}.", "findings of {w}.")
NEGATIVE = ("no {w}.",)


def finding_prompts(findings=BOX_FINDINGS) -> dict:
    """finding -> {"positive": [...], "negative": [...]} (``zeroshot.encode_prompts``' ``labels`` layout)."""
    return {f: {"positive": [p.format(w=finding_words(f)) for p in POSITIVE],
                "negative": [p.format(w=finding_words(f)) for p in NEGATIVE]} for f in findings}


def grounding_text(finding: str) -> str:
    """The text whose finding words' attention is the finding's heatmap (the first positive prompt)."""
    return POSITIVE[2].format(w=finding_words(finding))
