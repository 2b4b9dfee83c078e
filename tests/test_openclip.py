"""open_clip in and out: open_clip_train's WebDataset pipeline on cxrdr shards (with the shim that
tolerates webdataset's end-of-shard markers), `train export --format open_clip`, and the export
loaded back by open_clip and as an `openclip:local-dir:` teacher."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reinforce.build import BuildOptions, build, read_dataset_info
from reinforce.verify import iter_tar_samples


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from reinforce.teachers import load_teachers

    out = tmp_path_factory.mktemp("openclip") / "shards"
    opts = BuildOptions(source="phantom:12", teachers="random:tiny", out=out, n_aug=2, n_captions=2,
                        store_size=64, shard_size=3, workers=0, batch_size=4, device="cpu", progress=False)
    build(opts, teachers=load_teachers("random:tiny", device="cpu"))
    return out


def _train_urls(shards) -> tuple[str, list[str]]:
    info = read_dataset_info(shards)
    chosen = [s for s in info["shards"] if s["split"] == "train"]
    reports = [sample["txt"].decode() for s in chosen for _, sample in iter_tar_samples(shards / s["name"])]
    return "::".join(str(shards / s["name"]) for s in chosen), reports


def _wds_args(urls: str, n: int) -> SimpleNamespace:
    # the attributes open_clip_train's get_wds_dataset reads from its argparse namespace
    return SimpleNamespace(train_data=urls, val_data=None, train_num_samples=n, dataset_resampled=False,
                           train_data_upsampling_factors=None, seed=0, batch_size=1, workers=0, world_size=1)


def _unpatched(monkeypatch):
    import open_clip_train.data as data

    current = data.group_by_keys_nothrow
    monkeypatch.setattr(data, "group_by_keys_nothrow", getattr(current, "original", current))


def test_open_clip_train_without_the_shim_hits_the_end_of_shard_marker(shards, monkeypatch):
    """The failure the shim exists for (webdataset >= 0.2.96: a marker without 'fname' per shard)."""
    import open_clip
    import webdataset
    from open_clip_train.data import get_wds_dataset

    version = tuple(int(p) for p in webdataset.__version__.split(".")[:3])
    if version < (0, 2, 96):
        pytest.skip(f"webdataset {webdataset.__version__} has no end-of-shard markers")
    _unpatched(monkeypatch)
    urls, reports = _train_urls(shards)
    data = get_wds_dataset(_wds_args(urls, len(reports)), open_clip.image_transform(32, is_train=True),
                           is_train=True, tokenizer=open_clip.get_tokenizer("ViT-S-32"))
    with pytest.raises(KeyError, match="fname"):
        list(data.dataloader)


def test_open_clip_train_pipeline_reads_cxrdr_shards(shards, monkeypatch):
    import open_clip
    from open_clip_train.data import get_wds_dataset

    from train.openclip_train import patch_open_clip_train

    _unpatched(monkeypatch)
    patch_open_clip_train()
    patch_open_clip_train()  # idempotent: wraps once
    import open_clip_train.data as data

    assert data.group_by_keys_nothrow.original.__module__ == "open_clip_train.data"
    urls, reports = _train_urls(shards)
    assert len(reports) >= 6 and urls.count("::") >= 1  # several shards: markers between them
    tokenizer = open_clip.get_tokenizer("ViT-S-32")
    loader = get_wds_dataset(_wds_args(urls, len(reports)), open_clip.image_transform(32, is_train=True),
                             is_train=True, tokenizer=tokenizer).dataloader
    batches = list(loader)
    assert len(batches) == len(reports)
    for image, text in batches:
        assert image.shape == (1, 3, 32, 32) and image.dtype == torch.float32
        assert text.shape == (1, 77) and text.dtype == torch.long
    # every report read exactly once, as open_clip's tokenizer encodes it
    seen = sorted(tuple(text[0].tolist()) for _, text in batches)
    assert seen == sorted(tuple(tokenizer(r)[0].tolist()) for r in reports)
