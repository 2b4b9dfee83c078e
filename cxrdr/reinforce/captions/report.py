"""Report-sentence sampling: captions made of random subsets of a report's sentences.

Candidates, in use order: the impression, the findings, single sentences, and random subsets of
2..4 sentences kept in report order (findings and impression sentences pooled). Sentences of
fewer than two words or with no letters (list markers, "XXXX.") are not used alone.
The splitter ends a sentence at '.', '!' or '?' followed by whitespace, except after common
abbreviations (e.g., i.e., approx., Dr., vs., etc. before a lower-case word, No. 2), single
initials and list numbers; decimals ("2.5 cm") never split because no space follows the dot.
"""
from __future__ import annotations

import random
import re

TITLES = {"dr.", "mr.", "mrs.", "ms.", "st.", "prof."}  # never end a sentence
ABBREVIATIONS = {"e.g.", "i.e.", "approx.", "vs.", "etc.", "fig.", "no.", "cf.", "a.m.", "p.m.", "pt.",
                 "hx.", "incl.", "ref.", "resp.", "ant.", "post.", "lat.", "mm.", "cm.", "sq."}
_END = re.compile(r"[.!?]+[\"')\]]*(?=\s|$)")
_MARKER = re.compile(r"(?:\d{1,2}|[a-zA-Z])[.)]")
_LIST_MARKER = re.compile(r"^\s*(?:\d{1,2}|[a-z])[.)]\s+", re.I)
MAX_SUBSETS = 24


def split_sentences(text: str) -> list[str]:
    """Sentences of a report, aware of abbreviations, titles, list numbers and decimals.

    A dot ends a sentence only when whitespace (or the end) follows, so decimals never split.
    After a title it never ends one; after another abbreviation only when an upper-case word
    follows ("approx. 2 cm" stays whole, "etc. No effusion." splits). A lone "1." / "a)" is a
    list marker: it starts the next sentence and is dropped.
    """
    text = re.sub(r"\s+", " ", text or "").strip()
    sentences, start = [], 0
    for match in _END.finditer(text):
        end = match.end()
        segment = text[start:end].strip()
        token = segment.split(" ")[-1].lower()
        following = text[end:].lstrip()[:1]
        if token in TITLES:
            continue
        if token in ABBREVIATIONS and not following.isupper():
            continue
        if _MARKER.fullmatch(segment) or _MARKER.fullmatch(_LIST_MARKER.sub("", segment + " ").strip()):
            continue  # "1." alone: a list marker, part of the next sentence
        sentence = _LIST_MARKER.sub("", segment).strip()
        if sentence:
            sentences.append(sentence)
        start = end
    tail = _LIST_MARKER.sub("", text[start:]).strip()
    if tail:
        sentences.append(tail if tail[-1] in ".!?" else tail + ".")
    return sentences


def usable_sentence(sentence: str) -> bool:
    """At least two words and a letter that is not part of an anonymisation token ('XXXX')."""
    return _usable(sentence)


def _usable(sentence: str) -> bool:
    letters = re.sub(r"X{2,}", "", sentence)
    return len(sentence.split()) >= 2 and bool(re.search(r"[A-Za-z]", letters))


def report_captions(findings: str, impression: str, report: str, rng: random.Random) -> list[str]:
    """Distinct report-derived captions in the order to use them."""
    findings, impression = (findings or "").strip(), (impression or "").strip()
    if not findings and not impression:
        findings = (report or "").strip()
    sentences = [s for s in split_sentences(findings) + split_sentences(impression) if _usable(s)]
    wholes = [" ".join(s for s in split_sentences(part) if re.search(r"[A-Za-z]", s))
              for part in (impression, findings)]
    singles = list(sentences)
    rng.shuffle(singles)
    subsets = []
    if len(sentences) >= 3:
        for _ in range(MAX_SUBSETS):
            k = rng.randint(2, min(4, len(sentences) - 1))
            idx = sorted(rng.sample(range(len(sentences)), k))
            subsets.append(" ".join(sentences[i] for i in idx))
    # Interleave: a whole section, then alternately a subset and a single sentence.
    ordered = wholes[:1]
    rest_wholes = wholes[1:]
    for i in range(max(len(subsets), len(singles))):
        if i < len(subsets):
            ordered.append(subsets[i])
        if i < len(singles):
            ordered.append(singles[i])
        if i == 1:
            ordered += rest_wholes
    if len(subsets) + len(singles) < 2:
        ordered += rest_wholes
    return [t for t in dict.fromkeys(ordered) if t]
