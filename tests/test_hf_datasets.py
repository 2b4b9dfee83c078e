"""Issue 25 (2): Hugging Face `datasets` loads a cxrdr shard folder by its dataset card.

The card's ``configs:`` block names each split's shards, so ``load_dataset(FOLDER)`` uses the
webdataset builder on the tars (not the json builder on dataset.json, sizes.json and stats/).
Streaming: every sample, with image, report and embeddings equal to what cxrdr's own reader gives.
Non-streaming still fails (the builder types the json member's fields from the first 5 samples;
fields null or empty there hold ints, strings or lists later): an expected failure until the json
member's types are stable.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import yaml

from cxrdr.common.shards import decode_sample, iter_raw_samples, read_dataset_info

datasets = pytest.importorskip("datasets")

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


def _ours(shards) -> dict:
    info = read_dataset_info(shards)
    urls = [shards / s["name"] for s in info["shards"] if s["split"] == "train"]
    return {s.key: s for s in map(decode_sample, iter_raw_samples(urls))}


def _check_row(row: dict, ours: dict) -> None:
    sample = ours[row["__key__"]]
    assert row["txt"] == sample.report
    assert row["json"]["id"] == sample.meta["id"] and row["json"]["captions"] == sample.meta["captions"]
    image = row["jpg"]
    if isinstance(image, dict):  # an undecoded Image feature
        from PIL import Image
        image = Image.open(io.BytesIO(image["bytes"]))
    assert np.array_equal(np.asarray(image.convert("L")), np.asarray(sample.image()))
    theirs = np.asarray(row[f"{TEACHER}.npy"], dtype=np.float32)
    rows = sample.embeddings(TEACHER)
    expected = np.concatenate([rows["img"], rows["syn"], rows["txt"][None]])
    np.testing.assert_allclose(theirs, expected, atol=0, rtol=0)  # float16 rows, read back exactly


def test_card_names_each_splits_shards(shards):
    header = yaml.safe_load((shards / "README.md").read_text().split("---\n")[1])
    info = read_dataset_info(shards)
    (config,) = header["configs"]
    assert config["config_name"] == "default"
    expected = {}
    for shard in info["shards"]:
        expected.setdefault(shard["split"], []).append(shard["name"])
    assert {d["split"]: d["path"] for d in config["data_files"]} == expected
    body = (shards / "README.md").read_text()
    assert "shardshuffle=False" in body and "load_dataset('THIS_FOLDER', split='train', streaming=True)" in body


def test_streaming_load_of_the_folder_matches_cxrdrs_reader(shards, offline):
    ours = _ours(shards)
    rows = list(datasets.load_dataset(str(shards), split="train", streaming=True))
    assert sorted(r["__key__"] for r in rows) == sorted(ours)
    for row in rows:
        _check_row(row, ours)


@pytest.mark.xfail(strict=True, reason="json member field types depend on the first samples (issue 25, open)")
def test_non_streaming_load_of_the_folder_matches_cxrdrs_reader(shards, offline):
    ours = _ours(shards)
    ds = datasets.load_dataset(str(shards), split="train", cache_dir=str(offline))
    assert sorted(ds["__key__"]) == sorted(ours)
    _check_row(ds[0], ours)
