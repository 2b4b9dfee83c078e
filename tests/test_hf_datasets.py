"""Issue 25 (2): Hugging Face `datasets` loads a cxrdr shard folder by its dataset card, streaming or not.

The card's ``configs:`` block names each split's shards, so ``load_dataset(FOLDER)`` uses the
webdataset builder on the tars (not the json builder on dataset.json, sizes.json and stats/), and its
``dataset_info`` declares every member's type. Non-streaming, the builder writes Arrow columns of one
type each: schema 3's json member holds every field in one type whatever the sample (labels -2 for
"not mentioned", ``extra`` as JSON text, ...; ``cxrdr.common.shards.meta``), and cxrdr's own reader
turns it back into the meaning it always had (labels None, ``extra`` a dict).
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import yaml
from PIL import Image

from cxrdr.common.shards import (LABEL_NOT_MENTIONED, check_stored_meta, decode_meta, decode_sample, encode_meta,
                                 hf_features, iter_raw_samples, load_meta, meta_member, read_dataset_info)

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

TEACHER = "random-tiny"


@pytest.fixture(scope="module")
def shards(phantom_shards):
    """The session's phantom shards (several shards per split, float16 random-tiny embeddings)."""
    return phantom_shards


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path / "hf-cache"


@pytest.fixture(scope="module")
def tiny_teacher():
    from cxrdr.teachers import load_teachers

    return load_teachers("random:tiny", device="cpu")


def _build(out, source: str, teachers, **overrides):
    from cxrdr.reinforce.build import build
    from cxrdr.reinforce.options import BuildOptions

    settings = dict(source=source, teachers="random:tiny", out=out, n_aug=2, n_captions=2, store_size=32,
                    workers=0, batch_size=8, device="cpu", progress=False)
    return build(BuildOptions(**{**settings, **overrides}), teachers=teachers)


def _ours(shards, split="train") -> dict:
    info = read_dataset_info(shards)
    urls = [shards / s["name"] for s in info["shards"] if s["split"] == split]
    return {s.key: s for s in map(decode_sample, iter_raw_samples(urls))}


def _stored_members(shards) -> list[dict]:
    info = read_dataset_info(shards)
    return [json.loads(raw["json"]) for raw in iter_raw_samples([shards / s["name"] for s in info["shards"]])]


def _check_row(row: dict, ours: dict) -> None:
    sample = ours[row["__key__"]]
    assert row["txt"] == sample.report
    assert row["json"]["id"] == sample.meta["id"] and row["json"]["captions"] == sample.meta["captions"]
    assert decode_meta(row["json"]) == sample.meta  # every field came through, in its type
    image = row["jpg"]
    if isinstance(image, dict):  # an undecoded Image feature
        image = Image.open(io.BytesIO(image["bytes"]))
    assert np.array_equal(np.asarray(image.convert("L")), np.asarray(sample.image()))
    theirs = np.asarray(row[f"{TEACHER}.npy"], dtype=np.float32)
    rows = sample.embeddings(TEACHER)
    expected = np.concatenate([rows["img"], rows["syn"], rows["txt"][None]])
    np.testing.assert_allclose(theirs, expected, atol=0, rtol=0)  # float16 rows, read back exactly


def _load_and_check(shards, cache, streaming: bool) -> list[dict]:
    ours = _ours(shards)
    if streaming:
        rows = list(datasets.load_dataset(str(shards), split="train", streaming=True))
    else:
        rows = list(datasets.load_dataset(str(shards), split="train", cache_dir=str(cache)))
    assert sorted(r["__key__"] for r in rows) == sorted(ours)
    for row in rows:
        _check_row(row, ours)
    return rows


def test_card_names_each_splits_shards_and_declares_the_types(shards):
    header = yaml.safe_load((shards / "README.md").read_text().split("---\n")[1])
    info = read_dataset_info(shards)
    (config,) = header["configs"]
    assert config["config_name"] == "default"
    expected = {}
    for shard in info["shards"]:
        expected.setdefault(shard["split"], []).append(shard["name"])
    assert {d["split"]: d["path"] for d in config["data_files"]} == expected
    features = datasets.Features._from_yaml_list(header["dataset_info"]["features"])
    assert set(features) == {"__key__", "__url__", "jpg", "txt", "json", f"{TEACHER}.npy"}
    assert features["json"]["labels"]["Lung Lesion"] == datasets.Value("int64")
    body = (shards / "README.md").read_text()
    assert "shardshuffle=False" in body
    assert "load_dataset('THIS_FOLDER', split='train', streaming=True)" in body
    assert "load_dataset('THIS_FOLDER', split='train')" in body and f"{LABEL_NOT_MENTIONED} for not mentioned" in body


def test_streaming_load_of_the_folder_matches_cxrdrs_reader(shards, offline):
    _load_and_check(shards, offline, streaming=True)


def test_non_streaming_load_of_the_folder_matches_cxrdrs_reader(shards, offline):
    _load_and_check(shards, offline, streaming=False)


def _bare_then_full_rows(folder) -> list[dict]:
    """12 jsonl rows: the first 6 (the first shard) with no labels, view, triples, boxes or extra
    columns, the next 6 with all of them (labels with nulls, a box field besides label and box)."""
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(12):
        Image.fromarray(np.full((48, 64), 40 + 15 * i, np.uint8)).save(folder / "images" / f"{i}.png")
        row = {"id": f"r{i:02d}", "image": f"images/{i}.png", "split": "train",
               "report": f"Study {i}: the heart is of normal size and the lungs are clear."}
        if i >= 6:
            row.update(view="PA", labels={"Cardiomegaly": 1, "Edema": -1, "No Finding": 0, "Fracture": None},
                       triples=[["heart", "HAS", "cardiomegaly"]], age=40 + i,
                       boxes=[{"label": "Cardiomegaly", "box": [4, 6, 40, 30], "side": "left"}])
        rows.append(row)
    (folder / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_a_folder_whose_first_samples_lack_every_optional_field_loads_non_streaming(tmp_path, offline,
                                                                                  tiny_teacher):
    """The builder types columns from the first samples: here they have no labels (all not mentioned),
    no view, triples, boxes or extra, and RandAugment ops ([name, magnitude] pairs in memory); later
    samples have all of them. Every row still matches cxrdr's reader, field for field."""
    from cxrdr.common.augment import AugConfig
    from cxrdr.reinforce.verify import verify

    _bare_then_full_rows(tmp_path / "data")
    out = tmp_path / "shards"
    info = _build(out, f"jsonl:{tmp_path / 'data' / 'rows.jsonl'}", tiny_teacher, shard_size=6,
                  aug=AugConfig(randaugment_n=2))
    assert info["total_samples"] == 12 and len(info["shards"]) == 2
    assert verify(out)[0] == []  # includes every json member's types (check_stored_meta)
    ours = _ours(out)
    first, late = ours["r00"].meta, ours["r11"].meta
    assert set(first["labels"].values()) == {None} and first["view"] is None and "extra" not in first
    assert first["boxes"] == [] and first["triples"] == []
    assert late["labels"]["Cardiomegaly"] == 1 and late["labels"]["Edema"] == -1 and late["labels"]["Fracture"] is None
    assert late["view"] == "PA" and late["extra"] == {"age": 51} and late["boxes"][0]["side"] == "left"
    assert all(len(p["ops"]) == 2 and isinstance(p["ops"][0][0], str) for p in late["aug"])
    rows = _load_and_check(out, offline, streaming=False)
    assert any(row["json"]["boxes"] for row in rows) and any(not row["json"]["boxes"] for row in rows)


def test_json_member_round_trip_and_older_schemas():
    meta = {"id": "a", "key": "a", "subject_id": "s", "study_id": "t", "split": "train", "view": None,
            "findings": "F.", "impression": "I.", "labels": {"Edema": 1, "Cardiomegaly": None, "Fracture": -1},
            "label_vector": [0.0] * 14, "triples": [["a", "b", "c"]],
            "captions": [{"text": "x", "source": "rdf"}],
            "aug": [{"crop": [0, 0, 10, 10], "angle": 1.5, "hflip": False, "brightness": 1, "contrast": 1.0,
                     "gamma": 1.0, "ops": [["blur", 4.5]], "noise_seed": 7}],
            "boxes": [{"label": "Edema", "box": [1, 2, 3, 4], "side": "left"}, {"label": 5, "box": [0, 0, 1, 1]}],
            "image_size": None, "extra": {"source": "x", "nested": {"v": [1, None]}}}
    stored = json.loads(meta_member(encode_meta(meta)))
    check_stored_meta(stored)
    assert stored["labels"]["Cardiomegaly"] == LABEL_NOT_MENTIONED and stored["labels"]["Pneumonia"] == LABEL_NOT_MENTIONED
    assert stored["view"] == "" and stored["image_size"] == [] and isinstance(stored["extra"], str)
    assert stored["aug"][0]["ops"] == [{"name": "blur", "magnitude": 4.5}] and stored["aug"][0]["crop"] == [0.0] * 2 + [10.0] * 2
    back = decode_meta(stored)
    full_labels = {name: meta["labels"].get(name) for name in stored["labels"]}
    assert back == {**meta, "labels": full_labels}  # the meaning comes back (ints where floats are now floats)
    # Schema 1 and 2 stored that meaning as it is: read unchanged.
    old = {**back, "extra": {"source": "x"}}
    assert decode_meta(old) is old and load_meta(json.dumps(old).encode()) == old
    assert "extra" not in decode_meta(encode_meta({**meta, "extra": {}}))
    with pytest.raises(ValueError, match="labels.Edema"):
        encode_meta({**meta, "labels": {"Edema": 2}})
    with pytest.raises(ValueError, match="unknown"):
        encode_meta({**meta, "aug": [{**meta["aug"][0], "zoom": 2}]})
    with pytest.raises(ValueError, match="label_vector"):
        check_stored_meta({**stored, "label_vector": [1] + stored["label_vector"][1:]})  # an int among floats


def test_features_follow_the_build():
    info = {"schema_version": 3, "images": False, "emb_dtype": "float32", "teachers": [{"name": "minilm"}]}
    features = datasets.Features._from_yaml_list(hf_features(info))
    assert set(features) == {"__key__", "__url__", "txt", "json", "minilm.npy"}
    assert features["minilm.npy"] == datasets.List(datasets.List(datasets.Value("float32")))
    assert "minilm.npy" not in {f["name"] for f in hf_features({**info, "emb_dtype": "int8"})}
    assert hf_features({**info, "schema_version": 2}) is None  # json types vary before schema 3


def test_phantom_and_nih_bbox_builds_type_the_json_member_alike(shards, shared_data, tiny_teacher, tmp_path):
    """What datasets infers from all samples of either build is one type per field, the declared one."""
    nih = tmp_path / "nih"
    _build(nih, f"nih-bbox:{shared_data / 'nih_bbox' / 'nih_bbox.jsonl'}", tiny_teacher, limit=24)
    declared = datasets.Features._from_yaml_list(hf_features(read_dataset_info(nih))).arrow_schema
    inferred = {}
    for name, folder in (("phantom", shards), ("nih", nih)):
        members = _stored_members(folder)
        for member in members:
            check_stored_meta(member)
        assert any(m["boxes"] for m in members) and any(m["triples"] for m in members)
        inferred[name] = pa.Table.from_pylist(members).schema
    assert inferred["phantom"] == inferred["nih"]
    for field in inferred["nih"]:
        if field.name != "aug":  # aug.ops: [] without RandAugment, list<null> when inferred
            assert field.type == declared.field("json").type.field(field.name).type, field.name
