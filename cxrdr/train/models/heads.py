"""Heads on top of the towers: projection to the shared space, Patch-IB mask heads, local alignment."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.convnext import ConvNeXtBlock

from cxrdr.train.models.gram_cosine import gram_pooled_cosine


class Projection(nn.Module):
    """Linear map (no bias) from a tower width to the shared embedding space (not normalised here)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=False)
        nn.init.normal_(self.proj.weight, std=in_dim ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class TeacherSpaceHeads(nn.Module):
    """Feature distillation heads (training only): per teacher, a linear map of the student's image and
    text embeddings into that teacher's embedding space, so that ``loss.w_feature`` can regress the
    teacher's stored embedding of the same crop and caption (CLIP-KD's FD, Yang et al. 2024). The teacher
    spaces differ in width and basis, so the map is learned; the open_clip export drops these heads.

    ``forward(image_emb, text_embs)`` -> {teacher: {"img": (B, Dt), "txt"/...: (B, Dt)}}, where
    ``text_embs`` names the texts (e.g. {"txt": report, "syn": caption}); None entries are skipped."""

    def __init__(self, embed_dim: int, teacher_dims: dict[str, int]):
        super().__init__()
        self.names = sorted(teacher_dims)
        # ModuleDict keys may not hold '.': the teacher names (e.g. 'ckpt-lite2-s1') map to indices
        self.image = nn.ModuleList(Projection(embed_dim, int(teacher_dims[n])) for n in self.names)
        self.text = nn.ModuleList(Projection(embed_dim, int(teacher_dims[n])) for n in self.names)

    def forward(self, image_emb: torch.Tensor, text_embs: dict[str, torch.Tensor | None]) -> dict[str, dict]:
        out = {}
        for name, to_image, to_text in zip(self.names, self.image, self.text):
            out[name] = {"img": to_image(image_emb)}
            out[name].update({key: to_text(emb) for key, emb in text_embs.items() if emb is not None})
        return out


class MaskHead(nn.Module):
    """Patch-IB mask: an MLP score per patch token, z = sigmoid(score) in [0, 1] (variant C).

    ``forward(patches (B, N, d), step=None) -> (z (B, N), soft (B, N))``; for this head z == soft.
    """

    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or max(16, dim // 2)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def logits(self, patches: torch.Tensor) -> torch.Tensor:
        return self.mlp(patches).squeeze(-1)

    def forward(self, patches: torch.Tensor, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        soft = torch.sigmoid(self.logits(patches))
        return soft, soft


class MaskHeadTopK(MaskHead):
    """Hard Top-K mask with a straight-through soft gradient (variants D, E).

    Forward value: exactly K = round(k_ratio * N) ones (the K highest scores), zeros elsewhere;
    gradient: that of the sigmoid scores (z = z_hard - z_soft.detach() + z_soft).
    Optional annealing: k_ratio goes linearly from ``k_ratio_start`` to ``k_ratio`` over
    ``anneal_steps`` training steps (step=None, i.e. evaluation, uses the final k_ratio).
    """

    def __init__(self, dim: int, k_ratio: float, hidden: int | None = None,
                 k_ratio_start: float | None = None, anneal_steps: int = 0):
        super().__init__(dim, hidden)
        self.k_ratio = float(k_ratio)
        self.k_ratio_start = None if k_ratio_start is None else float(k_ratio_start)
        self.anneal_steps = int(anneal_steps)

    def k_ratio_at(self, step: int | None) -> float:
        if step is None or self.k_ratio_start is None or self.anneal_steps <= 0:
            return self.k_ratio
        t = min(1.0, max(0, step) / self.anneal_steps)
        return self.k_ratio_start + (self.k_ratio - self.k_ratio_start) * t

    def num_kept(self, n: int, step: int | None = None) -> int:
        return max(1, min(n, round(self.k_ratio_at(step) * n)))

    def forward(self, patches: torch.Tensor, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(patches)
        soft = torch.sigmoid(logits)
        k = self.num_kept(logits.shape[1], step)
        hard = torch.zeros_like(soft).scatter(1, logits.detach().topk(k, dim=1).indices, 1.0)
        return hard - soft.detach() + soft, soft


class PatchGridConv(nn.Module):
    """ConvNeXt blocks (timm's, 3x3 depthwise) over the patch grid: (B, N, d) -> (B, N, d), N = gh * gw.

    Why: the heads must localise, so they read tokens whose content is local (the embedded patches),
    but a linear head on those can only add a position bias to a linear feature score; a few 3x3
    blocks give each patch its neighbourhood and a non-linearity while every output still sees only
    (2 * depth + 1)^2 patches, so a word cannot match a patch by its global content.
    """

    def __init__(self, dim: int, grid_size: tuple[int, int], depth: int, mlp_ratio: float = 2.0,
                 kernel_size: int = 3):
        super().__init__()
        self.grid_size = tuple(int(g) for g in grid_size)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim, kernel_size=kernel_size, mlp_ratio=mlp_ratio,
                                                    ls_init_value=None) for _ in range(depth)])

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        b, n, d = patches.shape
        gh, gw = self.grid_size
        if n != gh * gw:
            raise ValueError(f"PatchGridConv needs the full {gh}x{gw} grid, got {n} patches")
        x = self.blocks(patches.transpose(1, 2).reshape(b, d, gh, gw))
        return x.flatten(2).transpose(1, 2)


def build_patch_heads(config, dim: int, grid_size) -> tuple[nn.Module | None, nn.Module | None]:
    """(head_conv, mask_head) of a StudentConfig on patches of width ``dim``: the patch-grid convs the
    local and mask heads read (None without them), and the variant's Patch-IB mask head (None for A/B)."""
    needs_heads = config.use_local or config.use_mask
    head_conv = (PatchGridConv(dim, grid_size, config.head_conv_depth, kernel_size=config.head_conv_kernel)
                 if config.head_conv_depth and needs_heads else None)
    if config.use_topk:
        mask_head = MaskHeadTopK(dim, config.k_ratio, config.mask_hidden, config.k_ratio_start, config.k_anneal_steps)
    elif config.use_mask:
        mask_head = MaskHead(dim, config.mask_hidden)
    else:
        mask_head = None
    return head_conv, mask_head


class GridHeads(nn.Module):
    """The heads that read the whole patch grid, the head convs and then the mask head at its final K, as one module:
    what ``--cuda-graphs-heads`` replays as one graph (``grid_heads``). Returns the outputs that are tensors of their
    own: the convs' patches (with convs), z (Top-K: the hard mask with the scores' gradient) and the soft scores (for
    C's sigmoid mask z is the scores)."""

    def __init__(self, head_conv: nn.Module | None, mask_head: nn.Module | None):
        super().__init__()
        self.head_conv, self.mask_head = head_conv, mask_head

    def forward(self, patches: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = ()
        if self.head_conv is not None:
            patches = self.head_conv(patches)
            outputs = (patches,)
        if self.mask_head is not None:
            z, soft = self.mask_head(patches)
            outputs += (soft,) if z is soft else (z, soft)
        return outputs


def grid_heads(head_conv: nn.Module | None, mask_head: nn.Module | None, patches: torch.Tensor,
               step: int | None, graphs=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(the heads' patches after ``head_conv``, z, soft scores) of the patch grid (B, N, d); z and soft are None
    without a mask head. Through ``graphs`` (the student's ``heads_graphs``) as one CUDA graph where it applies once
    the mask keeps its final K (during a Top-K anneal K changes, and a graph holds one), else eagerly."""
    n, kept = patches.shape[1], getattr(mask_head, "num_kept", None)
    module = head_conv if head_conv is not None else mask_head  # whose training mode decides
    if module is not None and graphs is not None and (kept is None or kept(n, step) == kept(n)) \
            and graphs.applies(module, patches, tag="heads"):
        # the module is built only to capture it, or where a step must run eagerly: not at every replay
        outputs = list(graphs.run_module("heads", ("grid", f"K {kept(n)}" if kept else "no Top-K"),
                                         lambda: GridHeads(head_conv, mask_head), (patches,),
                                         lambda x: GridHeads(head_conv, mask_head)(x)))
        if head_conv is not None:
            patches = outputs.pop(0)
        if mask_head is None:
            return patches, None, None
        return (patches, outputs[0], outputs[0]) if len(outputs) == 1 else (patches, *outputs)  # C: z is the scores
    if head_conv is not None:
        patches = head_conv(patches)
    return (patches, *mask_head(patches, step)) if mask_head is not None else (patches, None, None)


def cosine_to_words(pooled: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """cos(pooled[i, j, k], words[i, k]) over the last dim: (B_text, B_image, L, D) x (B_text, L, D) unit
    words -> (B_text, B_image, L). The dot product over the pooled vector's norm, as F.normalize would
    give (eps 1e-12), without a normalised copy of ``pooled``: at batch 256 it holds B^2 x L x D
    values, and its copy and that copy's backward were a visible part of a GPU step."""
    dots = (pooled * words.unsqueeze(1)).sum(-1)
    return dots / torch.linalg.vector_norm(pooled, dim=-1).clamp_min(1e-12)


def zero_padded_words(text_mask: torch.Tensor | None, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (B, L, ...) tensor with the rows of padded words (text_mask False/0) set to 0."""
    if text_mask is None:
        return rows
    keep = text_mask.bool().unsqueeze(-1)
    return tuple(r * keep for r in rows)


class LocalAlign(nn.Module):
    """Token-to-patch alignment: text tokens query the patches with multi-head cross-attention.

    ``forward(text_tokens (B, L, dt), patches (B, N, dv), text_mask (B, L) bool/0-1 valid,
    patch_mask (B, N) bool valid or None) -> (v_tilde (B, L, D), t (B, L, D), attn (B, L, N))``:
    t_k is the projected text token, v_tilde_k the attention-pooled projected patches it looks at,
    attn the head-averaged attention. Padded queries are independent of the valid ones (each query
    attends on its own) and their outputs are zeroed; padded patches (patch_mask False) get no
    attention. Outputs are not normalised (the loss uses cosine similarity).
    """

    def __init__(self, text_dim: int, patch_dim: int, embed_dim: int, heads: int):
        super().__init__()
        self.text_proj = nn.Linear(text_dim, embed_dim)
        self.patch_proj = nn.Linear(patch_dim, embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, heads, batch_first=True)

    def forward(self, text_tokens: torch.Tensor, patches: torch.Tensor, text_mask: torch.Tensor | None = None,
                patch_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.text_proj(text_tokens)
        p = self.patch_proj(patches)
        key_padding = None if patch_mask is None else ~patch_mask.bool()
        v, attn = self.attn(t, p, p, key_padding_mask=key_padding, need_weights=True, average_attn_weights=True)
        return zero_padded_words(text_mask, v, t, attn)

    def pair_similarity(self, text_tokens: torch.Tensor, patches: torch.Tensor,
                        patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        """cos(v~_{j<-i,k}, t_{i,k}) for every text i, token k and image j: (B_text, B_image, L).

        v~_{j<-i,k} is token k of text i attention-pooled over image j's patches with the very
        weights of ``forward`` (its diagonal j = i is forward's v~). The token-region contrastive
        loss needs the off-diagonal too; nn.MultiheadAttention only pairs row i with image i, so
        the heads are written out here from its own projection weights, and every text token
        attends over each image in one fused ``scaled_dot_product_attention`` call (the
        (B, B, heads, L, N) attention tensor is never materialised).
        """
        t = self.text_proj(text_tokens)
        p = self.patch_proj(patches)
        (b_txt, length, width), b_img = t.shape, p.shape[0]
        heads = self.attn.num_heads
        w_q, w_k, w_v = self.attn.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.attn.in_proj_bias.chunk(3)
        q = F.linear(t, w_q, b_q).reshape(b_txt * length, heads, -1).transpose(0, 1)  # (H, B*L, d)
        k = F.linear(p, w_k, b_k).unflatten(-1, (heads, -1)).transpose(1, 2)  # (B_img, H, N, d)
        v = F.linear(p, w_v, b_v).unflatten(-1, (heads, -1)).transpose(1, 2)
        bias = _patch_bias(patch_mask, q)  # padded patches get no attention
        pooled = F.scaled_dot_product_attention(q.expand(b_img, -1, -1, -1), k, v, attn_mask=bias)
        pooled = pooled.transpose(1, 2).reshape(b_img, b_txt, length, width).transpose(0, 1)
        return cosine_to_words(self.attn.out_proj(pooled), F.normalize(t, dim=-1))  # pooled: (B_text, B_image, L, D)

    def word_similarity(self, text_tokens: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """cos(v~_{i,k}, t_{i,m}) within each pair: (B, L, L), the region word k pools from its own image
        against every word m of the same text (the other direction of the token-region contrast)."""
        v, t, _ = self(text_tokens, patches)
        return F.normalize(v, dim=-1) @ F.normalize(t, dim=-1).transpose(1, 2)


class CosineLocalAlign(nn.Module):
    """Token-to-patch alignment where the attention IS the word-patch similarity (GLoRIA, FILIP):
    attn_k = softmax_n(cos(t_k, p_n) / temperature), v~_k = sum_n attn_kn p^_n (unit patch vectors).

    Same interface as ``LocalAlign``. Why a second form: in ``LocalAlign`` the attention (query-key)
    and what is scored (value vs word) are separate projections, so a broad map over tokens that all
    carry the image's global content scores as well as a focused one and the attention stays near
    uniform. Here the patch a word matches best is also the patch it pools, so raising a word's score
    on its own image means finding the patches that look like the word: a detector map per word.
    """

    def __init__(self, text_dim: int, patch_dim: int, embed_dim: int, temperature: float = 0.1):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"local attention temperature must be > 0, got {temperature}")
        self.text_proj = nn.Linear(text_dim, embed_dim)
        self.patch_proj = nn.Linear(patch_dim, embed_dim)
        self.temperature = float(temperature)

    def _project(self, text_tokens, patches):
        return F.normalize(self.text_proj(text_tokens), dim=-1), F.normalize(self.patch_proj(patches), dim=-1)

    def _logits(self, t, p, patch_mask):
        logits = t @ p.transpose(-2, -1) / self.temperature
        if patch_mask is not None:
            logits = logits.masked_fill(~patch_mask.bool().unsqueeze(-2), float("-inf"))
        return logits

    def _values(self, p, values):
        """Unit vectors the attention pools: the patches it is computed on, or ``values`` (same grid)."""
        if values is None:
            return p
        if values.shape[:-1] != p.shape[:-1]:
            raise ValueError(f"values {tuple(values.shape)} must match the patches {tuple(p.shape)} but the width")
        return F.normalize(self.patch_proj(values), dim=-1)

    def forward(self, text_tokens: torch.Tensor, patches: torch.Tensor, text_mask: torch.Tensor | None = None,
                patch_mask: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``values`` (B, N, d): pool these patches (through the same projection) with the attention
        computed on ``patches``; None pools ``patches`` themselves."""
        t, p = self._project(text_tokens, patches)
        attn = self._logits(t, p, patch_mask).softmax(-1)  # (B, L, N)
        return zero_padded_words(text_mask, attn @ self._values(p, values), t, attn)

    def pair_similarity(self, text_tokens: torch.Tensor, patches: torch.Tensor,
                        patch_mask: torch.Tensor | None = None, values: torch.Tensor | None = None) -> torch.Tensor:
        """cos(v~_{j<-i,k}, t_{i,k}) for every text i, token k and image j: (B_text, B_image, L).

        The (B_text, B_image, L, N) attention is never materialised: every text token attends over each
        image in one fused ``scaled_dot_product_attention`` call (``pooled_cosine_by_sdpa``), or, where that
        costs more FLOPs (``gram_form_is_cheaper``: the GPU students' 196 patches in 512 dims at batch 256,
        pooling the patches themselves), the cosine is read off the Gram matrices of the patches
        (``pooled_cosine_by_gram``). The CPU students (144 patches, 64 dims) always take the fused form."""
        t, p = self._project(text_tokens, patches)  # (Bt, L, D), (Bi, N, D)
        queries, (n, width) = t.shape[0] * t.shape[1], p.shape[1:]
        gram = gram_form_is_cheaper(queries, n, width, separate_values=values is not None)
        pooled_cosine = pooled_cosine_by_gram if gram else pooled_cosine_by_sdpa
        return pooled_cosine(t, p, None if values is None else self._values(p, values), self.temperature, patch_mask)

    def word_similarity(self, text_tokens: torch.Tensor, patches: torch.Tensor,
                        values: torch.Tensor | None = None) -> torch.Tensor:
        """cos(v~_{i,k}, t_{i,m}) within each pair: (B, L, L) (see ``LocalAlign.word_similarity``)."""
        v, t, _ = self(text_tokens, patches, values=values)
        return F.normalize(v, dim=-1) @ t.transpose(1, 2)


def grouped_pair_similarity(pair_similarity, tokens: torch.Tensor, patches: torch.Tensor, group: int,
                            **kw) -> torch.Tensor:
    """``pair_similarity(tokens, patches, **kw)`` (B_text, B_image, L) of every text over every image (``group`` 0,
    or a group as large as the batch), or, with ``group`` G, of each text over the images of its own group of G
    consecutive rows only: (B, G, L), column j of row i the image (i // G) * G + j, the own image at column i % G; a
    last group with fewer rows gets -inf in the columns it lacks (no image, no negative). The cost of the pairs
    grows with B x G instead of B^2 (``loss.local_group_size``); tensors in ``kw`` (the values pooled) are cut by row
    as the images are. Why groups of consecutive rows: the batch's order is the loader's shuffle, so they are random
    groups, and each is one call of the all-pairs form (the Gram form's single matrix products stay)."""
    if not group or group >= tokens.shape[0]:
        return pair_similarity(tokens, patches, **kw)
    # split, not slices: each slice's backward would write a zero gradient of the whole batch
    cut = {k: v.split(group) for k, v in kw.items() if torch.is_tensor(v)}
    parts = []
    for i, (words, images) in enumerate(zip(tokens.split(group), patches.split(group))):
        part = pair_similarity(words, images, **{**kw, **{k: v[i] for k, v in cut.items()}})
        parts.append(F.pad(part, (0, 0, 0, group - part.shape[1]), value=float("-inf")))
    return torch.cat(parts)


def _patch_bias(patch_mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """(B_image, 1, 1, N) additive attention bias: -inf on padded patches (patch_mask False), else None."""
    if patch_mask is None:
        return None
    bias = torch.zeros(patch_mask.shape, dtype=like.dtype, device=like.device)
    return bias.masked_fill(~patch_mask.bool(), float("-inf"))[:, None, None, :]


def gram_form_is_cheaper(queries: int, patches: int, dims: int, separate_values: bool = False) -> bool:
    """Whether ``pooled_cosine_by_gram`` does fewer forward FLOPs than ``pooled_cosine_by_sdpa`` for ``queries``
    words (B_text x L) against each image: pooling the patches themselves, 2QND + 2N^2 D + 2QN^2 against 4QND,
    i.e. Q (D - N) > N D: never with more patches than dims, and at 196 patches and 512 dims from 318 words a
    batch (batch 40 at 8 words). ``separate_values`` cost the Gram form another 2QND: never then."""
    return not separate_values and queries * (dims - patches) > patches * dims


def pooled_cosine_by_sdpa(words: torch.Tensor, patches: torch.Tensor, values: torch.Tensor | None,
                          temperature: float, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``CosineLocalAlign.pair_similarity`` from unit words (B_text, L, D) and unit patches (B_image, N, D):
    every word attends over each image in one ``scaled_dot_product_attention`` call (scale 1/temperature on
    unit vectors: the cosine softmax), pooling ``values`` (unit, the patches' grid; None: the patches), then
    the cosine of each pooled vector with its word. ~1.5x faster on CPU than einsums; it holds the
    (B_image, B_text x L, D) pooled vectors."""
    (b_txt, length, width), b_img = words.shape, patches.shape[0]
    q = words.reshape(1, 1, b_txt * length, width).expand(b_img, -1, -1, -1)
    pooled = F.scaled_dot_product_attention(q, patches.unsqueeze(1),
                                            (patches if values is None else values).unsqueeze(1),
                                            attn_mask=_patch_bias(patch_mask, q), scale=1.0 / temperature)
    return cosine_to_words(pooled[:, 0].reshape(b_img, b_txt, length, width).transpose(0, 1), words)


def pooled_cosine_by_gram(words: torch.Tensor, patches: torch.Tensor, values: torch.Tensor | None,
                          temperature: float, patch_mask: torch.Tensor | None = None) -> torch.Tensor:
    """As ``pooled_cosine_by_sdpa``, without forming any pooled vector. With a = softmax(P t / T) over image
    j's N patches and V its values (unit rows), the pooled vector is V^T a, so
        cos(V^T a, t) = (a . V t) / sqrt(a^T (V V^T) a)
    needs the (B_image, B_text x L, N) scores and the (B_image, N, N) Gram matrices only: 2N(N + D)
    FLOPs a (word, image) pair, plus 2N^2 D an image, instead of 4ND (``values`` add 2ND a pair), and no
    (B_image, B_text x L, D) tensor. Why it exists: at D 512 the fused attention falls back to the generic
    memory-efficient kernel, whose backward took 17 ms of the H100's 120 ms D step
    (benchmarks/results/profiles/nvidia-h100-0ef6026-D.txt). It runs outside autocast, in fp32 (TF32 where the
    loop allows it): the fused kernels keep their scores in fp32 as well, and a^T G a loses digits in bf16.
    Its forward and backward are written out in one memory layout (``gram_cosine.gram_pooled_cosine``)."""
    return gram_pooled_cosine(words, patches, values, temperature, patch_mask)


def build_local_align(kind: str, text_dim: int, patch_dim: int, embed_dim: int, heads: int,
                      temperature: float) -> nn.Module:
    """'mha': ``LocalAlign`` (the seeds' multi-head cross-attention); 'cosine': ``CosineLocalAlign``."""
    if kind == "mha":
        return LocalAlign(text_dim, patch_dim, embed_dim, heads)
    if kind == "cosine":
        return CosineLocalAlign(text_dim, patch_dim, embed_dim, temperature)
    raise ValueError(f"local_attention must be 'mha' or 'cosine', got {kind!r}")


def batch_idf(input_ids: torch.Tensor, text_mask: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """(B, L) inverse document frequency of each token within the batch: log(B / rows holding that id).

    Words every report has ('the', 'no', '[CLS]') get 0; a finding named in few reports gets the most.
    Counted through a (B, vocab_size) table of which row holds which id: comparing every token with
    every other, (B, L, B, L), took 270 MB at batch 256 and 64 tokens. ``vocab_size`` (ids are below
    it) saves reading the largest id back from the device.
    """
    mask = text_mask.bool()
    ids = input_ids.long()
    width = int(ids.max()) + 1 if vocab_size is None else int(vocab_size)
    padded = ids.masked_fill(~mask, width)  # padding counts in a spare column
    holds = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device).scatter_(1, padded, True)
    rows_with_token = holds[:, :width].sum(0).gather(0, padded.clamp(max=width - 1).flatten()).view_as(ids)
    return torch.log(ids.shape[0] / rows_with_token.clamp_min(1).float()) * mask


def _id_tensor(ids, device) -> torch.Tensor:
    """Token ids (a list, or a tensor such as a model's buffer) as a long tensor on ``device``."""
    if torch.is_tensor(ids):
        return ids.to(device=device, dtype=torch.long)
    return torch.as_tensor(list(ids), dtype=torch.long, device=device)


def negated_tokens(input_ids: torch.Tensor, cue_ids, end_ids) -> torch.Tensor:
    """(B, L) bool: tokens in a negation's scope (NegEx-style, the rule CheXpert's labeller starts
    from): from a cue ('no', 'without', ...) to the end of its sentence ('.', ';'), the cue included.

    Why: a report names most findings only to deny them ("There is no pleural effusion."). Grounding
    the word 'effusion' of such a sentence in its image teaches the word to avoid effusions.
    """
    ids = input_ids.long()
    cue = torch.isin(ids, _id_tensor(cue_ids, ids.device))
    end = torch.isin(ids, _id_tensor(end_ids, ids.device))
    cues_before = cue.long().cumsum(1)  # cues up to and including each token
    # cue count at the start of each token's sentence: carried forward from the last sentence end
    at_end = torch.where(end, cues_before, torch.zeros_like(cues_before))
    sentence_base = at_end.cummax(1).values
    started = torch.cat([torch.zeros_like(sentence_base[:, :1]), sentence_base[:, :-1]], dim=1)
    return ((cues_before - started) > 0) & ~end


def cued_sentence_tokens(input_ids: torch.Tensor, cue_ids, end_ids) -> torch.Tensor:
    """(B, L) bool: every token of a sentence (ended by '.' or ';') that holds one of the cues.

    Why: a report states normal anatomy in whole sentences whose cue may come last ("Heart size is
    normal.", "The lungs are clear."); CheXpert's labeller reads them as negative mentions. Their words
    name no finding in the image, so they are no grounding signal either. Sentence ends are left out, as
    in ``negated_tokens``.
    """
    ids = input_ids.long()
    cue = torch.isin(ids, _id_tensor(cue_ids, ids.device))
    end = torch.isin(ids, _id_tensor(end_ids, ids.device))
    sentence = end.long().cumsum(1) - end.long()  # a sentence's end belongs to it
    has_cue = torch.zeros(ids.shape[0], ids.shape[1] + 1, dtype=torch.long, device=ids.device)
    has_cue.scatter_add_(1, sentence, cue.long())
    return (has_cue.gather(1, sentence) > 0) & ~end


def sample_token_positions(text_mask: torch.Tensor, max_tokens: int,
                           weights: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) positions of up to ``max_tokens`` valid tokens per row, drawn without replacement (torch
    RNG) with probability proportional to ``weights`` (uniform if None; Efraimidis-Spirakis keys), in order.

    Rows with fewer valid tokens fill up with padding positions; gather the mask with the same index
    to know which are real. T = min(max_tokens, L).
    """
    u = torch.rand(text_mask.shape, device=text_mask.device).clamp_min(1e-12)
    keys = torch.log(u) if weights is None else torch.log(u) / (weights.float() + 1e-4)
    keys = keys.masked_fill(~text_mask.bool(), float("-inf"))
    count = min(int(max_tokens), text_mask.shape[1])
    return keys.topk(count, dim=1).indices.sort(dim=1).values


def init_logit_scale(init: float) -> nn.Parameter:
    """Learnable log temperature, initialised at log(init) (CLIP: 1/0.07)."""
    return nn.Parameter(torch.tensor(math.log(init), dtype=torch.float32))
