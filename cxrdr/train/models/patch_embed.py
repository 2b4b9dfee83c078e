"""timm's ``PatchEmbed`` with its convolution computed on a GPU as the matrix product it is.

A ViT's patch embedding is a convolution whose kernel equals its stride: each token is one linear map of one
patch's pixels. On the H100 cuDNN ran the students' (3 channels, 16 x 16, bf16, batch 256) with a generic kernel,
``implicit_convolve_sgemm``: 1.65 ms forward and 1.14 ms backward a training step
(``benchmarks/results/profiles/nvidia-h100-0ef6026-A.txt``), a sixth of E's eager inference batch (~10 ms).
Laid out as (tokens, channels x 16 x 16) @ (channels x 16 x 16, width), it is one matrix product, which the
tensor cores run. timm's ``VisionTransformer`` takes the class as its ``embed_layer``: the parameters are the
convolution's (its weight viewed as a matrix), so state dicts and checkpoints do not change, and the values are
the convolution's to float rounding.

On the CPU the convolution stays: oneDNN runs it as fast as the product (18 against 21 ms, ViT-S/16 at 224,
batch 32, forward, this 2-core box), and CPU results stay bit for bit what they were. So do the inputs timm's
forward handles beyond the plain case (dynamic padding, sizes off the patch grid, a feature-map output).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed


class LinearPatchEmbed(PatchEmbed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.is_plain(x):
            return self.as_matmul(x)
        return super().forward(x)

    def is_plain(self, x: torch.Tensor) -> bool:
        """Whole patches, flattened tokens out, no padding: what ``as_matmul`` computes."""
        height, width = x.shape[-2:]
        if self.strict_img_size and self.img_size is not None and (height, width) != tuple(self.img_size):
            return False  # timm's forward says what is wrong
        return (self.flatten and not self.dynamic_img_pad and height % self.patch_size[0] == 0
                and width % self.patch_size[1] == 0)

    def as_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, tokens, width): the convolution as patches @ its weight matrix."""
        batch, channels, height, width = x.shape
        ph, pw = self.patch_size
        rows, cols = height // ph, width // pw
        # (B, C, rows, ph, cols, pw) -> (B, rows * cols, C * ph * pw): the order of the kernel's (C, ph, pw)
        patches = x.reshape(batch, channels, rows, ph, cols, pw).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(batch, rows * cols, channels * ph * pw)
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        return self.norm(F.linear(patches, weight, self.proj.bias))
