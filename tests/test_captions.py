"""Captions: the worked RDF example, caption-count/dedup/determinism rules, sentence splitting, CLI."""
from __future__ import annotations

import json
import re

import pytest
import typer
from typer.testing import CliRunner

from cxrdr.reinforce.captions import caption_pool, is_normal, make_captions
from cxrdr.reinforce.captions.rdf import NORMAL_CAPTIONS, group_triples, rdf_captions
from cxrdr.reinforce.captions.report import report_captions, split_sentences
from cxrdr.reinforce.records import Record

WORKED = [
    ("pleural_effusion", "HAS_LOCATION", "right_hemithorax"),
    ("pleural_effusion", "HAS_SEVERITY", "moderate"),
    ("cardiomegaly", "IS_A", "cardiac_abnormality"),
    ("atelectasis", "HAS_LOCATION", "left_lung_base"),
    ("atelectasis", "HAS_SEVERITY", "minimal"),
    ("pleural_effusion", "ASSOCIATED_WITH", "atelectasis"),
]
# Finding names a caption could wrongly assert (contract vocabulary + common CXR findings).
FINDING_WORDS = ("pleural effusion", "cardiomegaly", "atelectasis", "pneumothorax", "consolidation", "edema",
                 "nodule", "mass", "lung opacity", "support device", "pneumonia", "fracture", "effusion",
                 "emphysema", "opacity")
SIDE_WORDS = ("left", "right", "bilateral", "both")
SEVERITY_WORDS = ("minimal", "mild", "moderate", "severe", "small", "large", "borderline", "trace")


def _record(triples=(), report="", findings="", impression="", labels=None, rid="r1") -> Record:
    return Record(id=rid, subject_id="s", study_id="st", split="train", report=report, findings=findings,
                  impression=impression, labels=labels or {}, triples=list(triples))


def _owner_after(text: str, pos: int, owners: dict[str, str]) -> str | None:
    """The first licensed finding named after position ``pos``."""
    best = None
    for name in owners:
        m = text.find(name, pos)
        if m >= 0 and (best is None or m < best[0]):
            best = (m, name)
    return best[1] if best else None


def _owner_before(text: str, pos: int, owners: dict[str, str]) -> str | None:
    best = None
    for name in owners:
        m = text.rfind(name, 0, pos)
        if m >= 0 and (best is None or m > best[0]):
            best = (m, name)
    return best[1] if best else None


def test_worked_example_mentions_every_finding_with_its_attributes():
    rec = _record(WORKED)
    pool = [c.text for c in caption_pool(rec, sources=("rdf",))]
    texts = [t.lower() for t in pool]
    captions = make_captions(rec, n=5, seed=0, sources=("rdf",))
    assert len(captions) == 5 and len({c.text for c in captions}) == 5
    first = captions[0].text.lower()
    # The first (study) caption carries every finding with all of its attributes.
    for phrase in ("moderate pleural effusion in the right hemithorax", "minimal atelectasis at the left lung base",
                   "cardiomegaly", "with associated"):
        assert phrase in first, first
    # The pool covers each attribute template and combinations.
    for phrase in ("pleural effusion in the right hemithorax", "moderate pleural effusion",
                   "atelectasis at the left lung base", "minimal atelectasis", "cardiomegaly, a cardiac abnormality",
                   "cardiac abnormality: cardiomegaly", "associated with minimal atelectasis"):
        assert any(phrase in t for t in texts), phrase
    assert any(t.count("cardiomegaly") and "pleural effusion" in t and "atelectasis" in t for t in texts)
    assert any(sum(f in t for f in ("cardiomegaly", "pleural effusion", "atelectasis")) == 2 for t in texts)
    assert any(t.strip(".") in ("cardiomegaly", "evidence of cardiomegaly", "there is cardiomegaly",
                                "findings of cardiomegaly", "chest radiograph shows cardiomegaly",
                                "chest x-ray with cardiomegaly") for t in texts)


def test_worked_example_asserts_nothing_beyond_the_triples():
    rec = _record(WORKED)
    owners = {"pleural effusion": "pleural_effusion", "cardiomegaly": "cardiomegaly", "atelectasis": "atelectasis"}
    side_of = {"pleural effusion": {"right"}, "atelectasis": {"left"}, "cardiomegaly": set()}
    severity_of = {"pleural effusion": {"moderate"}, "atelectasis": {"minimal"}, "cardiomegaly": set()}
    for seed in range(3):
        for cap in caption_pool(rec, seed=seed, sources=("rdf",)):
            text = cap.text.lower()
            stripped = text
            for name in owners:
                stripped = stripped.replace(name, "")
            for word in FINDING_WORDS:
                assert word not in stripped, (word, cap.text)  # no unlicensed finding
            for m in re.finditer(r"\b(" + "|".join(SEVERITY_WORDS) + r")\b", text):
                owner = _owner_after(text, m.end(), owners)
                assert owner and m.group(1) in severity_of[owner], (m.group(1), cap.text)
            for m in re.finditer(r"\b(" + "|".join(SIDE_WORDS) + r")\b", text):
                if text[m.end():].startswith("-sided"):
                    owner = _owner_after(text, m.end(), owners)  # "right-sided pleural effusion"
                else:
                    owner = _owner_before(text, m.start(), owners)  # "... in the right hemithorax"
                assert owner and m.group(1) in side_of[owner], (m.group(1), cap.text)


def test_count_dedup_determinism_and_cycling():
    rec = _record(WORKED, report="Moderate right effusion. Minimal left basal atelectasis. Cardiomegaly.",
                  findings="Moderate right effusion. Minimal left basal atelectasis.", impression="Cardiomegaly.")
    caps = make_captions(rec, n=8, seed=1)
    assert len(caps) == 8 and len({c.text for c in caps}) == 8
    assert {c.source for c in caps} == {"rdf", "report"}
    assert caps == make_captions(rec, n=8, seed=1)
    assert [c.text for c in caps] != [c.text for c in make_captions(rec, n=8, seed=2)]
    other = Record(**{**rec.__dict__, "id": "r2"})
    assert [c.text for c in make_captions(other, n=8, seed=1)] != [c.text for c in caps]
    # A tiny pool cycles: exactly n captions, as many distinct as the pool has.
    tiny = _record([("cardiomegaly", "IS_A", "x")])
    pool = caption_pool(tiny, sources=("rdf",))
    many = make_captions(tiny, n=len(pool) + 5, sources=("rdf",))
    assert len(many) == len(pool) + 5 and len({c.text for c in many}) == len(pool)
    assert [c.text for c in many[len(pool):]] == [c.text for c in pool[:5]]
    with pytest.raises(ValueError, match="unknown caption source"):
        make_captions(tiny, sources=("coca",))
    assert caps[0].to_json() == {"text": caps[0].text, "source": caps[0].source}


def test_normal_and_non_normal_records_without_triples():
    normal = _record(labels={"No Finding": 1}, report="Heart size normal. Lungs are clear. No effusion.",
                     impression="Heart size normal. Lungs are clear. No effusion.")
    assert is_normal(normal)
    caps = make_captions(normal, n=6)
    assert {c.source for c in caps} == {"normal", "report"}
    assert all(c.text in NORMAL_CAPTIONS for c in caps if c.source == "normal")
    covid = _record(labels={"COVID-19": 1}, findings="Bilateral ground glass opacities in a febrile patient.",
                    report="Bilateral ground glass opacities in a febrile patient.")
    assert not is_normal(covid)
    caps = make_captions(covid, n=3)
    assert len(caps) == 3 and {c.source for c in caps} == {"report"}
    unknown = _record(report="")
    assert [c.text for c in make_captions(unknown, n=2)] == ["Chest radiograph.", "Chest radiograph."]


def test_sentence_splitter():
    text = ("1. Cardiomegaly with a 2.5 cm nodule, e.g. in the RUL. 2. No effusion, approx. 3 mm. "
            "Dr. Smith was called. Stable etc. No pneumothorax")
    assert split_sentences(text) == ["Cardiomegaly with a 2.5 cm nodule, e.g. in the RUL.",
                                     "No effusion, approx. 3 mm.", "Dr. Smith was called.", "Stable etc.",
                                     "No pneumothorax."]
    assert split_sentences("Lungs clear! Effusion? No.") == ["Lungs clear!", "Effusion?", "No."]
    rng = __import__("random").Random(0)
    caps = report_captions("A is here. B is there. C is gone. D is new.", "Impression one.", "", rng)
    assert caps[0] == "Impression one." and len(caps) == len(set(caps))
    for cap in caps:  # subsets keep report order
        order = [cap.find(x) for x in ("A is", "B is", "C is", "D is") if x in cap]
        assert order == sorted(order)


def test_grouping_and_phantom_vocabulary():
    triples = [("edema", "HAS_LOCATION", "bilateral_perihilar"), ("edema", "HAS_SEVERITY", "mild"),
               ("support_device", "IS_A", "device"), ("nodule", "HAS_LOCATION", "right_upper_zone"),
               ("nodule", "HAS_SEVERITY", "small")]
    groups = group_triples(triples)
    assert [g.name for g in groups] == ["edema", "support_device", "nodule"]
    texts = rdf_captions(triples, __import__("random").Random(0))
    joined = " ".join(texts).lower()
    assert "mild edema in both perihilar regions" in joined and "small nodule in the right upper zone" in joined
    assert "support device" in joined


def test_cli_captions_prints_triples_and_captions(tmp_path):
    from cxrdr.reinforce.captions.cli import cli_captions

    rows = [{"study_id": "iu-9", "subject_id": "iu-9", "findings": "Moderate right pleural effusion is seen.",
             "impression": "Right effusion.", "mesh": ["Pleural Effusion/right/moderate"], "split": "train",
             "source_images": []}]
    (tmp_path / "iu_xray_reports.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    app = typer.Typer()
    app.command()(cli_captions)
    result = CliRunner().invoke(app, ["--source", f"iu-xray:{tmp_path}", "--limit", "1", "--n-captions", "3"])
    assert result.exit_code == 0, result.output
    assert "== iu-9 (train) ==" in result.output
    assert "(pleural_effusion, HAS_LOCATION, right_hemithorax)" in result.output
    assert result.output.count("  [") == 3
    result = CliRunner().invoke(app, ["--source", f"iu-xray:{tmp_path}", "--json", "-S", "2"])
    row = json.loads(result.output.strip().splitlines()[0])
    assert row["id"] == "iu-9" and len(row["captions"]) == 2
    bad = CliRunner().invoke(app, ["--source", "bogus:x"])
    assert bad.exit_code != 0
