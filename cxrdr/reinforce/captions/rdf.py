"""RDF triples -> caption texts, by templates over the attributes each finding has.

Triples ``(finding, predicate, object)`` are grouped by finding (order of first appearance;
a finding named only as an ``ASSOCIATED_WITH`` object is a finding too). Predicates used:
HAS_LOCATION, HAS_SEVERITY, IS_A, ASSOCIATED_WITH, HAS_ATTRIBUTE; others are ignored.
Every caption says only what the triples say: each severity, side and location word is placed
next to the finding that owns it, and no finding is named that is not in the triples.

Template grammar
----------------
::

    caption     := FRAME(body)
                 | FRAME(unit) " " FRAME(unit) ...   (study captions with an association: one
                                                      sentence per unit, so "A with associated B
                                                      and C" never reads as C associated too)
    FRAME(x)    := "{X}." | "There is {x}." | "Chest radiograph shows {x}." | "Findings of {x}."
                 | "Evidence of {x}." | "Chest X-ray with {x}."
                   ("There are" before "multiple ..."; "category: np" units only as "{X}.")
    body        := unit | unit ", " unit ... " and " unit            (multi-finding combination)
    unit        := np | np " with associated " np | np " associated with " np   (ASSOCIATED_WITH)
                 | np ", a " category | category ": " np               (IS_A; skipped when the
                                                   category repeats the finding's words)
    np          := [multiple] [severity] [attribute ...] finding [loc_phrase]
                 | [multiple] [severity] side "-sided" finding     (one side across all locations)
                 | [multiple] [severity] "bilateral" finding
                   (finding; finding + location; severity + finding + location; "multiple"
                    pluralises: "multiple small osteophytes")
    severity    := HAS_SEVERITY objects joined by " to " ("small to moderate")
    attribute   := HAS_ATTRIBUTE objects (patchy, multiple, chronic, ...)
    loc_phrase  := "in the " anatomy | "at the " anatomy (base/apex/angle) | "on the " side
                 | "in both " plural(anatomy without 'bilateral')
                   (several locations joined by " and ")

Names are snake_case in triples and words in text (``left_lung_base`` -> "left lung base").
Three kinds of caption make the pool: *study* captions (every finding with all its attributes),
*single-finding* captions (each finding with each subset of its attributes: finding; finding +
location; severity + finding; severity + finding + location; category forms), and *combination*
captions (pairs and associated findings with varied attribute subsets). Records without findings
get *normal-study* captions (``NORMAL_CAPTIONS``) when they are known normal (see
``captions.is_normal``).
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field


FRAMES = ("{X}.", "There is {x}.", "Chest radiograph shows {x}.", "Findings of {x}.", "Evidence of {x}.",
          "Chest X-ray with {x}.")
NORMAL_CAPTIONS = (
    "No acute cardiopulmonary abnormality.",
    "Normal chest radiograph.",
    "The lungs are clear. No pleural effusion or pneumothorax.",
    "Heart size is normal and the lungs are clear.",
    "No active disease in the chest.",
    "Unremarkable chest X-ray.",
    "Clear lungs without focal consolidation, effusion or pneumothorax.",
    "Normal cardiomediastinal silhouette. The lungs are clear.",
)
SIDES = ("left", "right", "bilateral")
_PLURAL = {"apex": "apices", "base": "bases", "hilum": "hila", "hemithorax": "hemithoraces", "lobe": "lobes",
           "zone": "zones", "perihilar": "perihilar regions", "lung": "lungs", "angle": "angles",
           "hemidiaphragm": "hemidiaphragms", "region": "regions", "field": "fields"}
_AT_WORDS = ("base", "apex", "angle", "bases", "apices")
_SPECIAL_WORDS = {"copd": "COPD", "picc": "PICC", "ng": "NG", "et": "ET"}
MAX_PER_KIND = 60  # cap on generated candidates per kind, to bound the cost on many-finding studies


@dataclass
class FindingGroup:
    """Everything the triples say about one finding."""

    name: str
    locations: list[str] = field(default_factory=list)
    severities: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    associations: list[str] = field(default_factory=list)
    attributes: list[str] = field(default_factory=list)


def words(name: str) -> str:
    """snake_case -> words, keeping acronyms: 'left_lung_base' -> 'left lung base'."""
    return " ".join(_SPECIAL_WORDS.get(w, w) for w in str(name).replace("_", " ").split())


def group_triples(triples) -> list[FindingGroup]:
    groups: dict[str, FindingGroup] = {}

    def get(name: str) -> FindingGroup:
        return groups.setdefault(name, FindingGroup(name))

    slot = {"HAS_LOCATION": "locations", "HAS_SEVERITY": "severities", "IS_A": "categories",
            "ASSOCIATED_WITH": "associations", "HAS_ATTRIBUTE": "attributes"}
    for triple in triples:
        s, p, o = (str(x) for x in triple)
        group = get(s)
        attr = slot.get(p.upper())
        if attr is None:
            continue
        values = getattr(group, attr)
        if o not in values:
            values.append(o)
        if attr == "associations":
            get(o)
    return list(groups.values())


def _plural(phrase: str) -> str:
    parts = phrase.split()
    if not parts:
        return phrase
    last = parts[-1]
    parts[-1] = _PLURAL.get(last, last if last.endswith("s") else last + "s")
    return " ".join(parts)


def location_phrase(location: str) -> str:
    """'right_hemithorax' -> 'in the right hemithorax'; 'bilateral_lung_base' -> 'in both lung bases'."""
    text = words(location)
    if text in ("left", "right"):
        return f"on the {text}"
    if text == "bilateral":
        return "on both sides"
    if text.startswith("bilateral "):
        return f"in both {_plural(text[len('bilateral '):])}"
    prep = "at the" if text.split()[-1] in _AT_WORDS else "in the"
    return f"{prep} {text}"


def _locations_phrase(locations: list[str]) -> str:
    return " and ".join(location_phrase(loc) for loc in locations)


def _severity(group: FindingGroup) -> str:
    return " to ".join(words(s) for s in group.severities[:2])


def _side(location: str) -> str | None:
    first = location.split("_", 1)[0]
    return first if first in SIDES else None


def noun_phrases(group: FindingGroup) -> list[str]:
    """All noun phrases for one finding, from bare to full (templates of the module docstring)."""
    name, attrs, sev = _name_parts(group)
    loc = _locations_phrase(group.locations) if group.locations else ""
    sides = {_side(l) for l in group.locations}
    side = sides.pop() if len(sides) == 1 else None
    cores = [name]
    if attrs:
        cores.append(f"{attrs} {name}")
    out = []
    multiple = "multiple " if "multiple" in group.attributes else ""
    for core in cores:
        for with_sev in ([False, True] if sev else [False]):
            head = f"{multiple}{sev} {core}" if with_sev else f"{multiple}{core}"
            out.append(head)
            if loc:
                out.append(f"{head} {loc}")
            if side == "bilateral":
                out.append(f"{multiple}{sev + ' ' if with_sev else ''}bilateral {core}")
            elif side:
                out.append(f"{multiple}{sev + ' ' if with_sev else ''}{side}-sided {core}")
    return list(dict.fromkeys(out))


def _name_parts(group: FindingGroup) -> tuple[str, str, str]:
    """(finding words, attribute words, severity words); 'multiple' pluralises the finding."""
    name = words(group.name)
    if "multiple" in group.attributes:
        name = _plural(name)
    attrs = " ".join(words(a) for a in group.attributes if a != "multiple")
    return name, attrs, _severity(group)


def full_phrase(group: FindingGroup) -> str:
    """The noun phrase with every attribute of the finding."""
    name, attrs, sev = _name_parts(group)
    multiple = "multiple" if "multiple" in group.attributes else ""
    phrase = " ".join(p for p in (multiple, sev, attrs, name) if p)
    if group.locations:
        phrase += " " + _locations_phrase(group.locations)
    return phrase


def frame(body: str, template: str) -> str:
    if template.startswith("There is") and body.startswith("multiple "):
        template = template.replace("There is", "There are", 1)
    if ": " in body.split(",")[0]:  # "category: finding" stands alone
        template = "{X}."
    if "{X}" in template:
        return template.replace("{X}", body[:1].upper() + body[1:])
    text = template.replace("{x}", body)
    return text[:1].upper() + text[1:]


def join_units(units: list[str]) -> str:
    if len(units) <= 1:
        return "".join(units)
    return ", ".join(units[:-1]) + " and " + units[-1]


def _category_units(group: FindingGroup, np: str) -> list[str]:
    out = []
    for cat in group.categories:
        c = words(cat)
        if set(c.split()) <= set(words(group.name).split()):
            continue  # "device: support device" says nothing new
        article = "an" if c[:1] in "aeiou" else "a"
        out += [f"{np}, {article} {c}", f"{c}: {np}"]
    return out


def rdf_caption_kinds(triples, rng: random.Random) -> dict[str, list[str]]:
    """Candidate captions by kind ('study', 'single', 'combination'), each deduplicated and shuffled."""
    groups = group_triples(triples)
    if not groups:
        return {}
    by_name = {g.name: g for g in groups}
    phrases = {g.name: noun_phrases(g) for g in groups}
    full = {g.name: full_phrase(g) for g in groups}

    # Study captions: every finding, all attributes; associated findings folded into one unit.
    units, used = [], set()
    for g in groups:
        if g.name in used:
            continue
        used.add(g.name)
        partners = [a for a in g.associations if a not in used]
        used.update(partners)
        unit = full[g.name]
        if partners:
            unit += " with associated " + join_units([full[a] for a in partners])
        units.append(unit)
    study = []
    orders = [units] + [rng.sample(units, len(units)) for _ in range(2)] if len(units) > 1 else [units]
    # "A with associated B and C" would read as C associated too: such studies get one sentence per unit.
    per_sentence = len(units) > 1 and any(" with associated " in u for u in units)
    for order in orders:
        for template in FRAMES:
            if per_sentence:
                study.append(" ".join(frame(u, template if i == 0 else rng.choice(FRAMES[:2]))
                                      for i, u in enumerate(order)))
            else:
                study.append(frame(join_units(order), template))

    # Single-finding captions: each finding with each attribute subset, plus category forms.
    single = []
    for g in groups:
        for np in phrases[g.name]:
            single.append(frame(np, rng.choice(FRAMES)))
        for unit in _category_units(g, full[g.name]) + _category_units(g, words(g.name)):
            single.append(frame(unit, rng.choice(FRAMES[:2])))

    # Combinations: associations in both phrasings, and pairs (or a sample of them) of findings.
    combos = []
    for g in groups:
        for other in g.associations:
            if other not in by_name:
                continue
            for a, b in [(full[g.name], full[other]), (rng.choice(phrases[g.name]), rng.choice(phrases[other]))]:
                combos.append(frame(f"{a} with associated {b}", rng.choice(FRAMES)))
                combos.append(frame(f"{a} associated with {b}", rng.choice(FRAMES)))
    pairs = list(itertools.combinations([g.name for g in groups], 2))
    rng.shuffle(pairs)
    for a, b in pairs[:MAX_PER_KIND]:
        combos.append(frame(join_units([rng.choice(phrases[a]), rng.choice(phrases[b])]), rng.choice(FRAMES)))
    if len(groups) > 2:
        for _ in range(6):
            subset = rng.sample(groups, rng.randint(2, len(groups)))
            combos.append(frame(join_units([rng.choice(phrases[g.name]) for g in subset]), rng.choice(FRAMES)))

    kinds = {"study": study, "single": single, "combination": combos}
    for key, values in kinds.items():
        values = list(dict.fromkeys(values))
        rng.shuffle(values)
        kinds[key] = values[:MAX_PER_KIND]
    return kinds


def rdf_captions(triples, rng: random.Random) -> list[str]:
    """Distinct RDF captions in the order to use them: kinds interleaved (study first)."""
    kinds = rdf_caption_kinds(triples, rng)
    order = [kinds.get(k, []) for k in ("study", "combination", "single")]
    out, seen = [], set()
    for row in itertools.zip_longest(*order):
        for text in row:
            if text is not None and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def normal_captions(rng: random.Random) -> list[str]:
    texts = list(NORMAL_CAPTIONS)
    rng.shuffle(texts)
    return texts


def finding_names(triples) -> list[str]:
    """Finding names a record's triples assert (snake_case)."""
    return [g.name for g in group_triples(triples)]
