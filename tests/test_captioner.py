"""`reinforce build --captioner retrieval:BANK`: captions retrieved per stored view, image-only records,
the sentence bank (never val/test text), the on-disk form, verify/inspect/card, and training's pick.

Small builds: 12 generated 64-px images in a jsonl (reports, labels only, image only), K=2, S=2,
teacher random:tiny (loaded once); the NIH box subset of ../shared/data where present.
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from cxrdr.common.errors import UserError
from cxrdr.common.shards import decode_sample, iter_tar_samples, load_meta, read_dataset_info
from cxrdr.reinforce.build import BuildOptions, build
from cxrdr.reinforce.captioners import load_captioner, parse_captioner_spec, register_captioner
from cxrdr.reinforce.captioners.check import caption_problems
from cxrdr.reinforce.captioners.bank import SentenceBank, file_sentences, read_bank, train_split_sentences
from cxrdr.reinforce.captioners.retrieval import RetrievalCaptioner, load_retrieval_captioner
from cxrdr.reinforce.captioners.views import attach_view_captions
from cxrdr.reinforce.card import dataset_card
from cxrdr.reinforce.inspect import describe_text, first_sample
from cxrdr.reinforce.records import Record
from cxrdr.reinforce.sources import open_source
from cxrdr.reinforce.verify import verify
from cxrdr.teachers import load_teachers
from cxrdr.train.data import SampleView
from tests.test_build import app

VAL_ONLY = "Valsecret opacity projects over the left apex."
TEST_ONLY = "Testsecret nodule in the right midlung."
TRAIN_REPORTS = ["Right pleural effusion is present. Heart size is normal.",
                 "Mild cardiomegaly. No pneumothorax is seen.",
                 "Left basilar atelectasis. Lungs are otherwise clear.",
                 "Small left pleural effusion. Stable mediastinal contours."]


def _rows(folder: Path) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = [{"id": f"rep{i}", "report": text, "split": "train"} for i, text in enumerate(TRAIN_REPORTS)]
    rows += [{"id": "lab0", "labels": ["Cardiomegaly"], "split": "train"},
             {"id": "img0", "split": "train"}, {"id": "img1", "split": "train"}, {"id": "img2", "split": "train"},
             {"id": "val0", "report": VAL_ONLY + " Heart size is normal.", "split": "val"}, {"id": "val1", "split": "val"},
             {"id": "test0", "report": TEST_ONLY + " No effusion.", "split": "test"}, {"id": "test1", "split": "test"}]
    for row in rows:
        Image.fromarray(rng.integers(0, 256, (72, 64), dtype=np.uint8), "L").save(folder / f"{row['id']}.png")
        row["image"] = f"{row['id']}.png"
    return rows


@pytest.fixture(scope="module")
def image_only_jsonl(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("image-only")
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(folder)))
    return path


@pytest.fixture(scope="module")
def tiny():
    return load_teachers("random:tiny")


def _options(out: Path, source: str, **overrides) -> BuildOptions:
    base = dict(source=source, teachers="random:tiny", out=out, n_aug=2, n_captions=2, store_size=64, shard_size=8,
                workers=0, batch_size=8, device="cpu", progress=False, captioner="retrieval:train")
    return BuildOptions(**{**base, **overrides})


@pytest.fixture(scope="module")
def retrieved(image_only_jsonl, tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retrieved") / "shards"
    build(_options(out, f"jsonl:{image_only_jsonl}"), teachers=tiny)
    return out


def _samples(shards: Path) -> dict[str, dict]:
    info = read_dataset_info(shards)
    return {key: sample for s in info["shards"] for key, sample in iter_tar_samples(shards / s["name"])}


# --------------------------------------------------------------------------- the bank


def test_bank_of_the_source_holds_train_report_sentences_only():
    records = [Record(id="a", subject_id="a", study_id="a", split="train", report="Heart is normal. Small effusion."),
               Record(id="b", subject_id="b", study_id="b", split="val", report=VAL_ONLY),
               Record(id="c", subject_id="c", study_id="c", split="test", report=TEST_ONLY),
               Record(id="d", subject_id="d", study_id="d", split="train", report="Findings of cardiomegaly.",
                      extra={"text_source": "labels"})]
    sentences, provenance = train_split_sentences(records)
    assert sentences == ["Heart is normal.", "Small effusion."]
    assert provenance["left_out_not_train"] == 2 and provenance["left_out_composed"] == 1


def test_bank_of_a_report_file_leaves_out_rows_of_other_splits(tmp_path):
    path = tmp_path / "reports.jsonl"
    path.write_text(json.dumps({"findings": "Heart is normal.", "impression": "No acute disease.", "split": "train"})
                    + "\n" + json.dumps({"report": VAL_ONLY, "split": "val"}) + "\n"
                    + json.dumps({"report": "No split given here."}) + "\n")
    sentences, provenance = file_sentences(path)
    assert sentences == ["Heart is normal.", "No acute disease.", "No split given here."]
    assert provenance["left_out_not_train"] == 1
    txt = tmp_path / "bank.txt"
    txt.write_text("Heart is normal. Lungs clear.\nHeart is normal.\n")
    assert file_sentences(txt)[0] == ["Heart is normal.", "Lungs clear."]


def test_built_bank_never_holds_val_or_test_sentences_and_loads_without_pickle(retrieved):
    sentences, embeddings, described = read_bank(retrieved)
    assert VAL_ONLY not in sentences and TEST_ONLY not in sentences
    train_sentences = {s for r in TRAIN_REPORTS for s in r.replace(". ", ".|").split("|")}
    assert set(sentences) == train_sentences
    assert embeddings.shape == (len(sentences), 64) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    info = read_dataset_info(retrieved)
    assert described == info["captioner"]["bank"] and described["left_out_not_train"] == 4


# --------------------------------------------------------------------------- retrieval and the on-disk form


def test_retrieval_ranks_by_cosine_best_first_ties_in_bank_order():
    bank = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0.6, 0.8, 0]], dtype=np.float32)
    captioner = RetrievalCaptioner("retrieval:x", SentenceBank(["a", "b", "c", "d"], bank, "t", "f"))
    top, scores = captioner.retrieve(np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32), 3)
    assert top.tolist() == [[0, 2, 3], [1, 3, 0]]
    np.testing.assert_allclose(scores, [[1, 1, 0.6], [1, 0.8, 0]], atol=1e-6)
    assert captioner.view_captions(np.array([[0, 1, 0]], dtype=np.float32), 2) == [[("b", 1.0, 1),
                                                                                   ("d", pytest.approx(0.8), 3)]]
    assert captioner.report_for(np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32), 2) == "d a"


def test_view_captions_are_stored_once_with_per_view_indexes():
    prepared = {"report": "", "meta": _stored_meta(), "row": {"n_captions": 0}, "texts": [""]}
    per_view = [[("x", 0.9, 4), ("y", 0.5, 7)], [("y", 0.8, 7), ("z", 0.1, 2)]]
    attach_view_captions(prepared, per_view, "retrieved", report="x y")
    meta = prepared["meta"]
    assert meta["captions"] == [{"text": t, "source": "retrieved"} for t in "xyz"]
    assert meta["caption_views"] == [[0, 1], [1, 2]] and meta["caption_bank_ids"] == [4, 7, 2]
    assert meta["caption_scores"] == [[0.9, 0.5], [0.8, 0.1]] and meta["caption_source"] == "retrieved"
    assert prepared["texts"] == ["x y", "x", "y", "z"] and prepared["row"]["n_captions"] == 3


def _stored_meta() -> dict:
    from cxrdr.common.shards import encode_meta

    return encode_meta({"id": "a", "key": "a", "subject_id": "a", "study_id": "a", "split": "train", "view": None,
                        "findings": "", "impression": "", "labels": {}, "label_vector": [0.0] * 14, "triples": [],
                        "captions": [], "aug": [], "boxes": [], "image_size": [64, 64]})


def test_image_only_build_keeps_every_image_and_says_where_each_caption_came_from(retrieved):
    info = read_dataset_info(retrieved)
    assert verify(retrieved)[0] == []
    assert info["total_samples"] == 12 and info["counts"] == {"train": 8, "val": 2, "test": 2}
    assert info["source"]["counts"]["text_source"] == {"report": 6, "labels": 1, "retrieved": 5}
    assert info["captioner"]["caption_source"] == "retrieved" and info["captioner"]["teacher"] == "random-tiny"
    assert info["captions"]["generator"] == "cxrdr.reinforce.captioners (retrieval)"
    bank, _, _ = read_bank(retrieved)
    for key, raw in _samples(retrieved).items():
        meta = load_meta(raw["json"])
        assert meta["caption_source"] == "retrieved" and all(c["source"] == "retrieved" for c in meta["captions"])
        assert len(meta["caption_views"]) == 2 and all(len(v) == 2 for v in meta["caption_views"])
        assert [bank[i] for i in meta["caption_bank_ids"]] == [c["text"] for c in meta["captions"]]
        report = raw["txt"].decode()
        if key.startswith("img") or key in ("val1", "test1"):  # image only: text retrieved, marked so
            assert meta["extra"]["text_source"] == "retrieved" and report and set(report.split(". ")) <= \
                {s.rstrip(".") for s in bank} | set(bank)
        elif key == "lab0":  # labels only: the label template text, as without a captioner
            assert meta["extra"]["text_source"] == "labels" and "cardiomegaly" in report.lower()
        rows = decode_sample({"__key__": key, **raw}).embeddings("random-tiny")
        assert rows["syn"].shape == (len(meta["captions"]), 64) and rows["img"].shape == (2, 64)
    card = dataset_card(info)
    assert "## Captions" in card and "`--captioner retrieval:train`" in card and "image-only" in card
    text = describe_text(retrieved, info, first_sample(retrieved, info))
    assert "captioner: retrieval:train" in text and "[retrieved]" in text and "bank row" in text
    result = CliRunner().invoke(app(), ["verify", str(retrieved)])
    assert result.exit_code == 0 and "verify: OK - 3 shards, 12 samples" in result.output


def test_without_a_captioner_image_only_rows_are_skipped_as_before(image_only_jsonl):
    source = open_source(f"jsonl:{image_only_jsonl}")
    kept = [r.id for r in source]
    assert kept == ["rep0", "rep1", "rep2", "rep3", "lab0", "val0", "test0"]
    assert source.skipped.by_reason() == {"empty report": 5}


def test_verify_names_bad_caption_provenance():
    info = {"n_aug": 2, "n_captions": 2, "captioner": {"caption_source": "retrieved"}}
    good = {"captions": [{"text": t, "source": "retrieved"} for t in "xyz"], "caption_source": "retrieved",
            "caption_views": [[0, 1], [1, 2]], "caption_scores": [[0.9, 0.5], [0.8, 0.1]], "caption_bank_ids": [0, 1, 2]}
    assert caption_problems("s", good, info, ["x", "y", "z"]) == []
    bad = [({"caption_bank_ids": [1, 0, 2]}, "do not name the captions' bank sentences"),
           ({"caption_views": [[0, 0], [1, 2]]}, "are not 2 distinct caption indexes"),
           ({"caption_views": [[0, 1], [0, 1]]}, "belongs to no view"),
           ({"caption_scores": [[0.5, 0.9], [0.8, 0.1]]}, "are not cosines best first"),
           ({"caption_views": [[0, 1]]}, "caption_views is not 2 lists of 2"),
           ({"caption_source": "report"}, "is not the captioner's 'retrieved'")]
    for change, message in bad:
        problems = caption_problems("s", {**good, **change}, info, ["x", "y", "z"])
        assert any(message in p for p in problems), (change, problems)


# --------------------------------------------------------------------------- plug-in, errors, training


class _ShiftedRetrieval(RetrievalCaptioner):
    """A plug-in for the test: view k gets the retrieval's ranks k..k+S-1 (so views differ)."""

    name = "shifted"

    def view_captions(self, image_rows, n):
        top, scores = self.retrieve(image_rows, n + len(image_rows))
        return [[(self.bank.sentences[i], float(s), int(i)) for i, s in zip(ids[k:k + n], row[k:k + n])]
                for k, (ids, row) in enumerate(zip(top, scores))]


def _load_shifted(arg, spec, teachers, records, options=None):
    return _ShiftedRetrieval(spec, load_retrieval_captioner(arg, spec, teachers, records, options).bank)


def test_a_registered_captioner_plugs_in_and_training_picks_the_views_captions(image_only_jsonl, tiny, tmp_path):
    register_captioner("shifted", _load_shifted)
    out = tmp_path / "shifted"
    build(_options(out, f"jsonl:{image_only_jsonl}", captioner="shifted:train", limit=6), teachers=tiny)
    assert verify(out)[0] == []
    samples = [decode_sample({"__key__": k, **raw}) for k, raw in _samples(out).items()]
    assert all(len(s.meta["captions"]) == 3 for s in samples)  # ranks 0-1 and 1-2: three distinct
    view = SampleView(split="train", image_size=32, teachers=["random-tiny"])
    for sample in samples:
        views = sample.meta["caption_views"]
        for epoch in range(6):
            example = view(sample, epoch=epoch)
            assert example["caption_index"] in views[example["aug_index"]]
            stored = sample.embeddings("random-tiny")["syn"][example["caption_index"]]
            np.testing.assert_allclose(example["teacher"]["random-tiny"]["syn"].numpy(), stored)
    plain = SampleView(split="train", image_size=32, mode="plain")
    assert {plain(samples[0], epoch=e)["caption_index"] for e in range(12)} <= {0, 1, 2}


def test_captioner_errors_are_one_line(image_only_jsonl, tiny, tmp_path):
    text_only = [types.SimpleNamespace(has_images=False, spec="text:minilm", name="minilm")]
    with pytest.raises(UserError, match="needs an image-text teacher .*only text teachers") as err:
        build(_options(tmp_path / "a", f"jsonl:{image_only_jsonl}", teachers="text:minilm"), teachers=text_only)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="unknown captioner 'coca'"):
        parse_captioner_spec("coca:x")
    result = CliRunner().invoke(app(), ["build", "--captioner", "coca:x", "--out", str(tmp_path / "c")])
    assert isinstance(result.exception, UserError) and "--captioner coca:x" in str(result.exception)
    with pytest.raises(UserError, match="the sentence bank is empty"):
        load_captioner("retrieval:train", tiny, [])
    with pytest.raises(UserError, match="--engine local"):
        build(_options(tmp_path / "b", "phantom:4", engine="ray"), teachers=tiny)


def test_train_runs_on_an_image_only_build(retrieved, tmp_path):
    from cxrdr.train.loop import train

    summary = train(dict(shards=str(retrieved), model="tiny-A", steps=2, batch_size=4, workers=0, progress=False,
                         device="cpu", log_every=1, out=str(tmp_path / "run")))
    assert summary["steps"] == 2 and summary["teachers"] == ["random-tiny"]


def test_nih_bbox_builds_with_captions_retrieved_from_iu_reports(shared_data, tiny, tmp_path):
    nih, iu = shared_data / "nih_bbox" / "nih_bbox.jsonl", shared_data / "iu_xray" / "iu_xray_reports.jsonl"
    if not nih.is_file() or not iu.is_file():
        pytest.skip("nih_bbox or iu_xray not in shared data")
    out = tmp_path / "nih"
    info = build(_options(out, f"nih-bbox:{nih}", captioner=f"retrieval:{iu}?max_sentences=300", limit=6),
                 teachers=tiny)
    assert verify(out)[0] == []
    bank = info["captioner"]["bank"]
    assert bank["source"] == "file" and bank["sentences"] == 300 and bank["left_out_not_train"] > 0
    for raw in _samples(out).values():
        meta = load_meta(raw["json"])
        assert meta["caption_source"] == "retrieved" and meta["extra"]["text_source"] == "labels"
    with pytest.raises(UserError, match="sentence bank is empty"):  # NIH has no report text of its own
        build(_options(tmp_path / "nih2", f"nih-bbox:{nih}", limit=4), teachers=tiny)


# --------------------------------------------------------------------------- grounding (phantom's known findings)


def test_sentence_findings_and_the_hit_rate_against_the_banks_base_rate(retrieved):
    from cxrdr.reinforce.captioners.grounding import grounding, sentence_findings, shard_grounding

    assert sentence_findings("Moderate right pleural effusion with adjacent atelectasis.") == {
        "Pleural Effusion", "Atelectasis"}
    assert sentence_findings("No pleural effusion or pneumothorax.") == frozenset()
    assert sentence_findings("Heart size is normal.") == frozenset()
    bank = ["Mild cardiomegaly.", "Small left pleural effusion.", "No pneumothorax.", "Nodule in the right lung."]
    # sample 1 has cardiomegaly: view 0 retrieves it (hit) and the negation (asserts nothing), view 1 the nodule
    result = grounding(bank, [({"Cardiomegaly"}, [[0, 2], [3, 0]]), ({"Pleural Effusion"}, [[1, 0], [1, 3]])])
    assert result["retrieved_sentences"] == 8 and result["asserting_a_finding"] == 7
    assert result["hit_rate"] == pytest.approx(4 / 7)  # 0, 0 | 1, 1 of the 7 asserting slots hit
    assert result["bank_base_rate"] == pytest.approx(1 / 3)  # one of the 3 asserting bank sentences per sample
    assert result["bank_asserting_fraction"] == 0.75
    measured = shard_grounding(retrieved, split="train")
    assert measured["samples"] == 8 and measured["retrieved_sentences"] == 8 * 2 * 2
