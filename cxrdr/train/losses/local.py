"""Local alignment of text tokens with image regions: cosine alignment (the seeds' form),
token-region contrastive (GLoRIA/MGCA style), word contrast and attention entropy."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cxrdr.train import distributed as dist_utils


def local_alignment_loss(local_visual: torch.Tensor, local_text: torch.Tensor,
                         text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean over valid text tokens (all tokens of the batch pooled) of 1 - cos(v~_k, t_k).

    local_visual/local_text (B, L, D); text_mask (B, L) bool/0-1, padding False/0.
    """
    cos = F.cosine_similarity(local_visual.float(), local_text.float(), dim=-1, eps=1e-8)
    if text_mask is None:
        valid = torch.ones_like(cos)
    else:
        if tuple(text_mask.shape) != tuple(cos.shape):
            raise ValueError(f"text_mask {tuple(text_mask.shape)} does not match local tokens {tuple(cos.shape)}")
        valid = text_mask.to(cos.dtype)
    return dist_utils.global_mean(((1.0 - cos) * valid).sum(), valid.sum())


def shared_words(pair_ids: torch.Tensor, drawable_ids: torch.Tensor) -> torch.Tensor:
    """(B_text, T, B_image) bool: image j's report holds word k of text i where words may be drawn.

    pair_ids (B, T) the drawn words' ids; drawable_ids (B, L) every report's ids, -1 where no word
    may be drawn (``StudentOutput.local_drawable_ids``). Built only when the option asks for it.
    """
    return (pair_ids[:, :, None, None] == drawable_ids[None, None]).any(-1)


def group_images(batch: int, group: int, device=None) -> torch.Tensor:
    """(B, G): the batch index of the image in each column of a grouped pair similarity
    (``heads.grouped_pair_similarity``): column j of row i is image (i // G) * G + j. A last, smaller group's
    padded columns get indices of B or more."""
    return (torch.arange(batch, device=device) // group * group).unsqueeze(1) + torch.arange(group, device=device)


def local_contrastive_loss(pair_similarity: torch.Tensor, text_mask: torch.Tensor | None = None,
                           temperature: float = 0.1, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Token-region InfoNCE: each text token's region pooled from its own image must beat the same
    token pooled over every other image of the batch, or of its group.

    pair_similarity (B_text, B_image, L): cos(v~_{j<-i,k}, t_{i,k}) (``LocalAlign.pair_similarity``);
    the target of text i is image i. (B, G, L) with G < B: over the images of text i's group of G consecutive
    rows only (``heads.grouped_pair_similarity``), its own image at column i % G, -inf where a last group has no
    image. Mean cross-entropy over valid tokens (text_mask (B, L)).
    Negatives are this rank's images only (the attention needs the other images' patches).
    ``shared`` (B_text, L, B_image) bool: image j's own report has word k of text i too, so its region
    for that word is no negative (false-negative masking per word; the own image always stays).
    """
    b, columns, length = pair_similarity.shape
    if columns > b:
        raise ValueError(f"pair_similarity must be (B, B, L) or (B, G, L) with G < B, "
                         f"got {tuple(pair_similarity.shape)}")
    logits = pair_similarity.float().permute(0, 2, 1) / temperature  # (B_text, L, columns)
    target = torch.arange(b, device=logits.device) % columns  # the own image's column (all of them: i)
    if shared is not None:
        shared = shared.bool()
        if columns < b:  # each text's group of images, gathered from the whole batch's mask
            index = group_images(b, columns, logits.device).clamp(max=b - 1)
            shared = shared.gather(2, index.unsqueeze(1).expand(-1, length, -1))
        own = F.one_hot(target, columns).bool().unsqueeze(1)  # (B_text, 1, columns)
        logits = logits.masked_fill(shared & ~own, float("-inf"))
    ce = F.cross_entropy(logits.reshape(b * length, columns), target.repeat_interleave(length),
                         reduction="none").view(b, length)
    valid = torch.ones_like(ce) if text_mask is None else text_mask.to(ce.dtype)
    return (ce * valid).sum() / valid.sum().clamp_min(1.0)


def word_contrastive_loss(word_similarity: torch.Tensor, token_ids: torch.Tensor, mask: torch.Tensor | None = None,
                          temperature: float = 0.1) -> torch.Tensor:
    """The other direction of the token-region contrast: word k's region of its own image must match
    word k better than the report's other words. A region shared by every word (one broad map for the
    whole report) cannot, so the words must look at different places.

    word_similarity (B, T, T): cos(v~_{i,k}, t_{i,m}); token_ids (B, T) of the words (repeats of the
    same id are not negatives of each other); mask (B, T) valid words. Mean cross-entropy over valid
    words that have at least one valid negative.
    """
    b, n, _ = word_similarity.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=word_similarity.device) if mask is None else mask.bool()
    same_word = token_ids.unsqueeze(2) == token_ids.unsqueeze(1)  # (B, T, T)
    eye = torch.eye(n, dtype=torch.bool, device=word_similarity.device)
    excluded = (same_word & ~eye) | ~valid.unsqueeze(1)
    logits = (word_similarity.float() / temperature).masked_fill(excluded, float("-inf"))
    has_negative = (~excluded & ~eye).any(-1) & valid
    ce = -torch.diagonal(logits.log_softmax(-1), dim1=1, dim2=2)
    weight = has_negative.to(ce.dtype)
    return (torch.nan_to_num(ce, posinf=0.0) * weight).sum() / weight.sum().clamp_min(1.0)


def attention_entropy(attn: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean entropy / log(N) of the attention rows (B, L, N) over valid words (mask (B, L)): 1 = uniform.
    A penalty on it makes each word commit to a region instead of averaging the whole image."""
    p = attn.float().clamp_min(1e-12)
    entropy = -(p * p.log()).sum(-1) / math.log(max(2, attn.shape[-1]))
    valid = torch.ones_like(entropy) if mask is None else mask.to(entropy.dtype)
    return (entropy * valid).sum() / valid.sum().clamp_min(1.0)


class LocalLoss(nn.Module):
    """The weighted 'local' term of one StudentOutput: cosine, contrastive or both (``mode``), plus
    the optional word contrast and attention-entropy penalty. On this rank's features."""

    def __init__(self, weight: float = 0.5, mode: str = "contrastive", temperature: float = 0.1,
                 word_contrast: bool = False, entropy: float = 0.0, mask_shared_words: bool = False):
        super().__init__()
        self.weight, self.mode, self.temperature = weight, mode, temperature
        self.word_contrast, self.entropy, self.mask_shared_words = word_contrast, entropy, mask_shared_words

    def forward(self, out) -> dict[str, torch.Tensor]:
        if out.local_visual is None or out.local_text is None or not self.weight:
            return {}
        parts = []
        if self.mode in ("cosine", "both"):
            parts.append(local_alignment_loss(out.local_visual, out.local_text, out.text_mask))
        if self.mode in ("contrastive", "both"):
            parts += self._contrastive(out)
        if self.entropy and out.local_attn is not None:
            parts.append(self.entropy * attention_entropy(out.local_attn, out.text_mask))
        return {"local": self.weight * torch.stack(parts).sum()}

    def _contrastive(self, out) -> list[torch.Tensor]:
        if out.local_pair_similarity is None:
            raise ValueError("loss.local_loss 'contrastive' needs the student's forward(..., local_pairs=True)")
        shared = shared_words(out.local_pair_ids, out.local_drawable_ids) if self.mask_shared_words else None
        parts = [local_contrastive_loss(out.local_pair_similarity, out.local_pair_mask, self.temperature, shared)]
        if self.word_contrast:
            if out.local_word_similarity is None:
                raise ValueError("loss.local_word_contrast needs the student's forward(..., local_words=True)")
            parts.append(word_contrastive_loss(out.local_word_similarity, out.local_pair_ids,
                                               out.local_pair_mask, self.temperature))
        return parts
