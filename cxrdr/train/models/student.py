"""PatchIBStudent: the two-tower CLIP student with the Patch-IB ladder A-E.

A global CLIP | B + local alignment | C + sigmoid Patch-IB mask | D + hard Top-K mask (straight-through)
| E + token dropping inside the ViT after block L1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models._manipulate import group_with_matcher

from cxrdr.train.models.config import StudentConfig
from cxrdr.train.models.heads import (Projection, TeacherSpaceHeads, batch_idf, build_local_align, build_patch_heads,
                                      cued_sentence_tokens, grid_heads, grouped_pair_similarity, init_logit_scale,
                                      negated_tokens, sample_token_positions)
from cxrdr.train.models.image_towers import ImageTower
from cxrdr.train.models.packed_text import stack_token_batches
from cxrdr.train.models.text_towers import HFTextTower, TextTokenizer
from cxrdr.train.models.token_dropping import mask_selected_forward


# Negation scope of the local loss's words (``local_affirmed``): NegEx's commonest pre-negation cues.
NEGATION_CUES = ("no", "not", "without", "negative", "free", "absent")
SENTENCE_ENDS = (".", ";")
# Sentences that state normal anatomy ("Heart size is normal.", "The lungs are clear."; ``local_skip_normal``).
NORMAL_CUES = ("normal", "clear", "unremarkable")


@dataclass
class StudentOutput:
    image_emb: torch.Tensor  # (B, D) normalised
    text_emb: torch.Tensor  # (B, D) normalised
    logit_scale: torch.Tensor  # scalar, exp'd and clamped to <= logit_scale_max
    patch_tokens: torch.Tensor | None  # (B, N, d) image-tower patch tokens (kept ones for E)
    patch_index: torch.Tensor  # (B, N) long indices of patch_tokens into the full grid (arange unless E)
    grid_size: tuple[int, int]  # (gh, gw) of the full grid
    text_tokens: torch.Tensor  # (B, L, dt) text-tower token states the local heads read (local_text_layer)
    text_mask: torch.Tensor  # (B, L) bool, True for real tokens
    mask: torch.Tensor | None = None  # z (B, N): C sigmoid, D/E hard Top-K with straight-through; None for A/B
    mask_scores: torch.Tensor | None = None  # (B, N) soft sigmoid scores; None for A/B
    masked_image_emb: torch.Tensor | None = None  # (B, D) normalised proj(sum z*patch / sum z); None for A/B
    local_visual: torch.Tensor | None = None  # (B, L, D) attention-pooled patches per text token; None for A
    local_text: torch.Tensor | None = None  # (B, L, D) projected text tokens; None for A
    local_attn: torch.Tensor | None = None  # (B, L, N) head-averaged attention; None for A
    local_pair_similarity: torch.Tensor | None = None  # (B, B, T) text i's tokens pooled over image j; on request
    local_pair_mask: torch.Tensor | None = None  # (B, T) bool, which of those T sampled tokens are real
    local_word_similarity: torch.Tensor | None = None  # (B, T, T) word k's own-image region vs word m
    local_pair_ids: torch.Tensor | None = None  # (B, T) token ids of the sampled words
    local_pair_index: torch.Tensor | None = None  # (B, T) their positions in the text
    local_word_idf: torch.Tensor | None = None  # (B, L) in-batch IDF of every drawable word, 0 elsewhere
    local_drawable_ids: torch.Tensor | None = None  # (B, L) ids of the words that may be drawn, -1 elsewhere
    keep_ratio: float = 1.0  # fraction of patches kept by token dropping
    head_index: torch.Tensor | None = None  # (B, N') grid indices of the patches the heads read (None: patch_index)
    caption_emb: torch.Tensor | None = None  # (B_syn, D) normalised embedding of the captions given to forward
    # {teacher: {"img", "txt", "syn": (B, Dt)}}: the embeddings mapped into each teacher's space (feature
    # distillation; set by the training step when the student has teacher_dims)
    teacher_space: dict | None = None

    @property
    def z(self) -> torch.Tensor | None:
        return self.mask


class PatchIBStudent(nn.Module):
    """Image tower + text tower + projections + the variant's heads. Inputs: images (B, 1, H, W) in [0, 1].
    The towers come built (``cxrdr.train.models.factory.build_student`` makes them from the config)."""

    def __init__(self, config: StudentConfig, image_tower: ImageTower, text_tower: HFTextTower,
                 tokenizer: TextTokenizer):
        super().__init__()
        self.config = config
        self.image_size = int(config.image_size)
        self.embed_dim = int(config.embed_dim)
        self.context_length = int(config.context_length)
        self.variant = config.variant

        self.image_tower = image_tower
        self.text_tower = text_tower
        self.tokenizer = tokenizer
        if self.tokenizer.vocab_size > self.text_tower.model.config.vocab_size:
            raise ValueError(f"tokenizer of {config.text_tower!r} has {self.tokenizer.vocab_size} tokens but the text "
                             f"tower only {self.text_tower.model.config.vocab_size} embeddings")

        # The tower's normalisation, written back to the config so a checkpoint rebuilds the same model.
        mean = config.image_mean or list(self.image_tower.mean)
        std = config.image_std or list(self.image_tower.std)
        config.image_mean, config.image_std = [float(m) for m in mean], [float(s) for s in std]
        self.register_buffer("pixel_mean", torch.tensor(config.image_mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(config.image_std).view(1, 3, 1, 1), persistent=False)

        d_img, d_txt = self.image_tower.width, self.text_tower.width
        self.image_proj = Projection(d_img, self.embed_dim)
        self.text_proj = Projection(d_txt, self.embed_dim)
        self.logit_scale = init_logit_scale(config.logit_scale_init)
        # token ids of the cue words, as buffers: they follow the model to its device (no copy per step)
        for name, words in (("negation_cue_ids", NEGATION_CUES), ("sentence_end_ids", SENTENCE_ENDS),
                            ("normal_cue_ids", NORMAL_CUES)):
            self.register_buffer(name, torch.tensor(tokenizer.word_ids(words), dtype=torch.long), persistent=False)
        self.local_align = build_local_align(config.local_attention, d_txt, d_img, self.embed_dim, config.local_heads,
                                             config.local_attention_temperature) if config.use_local else None
        self.head_conv, self.mask_head = build_patch_heads(config, d_img, self.image_tower.grid_size)
        self.heads_graphs = None  # --cuda-graphs-heads: the image tower's BlockGraphs (models/block_graphs.py)
        self.teacher_heads = TeacherSpaceHeads(self.embed_dim, config.teacher_dims) if config.teacher_dims else None
        if config.grad_checkpointing:
            self.set_grad_checkpointing(True)

    # ---- inputs -------------------------------------------------------------------------------
    @property
    def grid_size(self) -> tuple[int, int]:
        return tuple(self.image_tower.grid_size)

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """list[str] -> {'input_ids': (B, L) long, 'attention_mask': (B, L) long}, L = context_length."""
        return self.tokenizer(texts)

    def prepare_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 1 or 3, H, W) in [0, 1] -> normalised (B, 3, H, W) on the model's device."""
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"images must be (B, 1, H, W) in [0, 1], got shape {tuple(images.shape)}")
        if tuple(images.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"images must be {self.image_size}x{self.image_size} for this student, "
                             f"got {tuple(images.shape[-2:])}")
        x = images.to(self.pixel_mean.device, dtype=self.pixel_mean.dtype)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return (x - self.pixel_mean) / self.pixel_std

    # ---- encoders -----------------------------------------------------------------------------
    @property
    def drops_by_mask(self) -> bool:
        """E whose kept tokens are the Top-K of its Patch-IB mask (patch_score 'mask')."""
        return self.config.use_token_dropping and self.config.patch_score == "mask"

    def _image(self, images: torch.Tensor, step: int | None):
        """The tower's output alone (the global embedding needs no heads, unless the mask picks E's tokens)."""
        if self.drops_by_mask:
            return self._image_and_heads(images, step)[0]
        return self.image_tower(self.prepare_images(images), step=step)

    def _image_and_heads(self, images: torch.Tensor, step: int | None):
        """(tower output, the heads' patches after ``head_conv``, z, soft scores); z and soft are None
        without a mask head. With ``drops_by_mask`` the mask is computed first and chooses E's tokens."""
        x = self.prepare_images(images)
        if self.drops_by_mask:
            return mask_selected_forward(self.image_tower, self.head_conv, self.mask_head, x, step,
                                         self.heads_graphs)
        img = self.image_tower(x, step=step)
        patches = img.patches if img.head_patches is None else img.head_patches  # what the heads read
        return (img, *grid_heads(self.head_conv, self.mask_head, patches, step, self.heads_graphs))

    def _text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_layer: int | None = None,
              token_index: torch.Tensor | None = None):
        device = self.pixel_mean.device
        return self.text_tower(input_ids.to(device), attention_mask.to(device), token_layer, token_index)

    def _texts(self, input_ids, attention_mask, token_index, caption_ids, caption_mask, caption_token_index,
               token_layer: int | None):
        """(the texts' states after ``token_layer``, their pooled vectors, the captions' pooled vectors or None).
        Packed texts with captions go through the text tower in one call (``packed_text.stack_token_batches``)."""
        if caption_ids is None:
            return (*self._text(input_ids, attention_mask, token_layer, token_index), None)
        if not (self.text_tower.pack and token_index is not None and caption_token_index is not None):
            caption_pooled = self._text(caption_ids, caption_mask, None, caption_token_index)[1]
            return (*self._text(input_ids, attention_mask, token_layer, token_index), caption_pooled)
        device = self.pixel_mean.device
        rows, length = input_ids.shape
        stacked = stack_token_batches([(t.to(device), m.to(device), i.to(device)) for t, m, i in (
            (input_ids, attention_mask, token_index), (caption_ids, caption_mask, caption_token_index))])
        states, pooled = self.text_tower(*stacked[:2], token_layer, stacked[2])
        return states[:rows, :length], pooled[:rows], pooled[rows:]

    def encode_image(self, images: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """(B, 1, H, W) in [0, 1] -> (B, D) normalised global image embedding."""
        return F.normalize(self.image_proj(self._image(images, step).pooled), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_index: torch.Tensor | None = None) -> torch.Tensor:
        """token ids (B, L) -> (B, D) normalised text embedding (L as ``tokenize`` pads, see TextTokenizer).
        ``token_index``: the tokenizer's, to run the text tower on the real tokens only."""
        return F.normalize(self.text_proj(self._text(input_ids, attention_mask, token_index=token_index)[1]), dim=-1)

    def current_logit_scale(self) -> torch.Tensor:
        return self.logit_scale.exp().clamp(max=self.config.logit_scale_max)

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                step: int | None = None, local_pairs: int = 0, local_group: int = 0, local_words: bool = False,
                local_affirmed: bool = False, local_skip_normal: bool = False,
                token_index: torch.Tensor | None = None, caption_ids: torch.Tensor | None = None,
                caption_mask: torch.Tensor | None = None,
                caption_token_index: torch.Tensor | None = None) -> StudentOutput:
        """``local_pairs`` > 0: also pool up to that many tokens of every text over every image of the
        batch (``local_pair_similarity``, for the token-region contrastive loss). Its cost grows with
        B^2 x tokens, so tokens are drawn, in proportion to their in-batch IDF: the words that tell
        reports apart, where the grounding signal is. ``local_group`` > 0: pool them over the images of
        their own group of that many consecutive rows only (``heads.grouped_pair_similarity``: the cost
        grows with B x local_group). ``local_words``: also those tokens' own-image
        regions against each other (``local_word_similarity``, for ``loss.local_word_contrast``).
        ``local_affirmed``: draw those tokens only outside negations ("no pleural effusion");
        ``local_skip_normal``: nor from sentences that state normal anatomy ("The lungs are clear.").
        ``token_index``: the tokenizer's packing index of the texts (``encode_text``). ``caption_ids`` (and mask,
        index): also embed these texts (``caption_emb``, as ``encode_text``); packed, in the same text tower call."""
        img, patches, z, soft = self._image_and_heads(images, step)
        # the word states the local heads read (local_text_layer), and the global text vector
        text_tokens, text_pooled, caption_pooled = self._texts(
            input_ids, attention_mask, token_index, caption_ids, caption_mask, caption_token_index,
            self.config.local_text_layer if self.local_align is not None else None)
        text_mask = attention_mask.to(text_tokens.device).bool()
        out = StudentOutput(
            image_emb=F.normalize(self.image_proj(img.pooled), dim=-1),
            text_emb=F.normalize(self.text_proj(text_pooled), dim=-1),
            logit_scale=self.current_logit_scale(),
            patch_tokens=img.patches, patch_index=img.patch_index, grid_size=self.grid_size,
            text_tokens=text_tokens, text_mask=text_mask, keep_ratio=float(img.keep_ratio),
            head_index=img.head_index)
        if caption_pooled is not None:
            out.caption_emb = F.normalize(self.text_proj(caption_pooled), dim=-1)
        # local_pool_embedded: the words' regions pool the embedded patches themselves, while the head
        # conv's context only decides where to look (``kw`` of the local alignment calls)
        embedded = img.patches if img.head_patches is None else img.head_patches
        kw = {"values": embedded} if self.config.local_pool_embedded else {}
        if z is not None:
            pooled = (z.unsqueeze(-1) * patches).sum(1) / z.sum(1, keepdim=True).clamp_min(1e-6)
            out.mask, out.mask_scores = z, soft
            out.masked_image_emb = F.normalize(self.image_proj(pooled), dim=-1)
        if self.local_align is not None:
            out.local_visual, out.local_text, out.local_attn = self.local_align(text_tokens, patches, text_mask, **kw)
            if local_pairs:
                ids = input_ids.to(text_mask.device)
                drawable = text_mask & ~self._negated(ids) if local_affirmed else text_mask
                if local_skip_normal:
                    drawable = drawable & ~cued_sentence_tokens(ids, self.normal_cue_ids, self.sentence_end_ids)
                # informative words (rare in this batch: findings, sides) carry the grounding signal
                idf = batch_idf(ids, drawable, self.text_tower.model.config.vocab_size)
                index = sample_token_positions(drawable, local_pairs, idf)
                tokens = text_tokens.gather(1, index.unsqueeze(-1).expand(-1, -1, text_tokens.shape[-1]))
                out.local_pair_similarity = grouped_pair_similarity(self.local_align.pair_similarity, tokens,
                                                                    patches, local_group, **kw)
                if local_words:
                    out.local_word_similarity = self.local_align.word_similarity(tokens, patches, **kw)
                out.local_pair_mask = drawable.gather(1, index)
                out.local_pair_ids = ids.gather(1, index)
                out.local_pair_index = index
                out.local_word_idf = idf
                out.local_drawable_ids = ids.masked_fill(~drawable, -1)
        return out

    def _negated(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, L) bool: tokens inside a negation's scope (``heads.negated_tokens``) for this tokenizer."""
        return negated_tokens(input_ids, self.negation_cue_ids, self.sentence_end_ids)

    # ---- convenience (no grad, eval mode, CPU results) ----------------------------------------
    @torch.no_grad()
    def embed_images(self, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
        """(B, 1, H, W) in [0, 1] (resized to image_size if needed) -> (B, D) normalised CPU float32."""
        was_training = self.training
        self.eval()
        try:
            outs = []
            for chunk in images.split(batch_size):
                if tuple(chunk.shape[-2:]) != (self.image_size, self.image_size):
                    chunk = F.interpolate(chunk.float(), size=(self.image_size, self.image_size),
                                          mode="bilinear", align_corners=False, antialias=True).clamp(0, 1)
                outs.append(self.encode_image(chunk).float().cpu())
            return torch.cat(outs) if outs else torch.zeros(0, self.embed_dim)
        finally:
            self.train(was_training)

    @torch.no_grad()
    def embed_texts(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        """list of B strings -> (B, D) normalised CPU float32."""
        was_training = self.training
        self.eval()
        try:
            outs = []
            texts = list(texts)
            for i in range(0, len(texts), batch_size):
                tok = self.tokenize(texts[i:i + batch_size])
                emb = self.encode_text(tok["input_ids"], tok["attention_mask"], tok.get("token_index"))
                outs.append(emb.float().cpu())
            return torch.cat(outs) if outs else torch.zeros(0, self.embed_dim)
        finally:
            self.train(was_training)

    # ---- training helpers ----------------------------------------------------------------------
    def trunk_parameters(self) -> list[nn.Parameter]:
        """The shared trunk for loss-balance gradient norms: last image block + last text layer."""
        params = list(self.image_tower.last_block().parameters()) + list(self.text_tower.last_layer().parameters())
        return [p for p in params if p.requires_grad]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing in both towers (timm's and HF's)."""
        self.image_tower.set_grad_checkpointing(enable)
        self.text_tower.set_grad_checkpointing(enable)

    def num_layers(self) -> int:
        """Layer ids run 0..num_layers()-1; heads (projections, mask, local, temperature) get the last id."""
        return self._max_depth() + 3

    def _max_depth(self) -> int:
        return max(self.image_tower.depth, self.text_tower.depth)

    def param_layers(self) -> dict[str, int]:
        """Layer id of every parameter name: the one layer list of layer-wise LR decay and tower freezing.

        Each tower's ids come from its ``group_matcher()`` (0 embeddings, i+1 block i, depth+1 final norm);
        towers are aligned at the top (offset max_depth - depth); everything outside the towers is a head at
        num_layers()-1. LLRD: lr * decay**(num_layers()-1-id)."""
        ids = {}
        for prefix, tower, trunk in (("image_tower.trunk.", self.image_tower, self.image_tower.trunk),
                                     ("text_tower.model.", self.text_tower, self.text_tower.model)):
            offset = self._max_depth() - tower.depth
            for name, layer in tower_layer_ids(trunk, tower.group_matcher()).items():
                ids[prefix + name] = offset + layer
        head = self.num_layers() - 1
        return {name: ids.get(name, head) for name, _ in self.named_parameters()}


def tower_layer_ids(trunk: nn.Module, matcher: dict) -> dict[str, int]:
    """timm's layer ordinals of a tower trunk's names by its group matcher. Buffers count too, so stages
    frozen into buffers keep their ordinal and the trainable stages after them their ids."""
    names = [(name, None) for name in trunk.state_dict(keep_vars=True)]
    return group_with_matcher(names, matcher, reverse=True)
