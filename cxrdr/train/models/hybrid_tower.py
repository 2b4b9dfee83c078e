"""A MobileCLIP-MCi-style hybrid image tower that learns in CPU minutes and still supports variant E.

The first stages of the ImageNet EfficientNet-Lite0 (offline package weights) are a convolutional
stem down to stride 8 or 16; a few transformer blocks then run on its grid of tokens. The whole
thing is a timm ``VisionTransformer`` whose patch embedding is timm's ``HybridEmbed`` around that
stem (a 1x1 projection of the CNN features, as in timm's ``vit_*_r50`` hybrids), so it gets
timm's [CLS] token, position embeddings, blocks and final norm, and the ViT wrappers of
``image_towers`` (``ViTTower``) and ``token_dropping`` (``TokenDroppingViT``) run it unchanged:
tokens are dropped after transformer block L1 exactly as in a plain ViT.

Why a hybrid: a from-scratch ViT stays at chance on a few thousand CPU steps (the pretrained CNN
stem supplies the low-level features), and the pure CNN tower has no token sequence to drop.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from timm.layers import HybridEmbed
from timm.models.vision_transformer import VisionTransformer

from cxrdr.common.pretrained import IMAGENET_MEAN, IMAGENET_STD, create_efficientnet_lite
from cxrdr.train.models.frozen_memo import RowMemo, memo_applies, through_memo
from cxrdr.train.models.image_towers import parameters_to_buffers
from cxrdr.train.models.registry import register_tower

# Stem cut points of efficientnet_lite0 by output stride: number of its 7 stages kept.
LITE0_STEM_STAGES = {8: 3, 16: 5}


class FrozenStem(nn.Module):
    """Wraps a CNN stem whose weights are buffers: always in eval mode, so its BatchNorm keeps the
    ImageNet statistics, and run without autograd, so no backward pass goes through it."""

    def __init__(self, stem: nn.Module):
        super().__init__()
        parameters_to_buffers(stem)
        # channels_last: the depthwise convolutions run ~1.6x faster on CPU (oneDNN), same values
        self.stem = stem.to(memory_format=torch.channels_last)
        self.output_memo: RowMemo | None = None  # the training loop's (frozen_memo.enable_memos), CPU only
        self.train(False)

    def train(self, mode: bool = True) -> "FrozenStem":
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if memo_applies(self.output_memo, x):
                return through_memo(self.output_memo, self._features, x, self.stem)
            return self._features(x)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x.contiguous(memory_format=torch.channels_last)).contiguous()


def lite0_stem(stride: int, pretrained: bool, frozen: bool) -> nn.Module:
    """conv_stem + bn1 + the first stages of efficientnet_lite0, output stride ``stride``."""
    if stride not in LITE0_STEM_STAGES:
        raise ValueError(f"hybrid_lite0_vit: stem_stride must be one of {sorted(LITE0_STEM_STAGES)}, got {stride}")
    cnn = create_efficientnet_lite("efficientnet_lite0", pretrained)
    stem = nn.Sequential(cnn.conv_stem, cnn.bn1, *cnn.blocks[:LITE0_STEM_STAGES[stride]])
    return FrozenStem(stem) if frozen else stem


def create_hybrid_vit(image_size: int, drop_path_rate: float = 0.0, *, stem_stride: int = 8, width: int = 128,
                      depth: int = 4, num_heads: int = 4, mlp_ratio: float = 2.0, pretrained: bool = True,
                      freeze_stem: bool = True) -> nn.Module:
    """A timm VisionTransformer on the Lite0 stem's (image_size / stem_stride)^2 grid, no classifier."""
    if image_size % stem_stride:
        raise ValueError(f"hybrid_lite0_vit: image_size {image_size} is not a multiple of stem_stride {stem_stride}")
    stem = lite0_stem(stem_stride, pretrained, freeze_stem)
    vit = VisionTransformer(img_size=image_size, patch_size=1, num_classes=0, embed_dim=width, depth=depth,
                            num_heads=num_heads, mlp_ratio=mlp_ratio, drop_path_rate=drop_path_rate,
                            embed_layer=partial(HybridEmbed, backbone=stem))
    # The stem's ImageNet normalisation is the tower's (ViTTower reads timm's pretrained_cfg).
    vit.pretrained_cfg = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    return vit


@register_tower("hybrid_lite0_vit", token_sequence=True)
def _create_hybrid(config, load_pretrained: bool) -> nn.Module:
    """``load_pretrained=False`` skips the packaged stem weights (a checkpoint's weights replace them)."""
    kwargs = dict(config.image_kwargs or {})
    kwargs["pretrained"] = bool(kwargs.get("pretrained", True)) and load_pretrained
    return create_hybrid_vit(config.image_size, config.drop_path_rate, **kwargs)
