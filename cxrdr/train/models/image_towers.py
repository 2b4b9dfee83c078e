"""Image towers: timm ViTs (any input size), timm ``fastvit_mci0`` (final-stage grid as patch tokens) and
timm ``efficientnet_lite0``/``lite2`` with ImageNet weights from their offline packages
(``cxrdr.common.pretrained`` (a pretrained CNN that learns fast on CPU; its stride-16 or stride-32 grid gives the patch tokens).

Every tower maps normalised (B, 3, H, W) images to a ``TowerOutput``: a global token, the patch tokens
(B, N, d) and their indices into the full patch grid (arange unless tokens were dropped).
"""
from __future__ import annotations

from dataclasses import dataclass

import timm
import torch
import torch.nn as nn
from timm.models import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from torch.utils.checkpoint import checkpoint

from cxrdr.common.patch_conv import swap_patch_convs
from cxrdr.common.pretrained import IMAGENET_MEAN, IMAGENET_STD, create_efficientnet_lite
from cxrdr.train.models.block_graphs import BlockGraphs
from cxrdr.train.models.frozen_memo import RowMemo, memo_applies, through_memo
from cxrdr.train.models.registry import register_tower

TIMM_VIT_NAMES = {"vit_tiny_patch16": "vit_tiny_patch16_224", "vit_small_patch16": "vit_small_patch16_224",
                  "vit_base_patch16": "vit_base_patch16_224"}
# A tiny ViT for tests and the CPU demo: 64 px -> 8x8 patches, 4 blocks of width 64.
VIT_MICRO = dict(patch_size=8, embed_dim=64, depth=4, num_heads=2, mlp_ratio=2.0)


@dataclass
class TowerOutput:
    tokens: torch.Tensor  # (B, T, d) all output tokens after the final norm ([CLS] + patches (+ fused))
    pooled: torch.Tensor  # (B, d) global image token before projection
    patches: torch.Tensor  # (B, N, d) patch tokens (kept ones only after token dropping)
    patch_index: torch.Tensor  # (B, N) long indices into the full grid
    keep_ratio: float = 1.0
    head_patches: torch.Tensor | None = None  # (B, N', d) patches at the heads' layer (None: ``patches``)
    head_index: torch.Tensor | None = None  # (B, N') their grid indices (None: ``patch_index``)


def create_timm_vit(name: str, image_size: int, drop_path_rate: float = 0.0, **kwargs) -> nn.Module:
    """A timm VisionTransformer without classifier at ``image_size`` (no pretrained download), its patch
    embedding one matrix product on a GPU (``cxrdr.common.patch_conv``)."""
    if name == "vit_micro":
        args = {**VIT_MICRO, **kwargs}
        patch = args["patch_size"]
        model = VisionTransformer(img_size=image_size, num_classes=0, drop_path_rate=drop_path_rate, **args)
    elif name in TIMM_VIT_NAMES:
        patch = kwargs.get("patch_size", 16)
        model = timm.create_model(TIMM_VIT_NAMES[name], pretrained=False, num_classes=0, img_size=image_size,
                                  drop_path_rate=drop_path_rate, **kwargs)
    else:
        raise ValueError(f"unknown ViT image tower {name!r}; expected vit_micro or one of {sorted(TIMM_VIT_NAMES)}")
    if image_size % patch:
        raise ValueError(f"image_size {image_size} is not a multiple of the patch size {patch} of {name}")
    if model.num_prefix_tokens != 1:
        raise ValueError(f"{name}: expected exactly one prefix ([CLS]) token, got {model.num_prefix_tokens}")
    swap_patch_convs(model.patch_embed)
    return model


class ImageTower(nn.Module):
    """Common bits: normalisation constants, grid size, parameter groups for layer-wise LR decay.

    ``group_matcher()`` is in timm's format over the trunk's names: ``stem`` (layer 0), ``blocks``
    (block/stage i: layer i + 1), everything unmatched after them (final norm / head: layer depth + 1).
    timm's own ViT matcher merges the final norm into the last block; here it keeps a layer of its own.
    """

    STEM: str
    BLOCKS: str

    trunk: nn.Module
    grid_size: tuple[int, int]
    width: int
    depth: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.trunk.set_grad_checkpointing(enable)

    def group_matcher(self, coarse: bool = False) -> dict:
        return dict(stem=self.STEM, blocks=[(self.BLOCKS, None)])

    @property
    def num_patches(self) -> int:
        return self.grid_size[0] * self.grid_size[1]


class ViTTower(ImageTower):
    """A timm ViT run as is: [CLS] (or mean of patches) as the global token, all patches kept."""

    STEM = r"^cls_token|reg_token|pos_embed|patch_embed|norm_pre"
    BLOCKS = r"^blocks\.(\d+)"

    def __init__(self, vit: nn.Module, global_pool: str = "token", head_layer: int | None = None):
        super().__init__()
        self.trunk = vit
        self.global_pool = global_pool
        if head_layer is not None and not 0 <= head_layer <= len(vit.blocks):
            raise ValueError(f"head_layer must be in 0..{len(vit.blocks)} for a {len(vit.blocks)}-block ViT, "
                             f"got {head_layer}")
        self.head_layer = head_layer
        self.grid_size = tuple(vit.patch_embed.grid_size)
        self.width = int(vit.embed_dim)
        self.depth = len(vit.blocks)
        cfg = getattr(vit, "pretrained_cfg", None) or {}
        self.mean = tuple(cfg.get("mean", (0.5, 0.5, 0.5)))
        self.std = tuple(cfg.get("std", (0.5, 0.5, 0.5)))
        self.block_graphs: BlockGraphs | None = None  # --cuda-graphs (the Trainer sets it; models/block_graphs.py)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Patch embedding + [CLS] + positional embedding (timm's _pos_embed): (B, 1+N, d)."""
        v = self.trunk
        return v.norm_pre(v.patch_drop(v._pos_embed(v.patch_embed(x))))

    def run_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.trunk, "grad_checkpointing", False) and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=False)
        return block(x)

    def finish(self, x: torch.Tensor, patch_index: torch.Tensor, n_patches: int, keep_ratio: float) -> TowerOutput:
        x = self.trunk.norm(x)
        patches = x[:, 1:1 + n_patches]
        pooled = x[:, 0] if self.global_pool == "token" else patches.mean(1)
        return TowerOutput(x, pooled, patches, patch_index, keep_ratio)

    def run_blocks(self, x: torch.Tensor, start: int, stop: int,
                   mark: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Blocks ``start``..``stop - 1`` on ``x``; returns their output and, where ``start < mark <= stop``, the
        tokens as they left block ``mark - 1`` (the heads' layer), else None. Each run between marks goes through
        ``block_graphs`` where it applies (one CUDA graph for the run), else block by block."""
        if mark is not None and start < mark < stop:
            marked, _ = self.run_blocks(x, start, mark)
            return self.run_blocks(marked, mark, stop)[0], marked
        if start < stop:
            graphs = self.block_graphs
            if graphs is not None and not getattr(self.trunk, "grad_checkpointing", False) \
                    and graphs.applies(self, x):
                x = graphs.run(self.trunk.blocks, start, stop, x, lambda t: self._eager_blocks(t, start, stop))
            else:
                x = self._eager_blocks(x, start, stop)
        return x, (x if mark is not None and start < mark == stop else None)

    def _eager_blocks(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for block in self.trunk.blocks[start:stop]:
            x = self.run_block(block, x)
        return x

    def forward(self, x: torch.Tensor, step: int | None = None) -> TowerOutput:
        embedded = self.embed(x)
        x, marked = self.run_blocks(embedded, 0, self.depth, self.head_layer)
        at_head_layer = embedded if self.head_layer == 0 else marked
        n = x.shape[1] - 1
        index = torch.arange(n, device=x.device).expand(x.shape[0], n)
        out = self.finish(x, index, n, 1.0)
        out.head_patches = head_tokens(at_head_layer, n)
        return out


    def last_block(self) -> nn.Module:
        return self.trunk.blocks[-1]



def head_tokens(x: torch.Tensor | None, n_patches: int) -> torch.Tensor | None:
    """Patch tokens of an intermediate layer ([CLS] first) for the heads, normalised without parameters
    (the final norm belongs to the last layer's statistics). None passes through."""
    if x is None:
        return None
    patches = x[:, 1:1 + n_patches]
    return torch.nn.functional.layer_norm(patches, patches.shape[-1:])


def grid_tokens(fmap: torch.Tensor) -> TowerOutput:
    """A CNN feature map (B, C, h, w) as patch tokens; the global token is their mean. No dropping."""
    patches = fmap.flatten(2).transpose(1, 2)
    n = patches.shape[1]
    index = torch.arange(n, device=fmap.device).expand(fmap.shape[0], n)
    return TowerOutput(patches, patches.mean(1), patches, index, 1.0)

class FastViTTower(ImageTower):
    """timm ``fastvit_mci0`` (MobileCLIP's image encoder): the final-stage grid (after final_conv)
    is the patch token set, its mean is the global token. Token dropping is not possible here."""

    STEM = r"^stem"
    BLOCKS = r"^stages\.(\d+)"

    def __init__(self, name: str, image_size: int, drop_path_rate: float = 0.0, **kwargs):
        super().__init__()
        if image_size % 32:
            raise ValueError(f"{name}: image_size must be a multiple of 32 (its stride), got {image_size}")
        self.trunk = timm.create_model(name, pretrained=False, num_classes=0, drop_path_rate=drop_path_rate, **kwargs)
        self.grid_size = (image_size // 32, image_size // 32)
        self.width = int(self.trunk.num_features)
        self.depth = len(self.trunk.stages)
        cfg = getattr(self.trunk, "pretrained_cfg", None) or {}
        self.mean = tuple(cfg.get("mean", (0.0, 0.0, 0.0)))
        self.std = tuple(cfg.get("std", (1.0, 1.0, 1.0)))

    def forward(self, x: torch.Tensor, step: int | None = None) -> TowerOutput:
        return grid_tokens(self.trunk.forward_features(x))


    def last_block(self) -> nn.Module:
        stage = self.trunk.stages[-1]
        return stage.blocks[-1] if hasattr(stage, "blocks") else stage


# timm feature stages by output stride: (blocks index, channels)
# lite0 16 (default): 112 channels, learned clearly faster than 32 in the CPU comparison (finer grid, less to adapt)
# 32: after conv_head + bn2 (the classifier's features); lite2 (wider and deeper): the phantom teachers' tower
EFFNET_STAGES = {"efficientnet_lite0": {16: (4, 112), 32: (6, 1280)},
                 "efficientnet_lite2": {16: (4, 120), 32: (6, 1280)}}


def parameters_to_buffers(module: nn.Module) -> None:
    """Turn every parameter under ``module`` into a buffer of the same name: frozen for good (optimisers,
    DDP and tower freeze/unfreeze stages never see it) while state_dict keys stay the same."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            delattr(sub, name)
            sub.register_buffer(name, param.detach())


class EfficientNetTower(ImageTower):
    """timm ``efficientnet_lite0`` or ``efficientnet_lite2`` (``arch``; ImageNet weights from its offline package unless ``pretrained: false``): the feature map at
    ``stride`` 16 (default; 112 channels, blocks up to stage 4) or 32 (1280 channels after conv_head) is the patch
    token grid, its mean the global token. ``freeze_stages`` N freezes the stem and the first N stages
    (their weights become buffers and their BN statistics stay fixed), which skips the backward pass
    through the high-resolution layers: cheaper CPU steps. Token dropping is not possible on a CNN.

    The packaged weights are TF-trained, so the trunk is timm's ``tf_efficientnet_lite*`` ('same' padding,
    BN eps 1e-3; ``cxrdr.common.pretrained.TIMM_ARCH``): with symmetric padding its feature grid would sit
    most of a patch off the pixels it describes. It classifies matplotlib's grace_hopper.jpg as military
    uniform / suit / bow tie (top-3)."""

    STEM = r"^conv_stem|bn1"
    BLOCKS = r"^blocks\.(\d+)"  # a stage per layer (timm's coarse grouping)

    def __init__(self, image_size: int, drop_path_rate: float = 0.0, pretrained: bool = True, stride: int = 16,
                 freeze_stages: int = 0, arch: str = "efficientnet_lite0", channels_last: bool = True, **kwargs):
        super().__init__()
        stages = EFFNET_STAGES[arch]
        if stride not in stages:
            raise ValueError(f"{arch}: stride must be one of {sorted(stages)}, got {stride}")
        if image_size % stride:
            raise ValueError(f"{arch}: image_size must be a multiple of its stride {stride}, got {image_size}")
        trunk = create_efficientnet_lite(arch, pretrained, drop_path_rate=drop_path_rate, **kwargs)
        last, width = stages[stride]
        trunk.reset_classifier(0)  # drop the ImageNet classifier (unused parameters upset DDP)
        if stride < 32:  # unused head parameters upset DDP too
            trunk.blocks = trunk.blocks[:last + 1]
            trunk.conv_head, trunk.bn2 = nn.Identity(), nn.Identity()
        # channels_last (as timm's train.py --channels-last): oneDNN's depthwise convolutions and their backward
        # run faster in it; the demo's tiny-cnn-A step 210 -> 168 ms on 2 CPU cores, its losses to float rounding.
        # ``channels_last: false`` keeps the default layout (benchmarks/cnn_layout.py times both, on CUDA too)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.trunk = trunk.to(memory_format=self.memory_format)
        self.stride = stride
        self.grid_size = (image_size // stride, image_size // stride)
        self.width = width
        self.depth = len(trunk.blocks)
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD  # the packaged weights' normalisation
        if not 0 <= freeze_stages < self.depth:
            raise ValueError(f"{arch}: freeze_stages must be in 0..{self.depth - 1}, got {freeze_stages}")
        self.frozen = [trunk.conv_stem, trunk.bn1, *trunk.blocks[:freeze_stages]] if freeze_stages else []
        for module in self.frozen:
            parameters_to_buffers(module)
        self.freeze_stages = freeze_stages
        if self.frozen:  # the training loop's memo of the frozen layers' outputs (frozen_memo.enable_memos), CPU only
            self.output_memo: RowMemo | None = None

    def train(self, mode: bool = True) -> "EfficientNetTower":
        super().train(mode)
        for module in self.frozen:  # frozen layers keep their (ImageNet) BN statistics
            module.eval()
        return self

    def forward(self, x: torch.Tensor, step: int | None = None) -> TowerOutput:
        x = x.contiguous(memory_format=self.memory_format)
        memo = getattr(self, "output_memo", None)  # only a tower with frozen stages has one
        if not memo_applies(memo, x):
            return grid_tokens(self.trunk.forward_features(x))
        with torch.no_grad():
            x = through_memo(memo, self._frozen_features, x, *self.frozen)
        return grid_tokens(self._trained_features(x.contiguous(memory_format=self.memory_format)))

    # timm's EfficientNet.forward_features in two parts (the memo's path): the frozen layers, then the rest
    def _frozen_features(self, x: torch.Tensor) -> torch.Tensor:
        trunk = self.trunk
        return trunk.blocks[:self.freeze_stages](trunk.bn1(trunk.conv_stem(x)))

    def _trained_features(self, x: torch.Tensor) -> torch.Tensor:
        trunk, blocks = self.trunk, self.trunk.blocks[self.freeze_stages:]
        x = checkpoint_seq(blocks, x, flatten=True) if trunk.grad_checkpointing else blocks(x)
        return trunk.bn2(trunk.conv_head(x))


    def last_block(self) -> nn.Module:
        return self.trunk.blocks[-1][-1]


# ---- registry entries (the factory wraps token-sequence trunks in ViTTower / TokenDroppingViT) ----
@register_tower("vit_micro", *TIMM_VIT_NAMES, token_sequence=True)
def _create_vit(config, load_pretrained: bool) -> nn.Module:
    return create_timm_vit(config.image_tower, config.image_size, config.drop_path_rate, **(config.image_kwargs or {}))


@register_tower("fastvit_mci0")
def _create_fastvit(config, load_pretrained: bool) -> ImageTower:
    return FastViTTower("fastvit_mci0", config.image_size, config.drop_path_rate, **(config.image_kwargs or {}))


@register_tower(*EFFNET_STAGES)
def _create_efficientnet(config, load_pretrained: bool) -> ImageTower:
    """``load_pretrained=False`` skips the packaged ImageNet weights (a checkpoint's weights replace them)."""
    kwargs = dict(config.image_kwargs or {})
    kwargs["pretrained"] = bool(kwargs.get("pretrained", True)) and load_pretrained
    return EfficientNetTower(config.image_size, config.drop_path_rate, arch=config.image_tower, **kwargs)
