"""open_clip teachers: ``biomedclip`` and ``openclip:ARCH[:PRETRAINED_OR_PATH]``.

BiomedCLIP is loaded either from the HF hub (``hf-hub:microsoft/BiomedCLIP-...``, only when
the hub is reachable and ``HF_HUB_OFFLINE`` is unset) or, preferably, from a local snapshot
through open_clip's ``local-dir:`` schema. A snapshot is a directory holding::

    open_clip_config.json        {"model_cfg": {...}, "preprocess_cfg": {...}}
    open_clip_model.safetensors  (or open_clip_pytorch_model.bin)
    tokenizer files              vocab.txt, tokenizer.json, tokenizer_config.json, special_tokens_map.json
    config.json                  optional: config of the HF text model (see below)

It is looked for in this order: ``biomedclip:DIR``; under ``--model-cache DIR`` (DIR itself,
DIR/BiomedCLIP-PubMedBERT_256-vit_base_patch16_224, DIR/microsoft/..., DIR/biomedclip, or a HF
cache layout inside DIR); ``$CXRDR_CACHE/biomedclip``; the default HF cache. Get one with
``huggingface-cli download microsoft/BiomedCLIP-PubMedBERT_256-vit_base_patch16_224 --local-dir DIR``.

The snapshot's text tower names a *hub* model (``hf_model_name``: BiomedBERT) whose
config.json open_clip fetches at build time even when all weights are local. Offline we
resolve that config locally instead: a local dir, the snapshot's config.json, the HF cache,
or, failing those, a BERT config inferred from the checkpoint's tensor shapes (heads =
hidden/64, the BERT-family convention; BiomedBERT-base is exactly BERT-base). The resolved
config is written under ``$CXRDR_CACHE/hf-configs`` and handed to open_clip as a local dir.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from cxrdr.common.patch_conv import swap_patch_convs
from cxrdr.common.pretrained import cache_root

from .base import Teacher, TeacherError, file_safe_name, weights_fingerprint

BIOMEDCLIP_REPO = "microsoft/BiomedCLIP-PubMedBERT_256-vit_base_patch16_224"
CLIP_SCALE_MAX = 100.0
CHECKPOINT_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                    "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth")
RANDOM_INIT_SEED = 0
TIMM_PLUGIN_GROUP = "cxrdr.timm_models"


@dataclass
class OpenClipTeacher(Teacher):
    model: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)

    def _encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images)

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        return self._encode_tokens(self.text_tokenizer()(texts))

    def text_tokenizer(self):
        # open_clip's own tokenizer (SimpleTokenizer's BPE is pure Python: ~0.14 ms a text, as much CPU as a
        # ViT-B/16 forward of the text on a GPU), padded to the context length, so any batch concatenates
        return functools.partial(self.tokenizer, context_length=self.context_length)

    def _encode_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.encode_text(tokens.to(self.device, non_blocking=True))


# ---------------------------------------------------------------- hub access, never hanging
def hub_offline() -> bool:
    """True when the user asked for offline mode (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on")
               for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub endpoint (a proxy setting counts as reachable).

    huggingface_hub retries unreachable hosts for ~25 s; this check lets us fail at once.
    """
    if hub_offline():
        return False
    if any(os.environ.get(key) for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def forced_offline():
    """Make huggingface_hub/transformers resolve from local files only, for the duration."""
    import huggingface_hub.constants as hub_constants
    saved = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = saved


def hf_cache_dir() -> str:
    import huggingface_hub.constants as hub_constants
    return hub_constants.HF_HUB_CACHE


# ---------------------------------------------------------------- building the teacher
def teacher_from_model(model, tokenizer, *, name: str, spec: str, device: str, notes: dict,
                       options: dict) -> OpenClipTeacher:
    """Wrap a created open_clip model: read its input size, normalisation and logit scale. Its patch embedding
    runs as one matrix product on a GPU (``cxrdr.common.patch_conv``: the same parameters and fingerprint)."""
    model.eval().requires_grad_(False)
    swap_patch_convs(model.visual)
    cfg = dict(getattr(model.visual, "preprocess_cfg", None) or {})
    size = cfg.get("size", getattr(model.visual, "image_size", 224))
    if isinstance(size, (tuple, list)):
        if len(set(size)) != 1:
            raise TeacherError(f"teacher {spec!r}: non-square input size {tuple(size)} is not supported")
        size = size[0]
    mean = tuple(float(v) for v in cfg.get("mean", (0.48145466, 0.4578275, 0.40821073)))
    std = tuple(float(v) for v in cfg.get("std", (0.26862954, 0.26130258, 0.27577711)))
    model_scale = float(model.logit_scale.detach().float().exp().item()) \
        if getattr(model, "logit_scale", None) is not None else CLIP_SCALE_MAX
    context_length = int(options.get("context_length") or getattr(tokenizer, "context_length", 0)
                         or getattr(model, "context_length", 77))
    teacher = OpenClipTeacher(
        name=name, spec=spec, kind="clip", embed_dim=0, logit_scale=min(model_scale, CLIP_SCALE_MAX),
        context_length=context_length, fingerprint=weights_fingerprint(model), image_size=int(size),
        mean=mean, std=std, device=str(device),
        notes={**notes, "model_logit_scale": round(model_scale, 4)}, model=model, tokenizer=tokenizer)
    teacher.embed_dim = int(teacher.encode_texts(["x"]).shape[-1])
    return teacher


def register_timm_plugins() -> None:
    """Import the modules that register timm architectures (entry points ``cxrdr.timm_models``): an
    open_clip model exported by ``train export`` may name cxrdr's own image tower as its timm model."""
    for entry_point in entry_points(group=TIMM_PLUGIN_GROUP):
        entry_point.load()


def _create(model_name: str, device: str, pretrained: str | None = None,
            cache_dir: str | None = None, **model_kwargs):
    import open_clip
    register_timm_plugins()
    model = open_clip.create_model(model_name, pretrained=pretrained, device=device,
                                   cache_dir=cache_dir, **model_kwargs)
    tokenizer = open_clip.get_tokenizer(model_name, cache_dir=cache_dir)
    return model, tokenizer


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------- openclip:ARCH[:PRETRAINED_OR_PATH]
def load_openclip(arg: str, spec: str, device: str = "cpu", model_cache: str | None = None,
                  options: dict | None = None) -> OpenClipTeacher:
    import open_clip
    options = options or {}
    if arg.startswith(("local-dir:", "hf-hub:")):
        arch, pretrained = arg, None
        ident = arg.split(":", 1)[1]
        name = "openclip-" + file_safe_name(Path(ident.rstrip("/")).name)
    else:
        arch, _, pretrained = arg.partition(":")
        pretrained = pretrained or None
        name = "openclip-" + file_safe_name(arch)
        if arch.replace("/", "-") not in open_clip.list_models():
            raise TeacherError(f"teacher {spec!r}: unknown open_clip architecture {arch!r} "
                               f"(see open_clip.list_models(), e.g. ViT-B-32, ViT-B-16)")
        if pretrained and not Path(pretrained).expanduser().is_file() \
                and pretrained not in open_clip.list_pretrained_tags_by_model(arch):
            raise TeacherError(f"teacher {spec!r}: {pretrained!r} is neither a weights file nor a pretrained "
                               f"tag of {arch} (tags: {', '.join(open_clip.list_pretrained_tags_by_model(arch)) or 'none'})")
        if pretrained and Path(pretrained).expanduser().is_file():
            pretrained = str(Path(pretrained).expanduser())
    needs_hub = arg.startswith("hf-hub:") or (pretrained and not Path(pretrained).is_file())
    offline = needs_hub and not hub_reachable()
    notes: dict = {"arch": arch}
    if pretrained:
        notes["pretrained"] = pretrained
    elif not arg.startswith(("local-dir:", "hf-hub:")):
        notes.update(random_init=True, test_only=True)
    try:
        with forced_offline() if offline else contextlib.nullcontext(), _seeded(RANDOM_INIT_SEED):
            model, tokenizer = _create(arch, device, pretrained=pretrained, cache_dir=model_cache)
    except Exception as err:  # open_clip raises RuntimeError/OSError/ValueError for missing files
        where = f"cache_dir={model_cache or hf_cache_dir()}"
        why = "hub unreachable or HF_HUB_OFFLINE set; " if offline else ""
        raise TeacherError(f"teacher {spec!r}: could not load open_clip weights ({why}{where}): "
                           f"{_first_line(err)}; download them on a machine with network or pass a "
                           f"local weights file: openclip:{arch}:/path/to/weights.pt") from err
    return teacher_from_model(model, tokenizer, name=name, spec=spec, device=device, notes=notes,
                              options=options)


@contextlib.contextmanager
def _seeded(seed: int):
    """Random-init weights are then identical run to run (stable fingerprints)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------- biomedclip
def _is_snapshot(path: Path) -> bool:
    return (path / "open_clip_config.json").is_file() and any((path / n).is_file() for n in CHECKPOINT_NAMES)


def _hf_cache_snapshot(cache_dir: str | Path | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache
    found = try_to_load_from_cache(BIOMEDCLIP_REPO, "open_clip_config.json",
                                   cache_dir=str(cache_dir) if cache_dir else None)
    if isinstance(found, str) and _is_snapshot(Path(found).parent):
        return Path(found).parent
    return None


def find_biomedclip_snapshot(arg: str = "", model_cache: str | None = None) -> tuple[Path | None, list[str]]:
    """Local BiomedCLIP snapshot dir, and the list of places looked at (for the error)."""
    looked: list[str] = []
    candidates: list[Path] = []
    if arg:  # an explicit directory: look only there, never fall back silently
        path = Path(arg).expanduser()
        return (path.resolve() if _is_snapshot(path) else None), [str(path)]
    repo_name = BIOMEDCLIP_REPO.split("/")[1]
    if model_cache:
        root = Path(model_cache).expanduser()
        candidates += [root, root / repo_name, root / BIOMEDCLIP_REPO, root / "biomedclip"]
    candidates.append(cache_root() / "biomedclip")
    for path in candidates:
        looked.append(str(path))
        if _is_snapshot(path):
            return path.resolve(), looked
    for cache in ([model_cache] if model_cache else []) + [None]:
        looked.append(f"HF cache {cache or hf_cache_dir()}")
        snapshot = _hf_cache_snapshot(cache)
        if snapshot is not None:
            return snapshot, looked
    return None, looked


def load_biomedclip(arg: str, spec: str, device: str = "cpu", model_cache: str | None = None,
                    options: dict | None = None) -> OpenClipTeacher:
    options = options or {}
    snapshot, looked = find_biomedclip_snapshot(arg, model_cache)
    if snapshot is not None:
        return _load_snapshot(snapshot, spec, device, options, model_cache)
    offline_env = hub_offline()
    if arg or offline_env or not hub_reachable():
        reason = (f"{arg} is not a BiomedCLIP snapshot (needs open_clip_config.json + open_clip weights)" if arg
                  else "HF_HUB_OFFLINE is set" if offline_env else "the HF hub is unreachable")
        raise TeacherError(
            f"teacher {spec!r}: BiomedCLIP weights not found ({reason}); looked in: {'; '.join(looked)}; "
            f"HF_HUB_OFFLINE={'set' if offline_env else 'unset'}. Provide them: on a machine with network run "
            f"`huggingface-cli download {BIOMEDCLIP_REPO} --local-dir DIR`, copy DIR here and use "
            f"--teachers biomedclip:DIR (or --model-cache PARENT_OF_DIR)")
    try:
        model, tokenizer = _create(f"hf-hub:{BIOMEDCLIP_REPO}", device, cache_dir=model_cache)
    except Exception as err:
        raise TeacherError(f"teacher {spec!r}: download of hf-hub:{BIOMEDCLIP_REPO} failed "
                           f"(cache_dir={model_cache or hf_cache_dir()}): {_first_line(err)}") from err
    return teacher_from_model(model, tokenizer, name="biomedclip", spec=spec, device=device,
                              notes={"source": f"hf-hub:{BIOMEDCLIP_REPO}"}, options=options)


def _load_snapshot(snapshot: Path, spec: str, device: str, options: dict,
                   model_cache: str | None) -> OpenClipTeacher:
    config = json.loads((snapshot / "open_clip_config.json").read_text())
    model_cfg = config.get("model_cfg", config)
    text_cfg = dict(model_cfg.get("text_cfg", {}))
    notes: dict = {"source": f"local-dir:{snapshot}"}
    model_kwargs: dict = {}
    tokenizer_files = ("tokenizer.json", "vocab.txt", "tokenizer_config.json")
    if text_cfg.get("hf_tokenizer_name") and not any((snapshot / n).is_file() for n in tokenizer_files):
        raise TeacherError(f"teacher {spec!r}: snapshot {snapshot} has no tokenizer files ({', '.join(tokenizer_files)}); "
                           f"copy those of {text_cfg['hf_tokenizer_name']} into it")
    if text_cfg.get("hf_model_name"):
        text_dir, how = resolve_hf_text_config(snapshot, text_cfg["hf_model_name"], model_cache, spec)
        notes["text_config"] = how
        if text_dir != text_cfg["hf_model_name"]:
            # weights come from the full checkpoint: build the text tower from config only
            model_kwargs["text_cfg"] = {**text_cfg, "hf_model_name": text_dir, "hf_model_pretrained": False}
    try:
        with forced_offline():  # everything is local now: never let a stray lookup hit the network
            model, tokenizer = _create(f"local-dir:{snapshot}", device, **model_kwargs)
    except Exception as err:
        raise TeacherError(f"teacher {spec!r}: cannot load BiomedCLIP snapshot {snapshot}: {_first_line(err)}") from err
    return teacher_from_model(model, tokenizer, name="biomedclip", spec=spec, device=device, notes=notes,
                              options=options)


def resolve_hf_text_config(snapshot: Path, hf_name: str, model_cache: str | None, spec: str) -> tuple[str, str]:
    """A local directory with the text tower's config.json, and how it was found."""
    from transformers import AutoConfig
    for path in (Path(hf_name).expanduser(), snapshot / hf_name):
        if (path / "config.json").is_file():
            return str(path.resolve()), f"local dir {path}"
    own = snapshot / "config.json"
    if own.is_file() and "model_type" in json.loads(own.read_text()):
        return str(snapshot), f"snapshot config.json"
    out_dir = cache_root() / "hf-configs" / file_safe_name(hf_name)
    try:
        with forced_offline():
            hf_config = AutoConfig.from_pretrained(hf_name, cache_dir=model_cache)
        how = f"HF cache ({hf_name})"
    except (OSError, ValueError):
        hf_config, how = infer_bert_config(snapshot, spec), f"inferred from weights (BERT, {hf_name} not cached)"
    hf_config.save_pretrained(out_dir)
    return str(out_dir), how


def infer_bert_config(snapshot: Path, spec: str):
    """BertConfig from the checkpoint's text-tower tensor shapes (heads = hidden // 64)."""
    from transformers import BertConfig
    shapes = _checkpoint_shapes(snapshot)
    prefix = "text.transformer."
    try:
        vocab, hidden = shapes[prefix + "embeddings.word_embeddings.weight"]
        positions = shapes[prefix + "embeddings.position_embeddings.weight"][0]
        types = shapes[prefix + "embeddings.token_type_embeddings.weight"][0]
        intermediate = shapes[prefix + "encoder.layer.0.intermediate.dense.weight"][0]
    except KeyError as err:
        raise TeacherError(f"teacher {spec!r}: the text tower in {snapshot} is not BERT-shaped ({err} missing) and "
                           f"its HF config is not available offline; put the text model's config.json in {snapshot}") from None
    layers = len({k.split(".")[4] for k in shapes if k.startswith(prefix + "encoder.layer.")})
    return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), intermediate_size=intermediate,
                      max_position_embeddings=positions, type_vocab_size=types)


def _checkpoint_shapes(snapshot: Path) -> dict[str, tuple[int, ...]]:
    for name in CHECKPOINT_NAMES:
        path = snapshot / name
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as handle:
                return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        state = state.get("state_dict", state)
        return {k.removeprefix("module."): tuple(v.shape) for k, v in state.items()}
    return {}
