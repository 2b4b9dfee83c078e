"""The Gram form of the cosine local head's pair similarity, with its backward written out.

For every word q (B_text x L of them, unit rows t_q) and image b (unit patch rows p_bn, n < N), with
a = softmax_n(t_q . p_bn / T) and V_b the pooled values (the patches themselves unless given):

    cos(V_b^T a, t_q) = u / sqrt(v),   u = a . (V_b t_q),   v = a^T G_b a,   G_b = V_b V_b^T

(``heads.pooled_cosine_by_gram`` explains why this form exists). Everything this needs is a (words, images,
patches) tensor: 102 M values at batch 256, 8 words a text and 196 patches, 411 MB in fp32, so what a GPU
spends on it is passes over such tensors, not FLOPs. Autograd's own backward of the same expression made
about twice as many passes as needed, in two memory layouts (the broadcast matrix product returns its
scores transposed, and the elementwise products that mixed them ran uncoalesced): one D step on an H100
spent ~18 ms here (benchmarks/results/profiles/nvidia-h100-48c40d0-pair-similarity-patch-embed.txt).

``gram_pooled_cosine`` keeps every such tensor with the patches innermost, (words, images, patches): the
scores are one matrix product of the words with all B x N patches, and the gradients of both inputs are
again single matrix products; only w = G a comes out of its batched product image-major, patches still
innermost, so the two products that read it with a stay coalesced.
Its backward uses what the softmax's gradient reduces to here: with da = dc (r / sqrt(v) - (c / v) w)
(r the numerator's scores, w = G a), sum_n a_n da_n = dc (u / sqrt(v) - c v / v) = 0, so the logits'
gradient is a * da, with no row sum to subtract. Of the (words, images, patches) tensors it saves a, the
logits and w (with separate values, their scores too); beside them only its inputs and two (words, images) ones.
"""
from __future__ import annotations

import torch


def gram_pooled_cosine(words: torch.Tensor, patches: torch.Tensor, values: torch.Tensor | None,
                       temperature: float, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B_text, L, D) unit words, (B_image, N, D) unit patches (``values``: unit rows on the same grid, pooled in
    place of the patches) -> (B_text, B_image, L) cosines of each word with its pooled vector over each image.
    ``patch_mask`` (B_image, N), False: a padded patch, given no attention. Computed in fp32, outside autocast."""
    b_txt, length, width = words.shape
    b_img, n = patches.shape[:2]
    with torch.autocast(words.device.type, enabled=False):
        flat = words.reshape(b_txt * length, width).float()
        mask = None if patch_mask is None else patch_mask.to(device=words.device, dtype=torch.bool)
        vals = None if values is None else values.float()
        cosine = _GramPooledCosine.apply(flat, patches.float(), vals, float(temperature), mask)  # (Q, B_image)
    return cosine.reshape(b_txt, length, b_img).transpose(1, 2)


class _GramPooledCosine(torch.autograd.Function):
    """(Q, D) words, (B, N, D) patches, optional (B, N, D) values -> (Q, B) cosines (module docstring)."""

    @staticmethod
    def forward(ctx, flat, patches, values, temperature, mask):
        q, (b, n, width) = flat.shape[0], patches.shape
        keys = patches.reshape(b * n, width)
        logits = (flat / temperature).mm(keys.t()).view(q, b, n)  # (Q, B, N): patches innermost
        attn = (logits if mask is None else logits.masked_fill(~mask, float("-inf"))).softmax(-1)
        vals = patches if values is None else values
        gram = torch.bmm(vals, vals.transpose(1, 2))  # (B, N, N)
        along = None if values is None else flat.mm(values.reshape(b * n, width).t()).view(q, b, n)
        # the numerator a . (V t): the logits times T where the patches are pooled
        numer = (attn * along).sum(-1) if along is not None else (attn * logits).sum(-1) * temperature
        # w = G a, image-major (B, Q, N): bmm reads attn's image-major view in place (rows Q apart), and the two
        # products with attn below still run along the patches, innermost in both
        spread = torch.bmm(attn.transpose(0, 1), gram).transpose(0, 1)
        norm_sq = (attn * spread).sum(-1).clamp_min(1e-24)
        cosine = numer / norm_sq.sqrt()
        ctx.temperature = temperature
        ctx.save_for_backward(flat, patches, values, attn, logits, along, spread, norm_sq, cosine)
        return cosine

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        flat, patches, values, attn, logits, along, spread, norm_sq, cosine = ctx.saved_tensors
        temperature = ctx.temperature
        q, (b, n, width) = flat.shape[0], patches.shape
        with torch.autocast(flat.device.type, enabled=False):
            grad = grad.float()
            per_numer = (grad / norm_sq.sqrt()).unsqueeze(-1)  # dc/du = 1 / sqrt(v)
            per_spread = (grad * cosine / norm_sq).unsqueeze(-1)  # -dc/dv x 2 = c / v
            # d logits = a * da, da = (r / sqrt(v) - (c / v) w) dc, r = T logits (+ T: the numerator's own a);
            # the scores' gradient, d logits / T, is what the matrix products take: 1/T goes into the row factors
            if along is None:
                d_scores = torch.addcmul(per_numer, per_numer, logits)
            else:
                d_scores = along * (per_numer / temperature)
            d_scores.addcmul_(per_spread / temperature, spread, value=-1).mul_(attn)
            # dG_b = -(1/2) sum_q (c / v) dc a a^T, symmetric: d V_b += 2 dG_b V_b
            weighted = (attn * per_spread).transpose(0, 1)  # (B, Q, N)
            d_gram = torch.bmm(weighted.transpose(1, 2), attn.transpose(0, 1)).mul_(-0.5)
            vals = patches if values is None else values
            d_vals = torch.bmm(d_gram, vals).mul_(2.0)
            scores_grad = d_scores.view(q, b * n)
            keys = patches.reshape(b * n, width)
            d_flat = scores_grad.mm(keys)
            d_patches = scores_grad.t().mm(flat).view(b, n, width)
            if values is None:
                return d_flat, d_patches + d_vals, None, None, None
            d_numer = (attn * per_numer).view(q, b * n)  # d r = a / sqrt(v) dc
            d_flat += d_numer.mm(values.reshape(b * n, width))
            d_vals += d_numer.t().mm(flat).view(b, n, width)
            return d_flat, d_patches, d_vals, None, None
