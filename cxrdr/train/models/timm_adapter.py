"""Any student's image tower as a timm model, so open_clip can build it from a config.

open_clip builds an image tower from a config only through timm (``vision_cfg.timm_model_name``).
Towers that are timm architectures as they are (ViTs, ``fastvit_mci0``, a stride-32
``efficientnet_lite0``) are exported under their timm names. The others — the hybrid Lite0-ViT of
the CPU ladder, a stride-16 EfficientNet cut, variant E's token-dropping ViT — are exported as
``cxrdr_image_tower``, registered here in timm's registry: its ``model_args`` are the student's
config, and it builds the same tower cxrdr trains (E drops tokens at its target keep rate, as the
student does at evaluation; an E whose Patch-IB mask picks the tokens carries that mask's heads)
and returns the pooled global token, which open_clip projects.

Importing ``cxrdr.train.models`` registers it; open_clip users import that first, and cxrdr's own
``openclip:local-dir:`` teacher finds it through the ``cxrdr.timm_models`` entry point.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from timm.models import register_model

from cxrdr.train.models.config import StudentConfig
from cxrdr.train.models.factory import build_image_tower
from cxrdr.train.models.heads import build_patch_heads
from cxrdr.train.models.token_dropping import mask_selected_forward

ARCHITECTURE = "cxrdr_image_tower"
# timm's create_model hands every entrypoint these; the tower's weights come from the export instead
_TIMM_ONLY_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "pretrained_model_args", "cache_dir", "drop_rate",
                     "drop_path_rate")


class TimmImageTower(nn.Module):
    """A cxrdr ``ImageTower`` behind timm's model interface: ``forward`` returns the pooled global token
    (B, width); no classifier (``num_classes`` 0), as open_clip's ``TimmModel`` asks for."""

    def __init__(self, tower: nn.Module, image_size: int, mean, std, head_conv: nn.Module | None = None,
                 mask_head: nn.Module | None = None):
        super().__init__()
        self.tower = tower
        # E with patch_score 'mask': the student's mask heads choose the tokens (mask_selected_forward)
        self.head_conv, self.mask_head = head_conv, mask_head
        self.num_classes = 0
        self.num_features = int(tower.width)
        self.pretrained_cfg = self.default_cfg = {"input_size": (3, image_size, image_size),
                                                  "mean": tuple(mean), "std": tuple(std)}

    def reset_classifier(self, num_classes: int = 0, global_pool: str | None = None) -> None:
        if num_classes:
            raise ValueError(f"{ARCHITECTURE} has no classifier; open_clip projects its pooled token")
        if global_pool not in (None, "", getattr(self.tower, "global_pool", None)):
            raise ValueError(f"{ARCHITECTURE} pools as its student did ({getattr(self.tower, 'global_pool', 'avg')}), "
                             f"not {global_pool!r}")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask_head is not None:
            return mask_selected_forward(self.tower, self.head_conv, self.mask_head, x)[0].pooled
        return self.tower(x).pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x)


@register_model
def cxrdr_image_tower(pretrained: bool = False, student: dict | None = None, **kwargs) -> TimmImageTower:
    """``student``: the exporting student's config (``StudentConfig.to_dict()``)."""
    if pretrained:
        raise ValueError(f"{ARCHITECTURE} has no pretrained weights of its own: they are in the export")
    if not student:
        raise ValueError(f"{ARCHITECTURE} needs model_args {{'student': <the student's config>}}")
    unknown = sorted(set(kwargs) - set(_TIMM_ONLY_KWARGS) - {"num_classes", "global_pool"})
    if unknown:
        raise ValueError(f"{ARCHITECTURE}: unexpected arguments {unknown}")
    if kwargs.get("num_classes"):
        raise ValueError(f"{ARCHITECTURE} has no classifier (num_classes must be 0)")
    config = StudentConfig.from_dict(student, source=ARCHITECTURE)
    tower = build_image_tower(config, load_pretrained=False)
    heads = (None, None)
    if config.use_token_dropping and config.patch_score == "mask":
        heads = build_patch_heads(config, tower.width, tower.grid_size)
    model = TimmImageTower(tower, config.image_size, tower.mean, tower.std, *heads)
    model.reset_classifier(0, kwargs.get("global_pool"))
    return model.eval()
