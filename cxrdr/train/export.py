"""`train export CKPT --format open_clip --out DIR`: a student's global CLIP part as an open_clip model.

DIR is an open_clip ``local-dir:`` model, loadable with
``open_clip.create_model_and_transforms('local-dir:DIR')`` and usable as a cxrdr teacher
(``openclip:local-dir:DIR``) or with ``open_clip_train --model local-dir:DIR``::

    open_clip_config.json        {"model_cfg": ..., "preprocess_cfg": ...}
    open_clip_model.safetensors  image tower + projection, text tower + projection, logit scale
    tokenizer files              the student's HF tokenizer (open_clip reads them from DIR itself)
    vision/config.json           timm model config (architecture + model_args) of the image tower
    text/config.json             HF config (+ tokenizer) of the text tower

open_clip builds the image tower with timm (``timm_model_name: local-dir:DIR/vision``, pooling and a
bias-free linear projection as the student has) and the text tower with transformers
(``hf_model_name: DIR/text``, CLS or mean pooling, bias-free linear projection). Those two names
are the absolute paths of the place DIR was written (open_clip alone loads it there); the same paths
relative to DIR are under ``cxrdr_relative_paths``, which ``import cxrdr.train.models`` makes
open_clip resolve against the folder a model is loaded from (``cxrdr.train.models.openclip_paths``):
with cxrdr imported, DIR can be moved or copied and still loads.

The student feeds 1-channel images in [0, 1] expanded to 3 channels and normalised by its
mean/std; open_clip's preprocess converts to RGB (three equal channels), scales to [0, 1] and
normalises with ``preprocess_cfg`` mean/std, which are the student's: the same tensor.

Only the global CLIP part is exported (no mask head, local alignment). An image tower that is a
timm architecture as it is (ViT, fastvit_mci0, stride-32 efficientnet_lite0) is exported under its timm
name; any other (the CPU ladder's hybrid Lite0-ViT, a stride-16 EfficientNet cut, variant E with its
token dropping) as ``cxrdr_image_tower`` (``cxrdr.train.models.timm_adapter``), which timm knows once
``cxrdr.train.models`` is imported: ``import cxrdr.train.models`` before open_clip builds such an
export (cxrdr's ``openclip:`` teacher does it itself). Every export is checked by loading it with
open_clip and comparing embeddings with the student's.
"""
from __future__ import annotations

import json
from pathlib import Path

import open_clip
import torch
from safetensors.torch import save_file

from cxrdr.common.errors import UserError
from cxrdr.teachers.openclip import forced_offline
from cxrdr.common.pretrained import TIMM_ARCH
from cxrdr.train.checkpoint import load_checkpoint
from cxrdr.train.models.image_towers import TIMM_VIT_NAMES, VIT_MICRO
from cxrdr.train.models.openclip_paths import KEY as RELATIVE_KEY, relative_paths
from cxrdr.train.models.timm_adapter import ARCHITECTURE

FORMATS = ("open_clip",)
WEIGHTS_NAME = "open_clip_model.safetensors"
CHECK_TOLERANCE = 1e-4  # max abs difference of normalised embeddings, student vs exported model


def native_timm_tower(config) -> tuple[str, dict, str] | None:
    """(timm architecture, model_args, pool) when the image tower is a timm model as it is, else None."""
    kwargs = dict(config.image_kwargs or {})
    name = config.image_tower
    if config.use_token_dropping:
        return None
    if name == "vit_micro" or name in TIMM_VIT_NAMES:
        # timm applies the final norm to every token and then pools when fc_norm is off, as the student does
        arch = "vit_tiny_patch16_224" if name == "vit_micro" else TIMM_VIT_NAMES[name]
        args = {**(VIT_MICRO if name == "vit_micro" else {}), **kwargs, "img_size": config.image_size,
                "num_classes": 0, "global_pool": config.global_pool, "fc_norm": False}
        return arch, args, config.global_pool
    if name == "fastvit_mci0":
        return name, {**kwargs, "num_classes": 0}, "avg"
    if name == "efficientnet_lite0" and int(kwargs.get("stride", 16)) == 32:
        args = {k: v for k, v in kwargs.items() if k not in ("pretrained", "stride", "freeze_stages")}
        return TIMM_ARCH[name], {**args, "num_classes": 0}, "avg"
    return None


def vision_config(student) -> tuple[dict, dict]:
    """(timm local-dir config.json, open_clip vision_cfg) of the student's image tower: its timm
    architecture when it is one, else ``cxrdr_image_tower`` built from the student's config."""
    config = student.config
    native = native_timm_tower(config)
    if native is None:
        # the teacher heads are training-only: the exported tower is built without them
        arch, args, pool = ARCHITECTURE, {"student": {**config.to_dict(), "teacher_dims": {}}}, ""
    else:
        arch, args, pool = native
    timm_cfg = {"architecture": arch, "num_classes": 0, "global_pool": pool, "model_args": args,
                "pretrained_cfg": {"input_size": [3, config.image_size, config.image_size],
                                   "mean": config.image_mean, "std": config.image_std}}
    return timm_cfg, {"timm_model_pretrained": False, "timm_pool": pool, "timm_proj": "linear",
                      "timm_proj_bias": False, "image_size": config.image_size}


def open_clip_config(student, out_dir: Path) -> dict:
    _, vision = vision_config(student)
    pool = student.text_tower.pool
    return {
        "model_cfg": {
            "embed_dim": student.embed_dim,
            "custom_text": True,
            "vision_cfg": {"timm_model_name": f"local-dir:{(out_dir / 'vision').resolve()}", **vision},
            "text_cfg": {"hf_model_name": str((out_dir / "text").resolve()),
                         "hf_tokenizer_name": str((out_dir / "text").resolve()),
                         "hf_model_pretrained": False,
                         "hf_pooler_type": "mean_pooler" if pool == "mean" else "cls_last_hidden_state_pooler",
                         "hf_proj_type": "linear", "context_length": student.context_length},
        },
        "preprocess_cfg": {"size": student.image_size, "mode": "RGB", "mean": student.config.image_mean,
                           "std": student.config.image_std, "interpolation": "bilinear",
                           "resize_mode": "shortest"},
        RELATIVE_KEY: relative_paths("vision", "text"),
    }


def open_clip_state_dict(student) -> dict[str, torch.Tensor]:
    """Student parameter names -> open_clip CustomTextCLIP names (TimmModel + HFTextEncoder)."""
    state = student.state_dict()
    image = (("image_tower.trunk.", "visual.trunk.") if native_timm_tower(student.config) is not None
             else ("image_tower.", "visual.trunk.tower."))  # TimmImageTower holds the whole cxrdr tower
    renames = [image, ("image_proj.proj.", "visual.head.proj."),
               ("text_tower.model.", "text.transformer."), ("text_proj.proj.", "text.proj.")]
    if student.drops_by_mask:  # the mask heads choose E's tokens: TimmImageTower carries them
        renames += [("head_conv.", "visual.trunk.head_conv."), ("mask_head.", "visual.trunk.mask_head.")]
    out = {"logit_scale": state["logit_scale"]}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                out[new + key[len(old):]] = value.detach().contiguous().clone()
    return out


def check_export(student, out_dir: Path) -> float:
    """Load DIR with open_clip and return the max embedding difference to the student (raises if large)."""
    with forced_offline():
        model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out_dir}")
        tokenizer = open_clip.get_tokenizer(f"local-dir:{out_dir}")
    model.eval()
    student.eval()
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(3, 1, student.image_size, student.image_size, generator=gen)
    texts = ["no acute cardiopulmonary process", "small left pleural effusion", "mild cardiomegaly"]
    mean = torch.tensor(student.config.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(student.config.image_std).view(1, 3, 1, 1)
    with torch.no_grad():
        ours = torch.cat([student.embed_images(images), student.embed_texts(texts)])
        theirs = torch.cat([model.encode_image((images.expand(-1, 3, -1, -1) - mean) / std, normalize=True),
                            model.encode_text(tokenizer(texts), normalize=True)])
    diff = float((ours - theirs).abs().max())
    if diff > CHECK_TOLERANCE or not torch.allclose(model.logit_scale, student.logit_scale):
        raise ValueError(f"export check failed: open_clip model in {out_dir} differs from the student "
                         f"(max embedding difference {diff:.2e} > {CHECK_TOLERANCE})")
    return diff


def loading_note(student, out_dir: Path, architecture: str) -> str:
    """DIR/README.md: what the folder is and how to load it."""
    needs_cxrdr = architecture == ARCHITECTURE
    return "\n".join([
        f"# open_clip export of cxrdr student {student.config.name or student.variant}", "",
        f"Image tower: `{student.config.image_tower}` as timm `{architecture}`; text tower: "
        f"`{student.config.text_tower}` (transformers, `text/`); embedding dimension {student.embed_dim}.", "",
        "```python",
        *(["import cxrdr.train.models  # registers cxrdr_image_tower with timm"] if needs_cxrdr else []),
        "import open_clip",
        f"model, _, preprocess = open_clip.create_model_and_transforms('local-dir:{out_dir.resolve()}')",
        f"tokenizer = open_clip.get_tokenizer('local-dir:{out_dir.resolve()}')",
        "```", "",
        f"As a cxrdr teacher: `reinforce build --teachers openclip:local-dir:{out_dir.resolve()} ...`.",
        "The tower paths in `open_clip_config.json` (`model_cfg`) are absolute, for open_clip alone in this "
        "place. Moved or copied elsewhere, the folder still loads once cxrdr's `cxrdr.train.models` is imported: "
        "it resolves `cxrdr_relative_paths` (the same files, relative to this folder) against the folder "
        "open_clip loads.", ""])


def export_open_clip(checkpoint: str | Path, out_dir: str | Path, check: bool = True) -> dict:
    """Write the student of ``checkpoint`` as an open_clip local-dir model; returns a summary."""
    out_dir = Path(out_dir)
    student = load_checkpoint(checkpoint)
    timm_cfg, _ = vision_config(student)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vision").mkdir(exist_ok=True)
    (out_dir / "vision" / "config.json").write_text(json.dumps(timm_cfg, indent=1))
    text_dir = out_dir / "text"
    student.text_tower.model.config.save_pretrained(text_dir)
    hf_tokenizer = student.tokenizer.tokenizer
    hf_tokenizer.model_max_length = student.context_length
    for folder in (text_dir, out_dir):  # open_clip reads a local-dir model's tokenizer from DIR itself
        hf_tokenizer.save_pretrained(folder)
    (out_dir / "open_clip_config.json").write_text(json.dumps(open_clip_config(student, out_dir), indent=1))
    (out_dir / "README.md").write_text(loading_note(student, out_dir, timm_cfg["architecture"]))
    save_file(open_clip_state_dict(student), str(out_dir / WEIGHTS_NAME),
              metadata={"format": "pt", "source": f"cxrdr student {student.config.name or ''}".strip()})
    summary = {"out": str(out_dir), "variant": student.variant, "image_tower": student.config.image_tower,
               "text_tower": student.config.text_tower, "embed_dim": student.embed_dim}
    if check:
        summary["max_embedding_difference"] = check_export(student, out_dir)
    return summary
