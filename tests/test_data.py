"""cxrdr.train.data: reinforced/plain/eval batches from phantom shards (built once per session)."""
from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cxrdr.common import augment
from cxrdr.common import shards as sf

N_AUG, N_CAP = 2, 2


@functools.lru_cache(maxsize=None)
def build_phantom_shards(base: str) -> Path:
    """`reinforce build --source phantom:40 --teachers random:tiny` into base/shards (once)."""
    out = Path(base) / "shards"
    if (out / sf.DATASET_JSON).is_file():
        return out
    from typer.testing import CliRunner

    from cxrdr.reinforce.cli import app

    # the command in this process (its imports are the session's already; a fresh interpreter took seconds)
    args = ["build", "--source", "phantom:40", "--teachers", "random:tiny", "--n-aug", str(N_AUG), "--n-captions",
            str(N_CAP), "--store-size", "64", "--shard-size", "12", "--workers", "0", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise RuntimeError(f"reinforce build failed:\n{result.output}") from result.exception
    return out


def fake_tokenize(texts):
    ids = torch.tensor([[len(w) % 50 + 1 for w in t.split()][:8] + [0] * (8 - min(8, len(t.split())))
                        for t in texts])
    return {"input_ids": ids, "attention_mask": (ids > 0).long()}


def _raw_samples(shards: Path, split: str) -> dict:
    import webdataset as wds

    from cxrdr.train.data import split_shards

    urls, _ = split_shards(shards, split)
    return {s["__key__"]: s for s in wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples())}


def _loader(shards, split="train", **kw):
    from cxrdr.train.data import make_loader

    kw.setdefault("shuffle_buffer", 8)
    return make_loader(shards, split, None, kw.pop("batch_size", 4), image_size=32,
                       tokenize=fake_tokenize, **kw)


def test_reinforced_batch_shapes_and_teacher_rows(phantom_shards):
    from cxrdr.common.shards import read_dataset_info

    info = read_dataset_info(phantom_shards)
    teacher = info["teachers"][0]["name"]
    batch = next(iter(_loader(phantom_shards, seed=3)))
    b = 4
    assert batch["images"].shape == (b, 1, 32, 32)
    assert batch["images"].dtype == torch.float32
    assert batch["labels"].shape == (b, 14)
    assert batch["report_ids"].shape[0] == b and batch["caption_ids"].shape[0] == b
    assert len(batch["report_text"]) == b and len(batch["caption_text"]) == b
    rows = batch["teacher"][teacher]
    raw = _raw_samples(phantom_shards, "train")
    for i, key in enumerate(batch["key"]):
        sample = raw[key]
        a, c = int(batch["aug_index"][i]), int(batch["caption_index"][i])
        assert 0 <= a < info["n_aug"] and 0 <= c < info["n_captions"]
        if rows["img"] is not None:
            np.testing.assert_allclose(rows["img"][i].numpy(), sf.sample_embedding(sample, teacher, "img")[a])
        np.testing.assert_allclose(rows["syn"][i].numpy(), sf.sample_embedding(sample, teacher, "syn")[c])
        np.testing.assert_allclose(rows["txt"][i].numpy(), sf.sample_embedding(sample, teacher, "txt").reshape(-1))
        meta = sf.load_meta(sample["json"])  # aug params as replay reads them
        assert batch["caption_text"][i] == meta["captions"][c]["text"]
        assert batch["aug_params"][i] == meta["aug"][a]
        # The replayed crop is exactly augment.replay of the stored image with the stored params.
        from PIL import Image

        ext = "png" if "png" in sample else "jpg"
        stored = Image.open(io.BytesIO(sample[ext])).convert("L")
        assert torch.equal(batch["images"][i], augment.replay(stored, meta["aug"][a], 32))


def test_sequential_pick_and_teacher_crop(phantom_shards):
    batch = next(iter(_loader(phantom_shards, pick="sequential", epoch=3, teacher_image_size=24)))
    assert set(batch["aug_index"].tolist()) == {3 % N_AUG}
    assert set(batch["caption_index"].tolist()) == {3 % N_CAP}
    assert batch["teacher_images"].shape == (4, 1, 24, 24)


def test_plain_mode_has_no_teacher_and_fresh_views(phantom_shards):
    batch = next(iter(_loader(phantom_shards, mode="plain", shuffle=False)))
    assert batch["teacher"] == {}
    assert (batch["aug_index"] == -1).all()
    raw = _raw_samples(phantom_shards, "train")
    stored = sf.load_meta(raw[batch["key"][0]]["json"])["aug"]
    assert batch["aug_params"][0] not in stored
    other = next(iter(_loader(phantom_shards, mode="plain", shuffle=False, epoch=1)))
    assert other["key"][0] == batch["key"][0] and other["aug_params"][0] != batch["aug_params"][0]


def test_split_selection_and_eval_loader(phantom_shards):
    from cxrdr.common.shards import read_dataset_info
    from cxrdr.train.data import make_eval_loader

    info = read_dataset_info(phantom_shards)
    for split in ("val", "test"):
        keys = [k for b in _loader(phantom_shards, split, batch_size=3, drop_last=False) for k in b["key"]]
        raw = _raw_samples(phantom_shards, split)
        assert sorted(keys) == sorted(raw)
        assert all(json.loads(s["json"])["split"] == split for s in raw.values())
        assert len(keys) == info["counts"][split]
    loader = make_eval_loader(phantom_shards, "val", None, batch_size=5, image_size=32,
                              tokenize=fake_tokenize, return_boxes=True)
    first = [k for b in loader for k in b["key"]]
    second = [k for b in loader for k in b["key"]]
    assert first == second and len(first) == info["counts"]["val"]
    batch = next(iter(loader))
    assert "boxes" in batch and batch["teacher"] == {}
    w, h = batch["image_wh"][0]
    assert batch["aug_params"][0] == augment.full_image_params(w, h)


def test_resampled_stream_is_endless_and_errors_are_clear(phantom_shards):
    loader = _loader(phantom_shards, resampled=True, batch_size=8)
    it = iter(loader)
    n_train = _loader(phantom_shards).samples_per_epoch
    batches = [next(it) for _ in range(n_train // 8 + 3)]
    assert len(batches) == n_train // 8 + 3
    with pytest.raises(ValueError, match="not in the shards"):
        _loader(phantom_shards, teachers="nope")
    with pytest.raises(FileNotFoundError):
        _loader(phantom_shards.parent / "missing")


def test_multiworker_loader(phantom_shards):
    keys = [k for b in _loader(phantom_shards, "train", workers=2, batch_size=4, drop_last=False)
            for k in b["key"]]
    assert sorted(keys) == sorted(_raw_samples(phantom_shards, "train"))


def test_data_path_benchmark_reads_equal_batches_every_way(phantom_shards, capsys, one_thread):
    """benchmarks/data_path.py: the views replayed one at a time and together in the collate, with and without
    default_convert, give the same batches (it exits 1 where any differs) and a figure for each."""
    from tests.script_loader import load_script

    data_path = load_script("benchmarks/data_path.py")
    assert data_path.main([str(phantom_shards), "--model", "tiny-A", "--batch-size", "4", "--batches", "3",
                           "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "every configuration's batches equal" in out
    assert all(f"{name}" in out for name in data_path.CONFIGURATIONS) and out.count("ms a batch") == 4
