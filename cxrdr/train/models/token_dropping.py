"""TokenDroppingViT: a timm ViT that keeps only [CLS] + the Top-K patch tokens after block L1.

Positional embeddings are added (timm's ``_pos_embed``) before any dropping, so kept tokens carry
their position. Blocks 0..L1-1 run on all tokens; a patch score picks K = round(keep_rate * N)
patches (``torch.gather``, kept in grid order); blocks L1.. run on the K+1 (or K+2 with fusion)
tokens, which is where the compute saving comes from.

Scores: ``head`` — a LayerNorm+Linear score head; its sigmoid gates the kept tokens through a
straight-through factor (value 1, gradient of the score) so the head learns from the task loss.
``cls_attn`` — the head-averaged [CLS] attention of block L1-1 (EViT / MGCA), no parameters.
``mask`` — scores given by the caller (``forward(x, step, scores=...)``): the student's Patch-IB mask
scores of the embedded patches, so the patches z keeps are the tokens the blocks see (Top-K selection
and token dropping are one decision; ``mask_selected_forward``). Gated like ``head``.
Options: keep rate warmed up from 1.0 to its target over the first ``warmup_steps`` (EViT), and
``fuse_dropped`` — the dropped tokens fused into one extra token (score-weighted mean) appended last.

Heads (mask, local alignment) at a ``head_layer`` up to L1 read every patch as it was at that layer,
so E's heatmaps cover the whole image as D's do; at a later layer they read the kept patches.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from cxrdr.train.models.heads import grid_heads
from cxrdr.train.models.image_towers import TowerOutput, ViTTower, head_tokens


class TokenDroppingViT(ViTTower):
    def __init__(self, vit: nn.Module, drop_layer: int, keep_rate: float, warmup_steps: int = 0,
                 patch_score: str = "head", fuse_dropped: bool = False, global_pool: str = "token",
                 head_layer: int | None = None):
        super().__init__(vit, global_pool, head_layer)
        if not 0 <= drop_layer < self.depth:
            raise ValueError(f"drop_layer must be in 0..{self.depth - 1} for a {self.depth}-block ViT, got {drop_layer}")
        if patch_score == "cls_attn" and drop_layer < 1:
            raise ValueError("patch_score 'cls_attn' needs drop_layer >= 1 (the attention of block L1-1)")
        if patch_score not in ("head", "cls_attn", "mask"):
            raise ValueError(f"patch_score must be 'head', 'cls_attn' or 'mask', got {patch_score!r}")
        if not 0.0 < keep_rate <= 1.0:
            raise ValueError(f"keep_rate must be in (0, 1], got {keep_rate}")
        self.drop_layer = int(drop_layer)
        self.keep_rate = float(keep_rate)
        self.warmup_steps = int(warmup_steps)
        self.patch_score = patch_score
        self.fuse_dropped = bool(fuse_dropped)
        if patch_score == "head":
            self.score_head = nn.Sequential(nn.LayerNorm(self.width), nn.Linear(self.width, 1))

    def keep_rate_at(self, step: int | None) -> float:
        """Linear warm-up 1.0 -> keep_rate over warmup_steps; the target when step is None (eval)."""
        if step is None or self.warmup_steps <= 0:
            return self.keep_rate
        t = min(1.0, max(0, step) / self.warmup_steps)
        return 1.0 + (self.keep_rate - 1.0) * t

    def num_kept(self, n_patches: int, step: int | None = None) -> int:
        return max(1, min(n_patches, round(self.keep_rate_at(step) * n_patches)))

    @torch.no_grad()
    def _cls_attention(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Head-averaged attention of [CLS] to every patch in ``block`` given its input x: (B, N)."""
        attn = block.attn
        b, t, _ = x.shape
        qkv = attn.qkv(block.norm1(x)).reshape(b, t, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
        weights = ((q[:, :, :1] * attn.scale) @ k.transpose(-2, -1)).softmax(-1)  # (B, H, 1, T)
        return weights.mean(1)[:, 0, 1:]

    def forward(self, x: torch.Tensor, step: int | None = None, scores: torch.Tensor | None = None) -> TowerOutput:
        """``scores`` (B, N) in [0, 1]: the patch scores of patch_score 'mask' (higher is kept)."""
        return self.forward_tokens(self.embed(x), step, scores)

    def forward_tokens(self, x: torch.Tensor, step: int | None = None,
                       scores: torch.Tensor | None = None) -> TowerOutput:
        """The blocks on embedded tokens (B, 1+N, d) (``embed``), dropping after block ``drop_layer``."""
        if (scores is None) != (self.patch_score != "mask"):
            raise ValueError("patch_score 'mask' takes the scores from the caller, and only it does")
        b, t, d = x.shape
        n = t - 1
        cls_scores = None
        at_head_layer = x if self.head_layer == 0 else None
        last_full = self.drop_layer - 1 if self.patch_score == "cls_attn" else self.drop_layer
        x, marked = self.run_blocks(x, 0, last_full, self.head_layer)
        if self.patch_score == "cls_attn":  # the attention of block L1-1 on its input
            cls_scores = self._cls_attention(self.trunk.blocks[last_full], x)
            x, marked_last = self.run_blocks(x, last_full, self.drop_layer, self.head_layer)
            marked = marked if marked is not None else marked_last
        at_head_layer = marked if marked is not None else at_head_layer

        k = self.num_kept(n, step)
        patches = x[:, 1:]
        gated = self.patch_score in ("head", "mask")  # learned scores: the kept tokens carry their gradient
        if self.patch_score == "head":
            scores = torch.sigmoid(self.score_head(patches).squeeze(-1))  # (B, N)
        elif self.patch_score == "cls_attn":
            scores = cls_scores
        if k < n:
            index = scores.detach().topk(k, dim=1).indices.sort(dim=1).values  # (B, K) in grid order
            kept = patches.gather(1, index.unsqueeze(-1).expand(-1, -1, d))
            if gated:
                gate = scores.gather(1, index)
                kept = kept * (1.0 + gate - gate.detach()).unsqueeze(-1)  # value unchanged, grad to the score head
            parts = [x[:, :1], kept]
            if self.fuse_dropped:
                dropped = torch.ones_like(scores).scatter(1, index, 0.0)
                w = scores * dropped
                fused = (w.unsqueeze(-1) * patches).sum(1) / w.sum(1, keepdim=True).clamp_min(1e-6)
                parts.append(fused.unsqueeze(1))
            x = torch.cat(parts, dim=1)
        else:  # nothing dropped (keep-rate warm-up): still gate, so the score head always takes part (DDP)
            index = torch.arange(n, device=x.device).expand(b, n)
            if gated:
                x = torch.cat([x[:, :1], patches * (1.0 + scores - scores.detach()).unsqueeze(-1)], dim=1)
        # heads at a layer before the drop read every patch (a grid: their maps cover the whole image);
        # heads after it read the kept patches
        head_index = None
        if at_head_layer is not None:
            head_index = torch.arange(n, device=x.device).expand(b, n)
        x, marked = self.run_blocks(x, self.drop_layer, self.depth, self.head_layer)
        if marked is not None:
            at_head_layer, head_index = marked, index
        out = self.finish(x, index, k, k / n)
        if head_index is not None:
            out.head_patches, out.head_index = head_tokens(at_head_layer, head_index.shape[1]), head_index
        return out


def mask_selected_forward(tower: TokenDroppingViT, head_conv: nn.Module | None, mask_head: nn.Module,
                          x: torch.Tensor, step: int | None = None, heads_graphs=None):
    """E with patch_score 'mask': the Patch-IB mask, computed on the embedded patches, chooses the tokens
    the blocks see. Returns (tower output, the heads' patches (after ``head_conv``), z, soft scores);
    the output's ``head_patches`` are the embedded patches of the whole grid, as the heads read them.
    ``heads_graphs``: the BlockGraphs the heads replay through (``heads.grid_heads``), None: eager.
    Shared by the student and its open_clip export, so both drop the same tokens."""
    tokens = tower.embed(x)
    n = tokens.shape[1] - 1
    embedded = head_tokens(tokens, n)
    patches, z, soft = grid_heads(head_conv, mask_head, embedded, step, heads_graphs)
    out = tower.forward_tokens(tokens, step, scores=soft)
    out.head_patches = embedded
    out.head_index = torch.arange(n, device=tokens.device).expand(tokens.shape[0], n)
    return out, patches, z, soft
