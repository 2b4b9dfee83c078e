"""open_clip in and out: open_clip_train's WebDataset pipeline on cxrdr shards (with the shim that
tolerates webdataset's end-of-shard markers), `train export --format open_clip`, and the export
loaded back by open_clip and as an `openclip:local-dir:` teacher."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cxrdr.common.shards import iter_tar_samples, read_dataset_info
from cxrdr.reinforce.build import BuildOptions, build


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from cxrdr.teachers import load_teachers

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

    from cxrdr.train.openclip_train import patch_open_clip_train

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


# ------------------------------------------------------------------ open_clip out: train export
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Students (random heads: the mapping, not the training, is under test) exported: tiny-A/D (timm ViT),
    cpu-E (hybrid Lite0-ViT with token dropping) and tiny-cnn-D (stride-16 EfficientNet cut), the last
    two as cxrdr_image_tower."""
    from cxrdr.train.checkpoint import save_checkpoint
    from cxrdr.train.export import export_open_clip
    from cxrdr.train.models import build_student

    root = tmp_path_factory.mktemp("export")
    out = {}
    for name in ("tiny-A", "tiny-D", "cpu-E", "tiny-cnn-D"):
        torch.manual_seed(3)
        student = build_student(name)
        with torch.no_grad():
            student.logit_scale.fill_(3.0)
        save_checkpoint(root / f"{name}.pt", student)
        summary = export_open_clip(root / f"{name}.pt", root / name)
        out[name] = (student.eval(), root / name, summary)
    return out


TEXTS = ["no acute cardiopulmonary process", "small right pleural effusion", "the heart is enlarged"]


@pytest.mark.parametrize("name", ["tiny-A", "tiny-D", "cpu-E", "tiny-cnn-D"])
def test_export_loads_in_open_clip_with_the_students_embeddings(exported, name, monkeypatch):
    import numpy as np
    import open_clip
    from PIL import Image

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student, out, summary = exported[name]
    assert summary["max_embedding_difference"] <= 1e-4
    for item in ("open_clip_config.json", "open_clip_model.safetensors", "tokenizer.json",
                 "vision/config.json", "text/config.json"):
        assert (out / item).is_file(), item
    config = __import__("json").loads((out / "open_clip_config.json").read_text())
    assert config["preprocess_cfg"]["mean"] == student.config.image_mean
    assert config["model_cfg"]["text_cfg"]["hf_pooler_type"] == "cls_last_hidden_state_pooler"

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    model.eval()
    # preprocess: a grayscale image becomes the student's input (1 channel in [0,1] -> 3, mean/std)
    rng = np.random.default_rng(0)
    size = student.image_size
    grays = [Image.fromarray(rng.integers(0, 256, (size, size), dtype=np.uint8), mode="L") for _ in range(3)]
    pixels = torch.stack([torch.from_numpy(np.asarray(g, dtype=np.float32) / 255.0)[None] for g in grays])
    x = torch.stack([preprocess(g) for g in grays])
    expected_x = (pixels.expand(-1, 3, -1, -1) - torch.tensor(student.config.image_mean).view(1, 3, 1, 1)) \
        / torch.tensor(student.config.image_std).view(1, 3, 1, 1)
    torch.testing.assert_close(x, expected_x, atol=1e-5, rtol=0)
    with torch.no_grad():
        img = model.encode_image(x, normalize=True)
        txt = model.encode_text(tokenizer(TEXTS), normalize=True)
    torch.testing.assert_close(img, student.embed_images(pixels), atol=1e-4, rtol=0)
    torch.testing.assert_close(txt, student.embed_texts(TEXTS), atol=1e-4, rtol=0)
    assert float(model.logit_scale.detach().exp()) == pytest.approx(float(np.exp(3.0)), rel=1e-6)
    assert tokenizer(TEXTS).shape == (3, student.context_length)


def test_export_works_as_an_openclip_teacher(exported, monkeypatch):
    from cxrdr.teachers import load_teacher

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student, out, _ = exported["tiny-A"]
    teacher = load_teacher(f"openclip:local-dir:{out}")
    assert teacher.kind == "clip" and teacher.embed_dim == 64 and teacher.image_size == 64
    assert teacher.mean == pytest.approx(tuple(student.config.image_mean))
    crops = torch.rand(4, 1, 64, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(teacher.encode_images(crops), student.embed_images(crops), atol=1e-4, rtol=0)
    torch.testing.assert_close(teacher.encode_texts(TEXTS), student.embed_texts(TEXTS), atol=1e-4, rtol=0)


def test_export_names_its_timm_architecture(exported):
    """timm towers keep their timm name (loadable without cxrdr); the others are cxrdr_image_tower."""
    import json

    arch = {name: json.loads((out / "vision" / "config.json").read_text())["architecture"]
            for name, (_, out, _) in exported.items()}
    assert arch == {"tiny-A": "vit_tiny_patch16_224", "tiny-D": "vit_tiny_patch16_224",
                    "cpu-E": "cxrdr_image_tower", "tiny-cnn-D": "cxrdr_image_tower"}
    # the folder says how to load it, and that cxrdr's tower needs cxrdr imported first
    notes = {name: (out / "README.md").read_text() for name, (_, out, _) in exported.items()}
    assert "import cxrdr.train.models" in notes["cpu-E"] and "import cxrdr.train.models" not in notes["tiny-A"]
    assert all(f"local-dir:{out.resolve()}" in notes[name] for name, (_, out, _) in exported.items())


def test_exported_e_drops_tokens_as_the_student_does(exported, monkeypatch):
    """The exported E keeps its target share of tokens, picked by its Patch-IB mask heads, which travel
    with the tower: its embeddings are the dropping student's, not those of the same weights with every
    token kept."""
    import open_clip

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student, out, _ = exported["cpu-E"]
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    model.eval()
    tower = model.visual.trunk.tower
    assert tower.keep_rate == student.config.keep_rate == 0.4
    assert student.drops_by_mask and model.visual.trunk.mask_head is not None  # the mask picks the tokens
    images = torch.rand(4, 1, student.image_size, student.image_size, generator=torch.Generator().manual_seed(2))
    x = student.prepare_images(images)
    with torch.no_grad():
        dropped = model.encode_image(x, normalize=True)
        tower.keep_rate = 1.0
        kept_all = model.encode_image(x, normalize=True)
    torch.testing.assert_close(dropped, student.embed_images(images), atol=1e-4, rtol=0)
    assert float((dropped - kept_all).abs().max()) > 1e-3


def test_export_works_as_a_teacher_through_the_timm_entry_point(exported, monkeypatch):
    """openclip:local-dir: of a cxrdr_image_tower export: the teacher loader registers the architecture
    (entry point cxrdr.timm_models) before open_clip builds it."""
    from importlib.metadata import entry_points

    from cxrdr.teachers import load_teacher

    assert [ep.value for ep in entry_points(group="cxrdr.timm_models")] == ["cxrdr.train.models.timm_adapter"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student, out, _ = exported["tiny-cnn-D"]
    teacher = load_teacher(f"openclip:local-dir:{out}")
    crops = torch.rand(2, 1, 96, 96, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(teacher.encode_images(crops), student.embed_images(crops), atol=1e-4, rtol=0)


def test_export_refuses_bad_input_and_checks_its_output(exported, tmp_path):
    from typer.testing import CliRunner

    from cxrdr.train.cli import app
    from cxrdr.train.export import check_export
    from cxrdr.train.models import build_student

    result = CliRunner().invoke(app, ["export", str(tmp_path / "missing.pt"), "--out", str(tmp_path / "e")])
    assert result.exit_code != 0 and "checkpoint not found" in str(result.output) + str(result.exception)
    assert not (tmp_path / "e").exists()
    _, out, _ = exported["tiny-A"]
    result = CliRunner().invoke(app, ["export", str(out.parent / "tiny-A.pt"), "--out", str(tmp_path / "x"),
                                      "--format", "onnx"])
    assert result.exit_code != 0 and "--format must be one of open_clip" in str(result.output) + str(result.exception)

    student, out, _ = exported["tiny-A"]
    other = build_student("tiny-A")  # different weights: the check must notice
    with pytest.raises(ValueError, match="export check failed"):
        check_export(other, out)


LOAD_MOVED = r"""
import sys
import torch
import cxrdr.train.models  # noqa: F401  (resolves the export's relative paths; registers cxrdr_image_tower)
import open_clip

inputs = torch.load(sys.argv[1])
out = {}
for name, folder in inputs["folders"].items():
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    model.eval()
    with torch.no_grad():
        out[name] = (model.encode_image(inputs["images"][name], normalize=True),
                     model.encode_text(tokenizer(inputs["texts"]), normalize=True))
torch.save(out, sys.argv[2])
"""


def test_moved_export_loads_in_a_fresh_process_with_the_students_embeddings(exported, tmp_path):
    """Issue 25 (3): an export moved elsewhere (the place it was written gone) loads with open_clip in
    a fresh process that imports cxrdr.train.models, from a working directory that is neither place,
    and gives the student's embeddings: a timm ViT export and a cxrdr_image_tower one."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from cxrdr.train.export import export_open_clip

    repo = Path(__file__).resolve().parents[1]
    folders, images = {}, {}
    for name in ("tiny-A", "tiny-cnn-D"):
        student, fixture_out, _ = exported[name]
        written = tmp_path / "written" / name
        export_open_clip(fixture_out.parent / f"{name}.pt", written)
        moved = tmp_path / "elsewhere" / f"{name}-moved"
        moved.parent.mkdir(exist_ok=True)
        shutil.move(str(written), str(moved))
        assert not written.exists()
        config = json.loads((moved / "open_clip_config.json").read_text())
        assert config["cxrdr_relative_paths"]["vision_cfg"]["timm_model_name"] == "local-dir:vision"
        folders[name] = str(moved)
        pixels = torch.rand(3, 1, student.image_size, student.image_size, generator=torch.Generator().manual_seed(5))
        images[name] = student.prepare_images(pixels)
        images[name + "/pixels"] = pixels
    shutil.rmtree(tmp_path / "written")
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save({"folders": folders, "images": images, "texts": TEXTS}, inputs)
    work = tmp_path / "cwd"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", LOAD_MOVED, str(inputs), str(outputs)], cwd=work, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(outputs)
    for name in folders:
        student = exported[name][0]
        image, text = loaded[name]
        torch.testing.assert_close(image, student.embed_images(images[name + "/pixels"]), atol=1e-4, rtol=0)
        torch.testing.assert_close(text, student.embed_texts(TEXTS), atol=1e-4, rtol=0)


def test_relative_paths_resolve_against_the_folder_only_when_declared(tmp_path):
    """Only a local-dir config with cxrdr_relative_paths is touched; its fields resolve against the folder."""
    from cxrdr.train.models import openclip_paths

    config = {"model_cfg": {"vision_cfg": {"timm_model_name": "local-dir:/old/vision", "timm_pool": "avg"},
                            "text_cfg": {"hf_model_name": "/old/text", "context_length": 16}},
              openclip_paths.KEY: openclip_paths.relative_paths()}
    towers = openclip_paths.resolve_towers(tmp_path, config)
    assert towers["vision_cfg"] == {"timm_model_name": f"local-dir:{tmp_path.resolve() / 'vision'}", "timm_pool": "avg"}
    assert towers["text_cfg"]["hf_model_name"] == towers["text_cfg"]["hf_tokenizer_name"] == str(tmp_path.resolve() / "text")
    assert towers["text_cfg"]["context_length"] == 16
    assert openclip_paths.resolve_towers(tmp_path, {"model_cfg": config["model_cfg"]}) == {}
    import open_clip

    assert open_clip.create_model.resolves_relative_paths and open_clip.factory.create_model is open_clip.create_model
