"""A ViT's patch embedding convolution run on a GPU as the matrix product it is.

A patch embedding is a convolution whose kernel equals its stride (no padding, no groups): each token is one
linear map of one patch's pixels. On the H100 cuDNN ran the students' (3 channels, 16 x 16, bf16, batch 256) with
a generic kernel, ``implicit_convolve_sgemm``: 1.65 ms forward and 1.14 ms backward a training step
(``benchmarks/results/profiles/nvidia-h100-0ef6026-A.txt``), a sixth of E's eager inference batch (~10 ms). Laid
out as (tokens, channels x 16 x 16) @ (channels x 16 x 16, width) it is one matrix product, which the tensor cores
run: ~30 GFLOPs at batch 256. ``swap_patch_convs`` puts a ``PatchConv2d`` in place of each such convolution of a
model (timm's ``PatchEmbed.proj``, open_clip's ``conv1``), sharing its parameters: state dicts, checkpoints and
weight fingerprints do not change, and the values are the convolution's to float rounding. The output is the
convolution's (B, width, rows, cols), a view of the product's tokens, which the callers' flatten-and-transpose
turns back into the tokens without a copy.

On the CPU the convolution itself runs: oneDNN's is faster than the product there (12.5-13.6 against 19.5-20.2 ms
forward, 30-32 against 44-47 ms forward + backward, ViT-S/16 at 224, batch 32, 2 threads of a 2-core box:
``python benchmarks/patch_embed.py --threads 2``), and CPU results stay bit for bit what they were.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def is_patch_conv(conv: nn.Module) -> bool:
    """A plain 2-D convolution that cuts its input into whole, non-overlapping patches."""
    return (type(conv) is nn.Conv2d and conv.kernel_size == conv.stride and conv.kernel_size != (1, 1)
            and conv.padding == (0, 0) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")


class PatchConv2d(nn.Conv2d):
    """``nn.Conv2d`` with kernel = stride; on CUDA computed as patches @ its weight matrix."""

    @classmethod
    def sharing(cls, conv: nn.Conv2d) -> "PatchConv2d":
        """A PatchConv2d holding ``conv``'s own parameters (the same Parameter objects)."""
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, bias=False,
                  device="meta")
        new.weight, new.bias = conv.weight, conv.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ph, pw = self.kernel_size
        if x.is_cuda and x.dim() == 4 and x.shape[-2] % ph == 0 and x.shape[-1] % pw == 0:
            return self.as_matmul(x)
        return super().forward(x)

    def as_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, out, H / ph, W / pw), as the convolution, from one matrix product."""
        batch, channels, height, width = x.shape
        ph, pw = self.kernel_size
        rows, cols = height // ph, width // pw
        # (B, C, rows, ph, cols, pw) -> (B, rows * cols, C * ph * pw): the order of the kernel's (C, ph, pw)
        patches = x.reshape(batch, channels, rows, ph, cols, pw).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(batch, rows * cols, channels * ph * pw)
        tokens = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return tokens.transpose(1, 2).reshape(batch, self.out_channels, rows, cols)  # a view


def swap_patch_convs(model: nn.Module) -> int:
    """Replace every patch convolution inside ``model`` with a ``PatchConv2d`` sharing its parameters; returns
    how many were replaced."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if is_patch_conv(child)]
    for parent, name, child in swaps:
        setattr(parent, name, PatchConv2d.sharing(child))
    return len(swaps)
