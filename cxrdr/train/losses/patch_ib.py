"""Patch-IB terms: InfoNCE of the masked pooled embedding, sparsity of the patch mask z, and the
consistency of the masked with the full image-text similarity. Per-sample means run over the
global batch (`global_mean`), so under DDP every rank holds the single-process value."""
from __future__ import annotations

import torch
from torch import nn

from cxrdr.train import distributed as dist_utils
from cxrdr.train.losses.contrastive import ClipLoss


def sparsity_loss(mask: torch.Tensor) -> torch.Tensor:
    """mean(z) over all patches of the (global) batch."""
    z = mask.float()
    return dist_utils.global_mean(z.sum(), z.numel())


def consistency_loss(masked_img: torch.Tensor, full_img: torch.Tensor, txt: torch.Tensor,
                     detach_full: bool = True) -> torch.Tensor:
    """MSE(diag s_mask, diag s_full): s_mask_i = <masked_img_i, txt_i>, s_full_i = <full_img_i, txt_i>
    (cosines of normalised embeddings); the full similarity is the target when `detach_full`."""
    txt = txt.float()
    s_mask = (masked_img.float() * txt).sum(dim=-1)
    s_full = (full_img.float() * txt).sum(dim=-1)
    if detach_full:
        s_full = s_full.detach()
    return dist_utils.global_mean(((s_mask - s_full) ** 2).sum(), s_mask.numel())


def mask_follows_words_loss(mask_scores: torch.Tensor, word_attn: torch.Tensor,
                            word_mask: torch.Tensor, word_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of the mask's distribution over patches, softmax(logit z), against where the
    report's words look: the mean attention map of its valid words, detached (a target, not a path).

    mask_scores (B, N) sigmoid scores of z; word_attn (B, T, N) rows of the words' attention;
    word_mask (B, T) which rows are real words; word_weight (B, T) optional weights of the words in
    that mean (the in-batch IDF: a finding named by few reports counts, 'the' does not). Rows without
    a (weighted) word are left out.
    Why: the mask is image-only, so at test time it cannot read the report; this teaches it to keep
    the patches the words of reports ground to (where findings are), not whatever tells images apart.
    """
    valid = word_mask.to(word_attn.dtype)
    if word_weight is not None:
        valid = valid * word_weight.to(word_attn.dtype)
    target = (word_attn.detach().float() * valid.unsqueeze(-1)).sum(1)
    total = target.sum(-1, keepdim=True)
    has_words = (total.squeeze(-1) > 0).float()
    # rows without words weigh 0 (a weighted mean, not a boolean selection: no host sync on the GPU)
    target = target / total.clamp_min(1e-12)
    logits = torch.logit(mask_scores.float(), eps=1e-6)
    per_row = -(target * logits.log_softmax(-1)).sum(-1)
    return (per_row * has_words).sum() / has_words.sum().clamp_min(1.0)


class MaskWordsLoss(nn.Module):
    """Weighted 'mask_words' term (``mask_follows_words_loss``) on every word the local loss may draw
    (affirmed, outside normal statements), weighted by its in-batch IDF: the target does not depend on
    which few words the token-region contrast drew this step."""

    def __init__(self, weight: float = 0.0):
        super().__init__()
        self.weight = weight

    def forward(self, out) -> dict[str, torch.Tensor]:
        idf = out.local_word_idf
        if not self.weight or out.mask_scores is None or out.local_attn is None or idf is None:
            return {}
        return {"mask_words": self.weight * mask_follows_words_loss(out.mask_scores, out.local_attn, idf > 0, idf)}


class PatchIBLoss(nn.Module):
    """Weighted Patch-IB terms: 'mask_nce' (w_mask_nce * InfoNCE of the masked pooled embedding,
    on global features), 'sparsity' (lambda_sparse * mean z) and 'consistency' (mu * MSE), both on
    this rank's features. Terms whose weight is 0 or whose inputs are None are left out."""

    def __init__(self, clip: ClipLoss, w_mask_nce: float = 1.0, lambda_sparse: float = 0.01,
                 mu_consistency: float = 1.0, detach_full: bool = True):
        super().__init__()
        self.clip = clip
        self.w_mask_nce, self.lambda_sparse = w_mask_nce, lambda_sparse
        self.mu_consistency, self.detach_full = mu_consistency, detach_full

    def forward(self, local: dict, global_: dict, logit_scale, positives=None,
                soft_targets=None) -> dict[str, torch.Tensor]:
        """``local``/``global_``: {"img", "txt", "masked_img", "mask"} of this rank / of all ranks."""
        out: dict[str, torch.Tensor] = {}
        if local["masked_img"] is not None:
            if self.w_mask_nce:
                out["mask_nce"] = self.w_mask_nce * self.clip(
                    global_["masked_img"], global_["txt"], logit_scale, positives=positives,
                    soft_targets=soft_targets)
            if self.mu_consistency:
                out["consistency"] = self.mu_consistency * consistency_loss(
                    local["masked_img"], local["img"], local["txt"], self.detach_full)
        if local["mask"] is not None and self.lambda_sparse:
            out["sparsity"] = self.lambda_sparse * sparsity_loss(local["mask"])
        return out
