"""Training losses: CLIP InfoNCE with pair selection, MobileCLIP distillation, Patch-IB, local alignment.

Conventions
- Embeddings are L2-normalised; logits = logit_scale * img @ txt.T (logit_scale already exp'd).
- A *target matrix* T (B, B) is row-stochastic: T[i, j] is the probability that anchor i (the image
  for i2t, the text for t2i) pairs with candidate j. Every target used here (identity, uniform over
  positives, label similarity, text-text affinity) is symmetric in meaning, so the same matrix
  serves both directions.
- Pair selection (`clip_loss`):
  * in-batch negatives: T = identity (default);
  * false negatives: a (B, B) bool `positives` (diagonal always true; `positive_mask` builds it from
    same subject / same study / identical report text). fn_mode="multi": T uniform over positives;
    fn_mode="mask": off-diagonal positives are removed from the softmax denominator, T = identity;
  * label soft targets (MedCLIP): T = softmax(cos(label_i, label_j) / tau) over j; they replace the
    positives-derived targets ("mask" mode still removes the positives from the denominator);
  * hard negatives (Robinson et al., ICLR 2021): for anchor i with negatives N_i (entries with
    zero target), the denominator's negative sum  sum_j e^{s_ij}  becomes the importance-weighted
    |N_i| * sum_j w_ij e^{s_ij},  w_ij = softmax_j(beta * s_ij) over N_i (weights detached: they
    act as a sampling distribution). beta = 0 gives plain InfoNCE; `beta_schedule` ramps beta;
  * memory bank (`TextQueue`): past text embeddings appended as extra i2t negatives.
- Distillation (MobileCLIP): D = 1/2 (D_i2t + D_t2i) with the teachers' probabilities averaged
  after each teacher's own softmax (own logit scale). `kind="kl"` reports KL(P_teacher || Q_student)
  (0 when the matrices match); `kind="ce"` the soft-target cross-entropy (= KL + teacher entropy);
  gradients are identical. A text-only teacher (no image embeddings) supplies its text-text
  affinities A = t_txt @ t_txt.T: since image i is paired with text i, softmax(scale * A[i]) is
  used as the teacher's i2t *and* t2i target row for anchor i (A is symmetric).
- The total: for B in {B_real, B_syn}: (1-lambda) * CLIP(B) + lambda * Distill(B) (lambda -> 0 when
  the batch has no teacher embeddings), plus Patch-IB on B_real (masked InfoNCE, lambda_sparse *
  mean(z), mu * MSE(diag s_mask, diag s_full)) and w_local * local alignment. `compute_losses`
  returns each *weighted* contribution under its key, so 'total' is their sum and `loss_balance`
  compares like with like.
- DDP: contrastive/distillation terms run on features gathered by `cxrdr.train.distributed` (local slice
  keeps its gradient); per-sample means use `global_mean`; the logit scale goes through
  `replicated`. On every rank each value equals the single-process value on the global batch and
  the gradient on local features is the single-process gradient. The loop must backward
  `total * distributed.loss_scale_for_ddp()` so that DDP's averaging gives the single-process
  parameter gradient (see train/distributed.py).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from cxrdr.train import distributed as dist_utils

FN_CRITERIA = ("subject", "study", "text")
FN_MODES = ("multi", "mask")
DISTILL_KINDS = ("kl", "ce")
# Local alignment objectives: "contrastive" (token-region InfoNCE over the batch's images, GLoRIA/MGCA
# style), "cosine" (the seeds' mean 1 - cos(v~_k, t_k), which a constant attention map satisfies), "both".
LOCAL_LOSSES = ("contrastive", "cosine", "both")
# Keys `compute_losses` may return (absent terms are left out), plus "total".
LOSS_KEYS = ("clip", "distill", "clip_syn", "distill_syn", "mask_nce", "sparsity", "consistency", "local")


def _full_precision(fn):
    """Run a loss outside autocast: similarity matrices and log-softmaxes stay float32 under AMP."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        contexts = [torch.autocast(device_type=d, enabled=False)
                    for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
        with contextlib.ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx)
            return fn(*args, **kwargs)

    return wrapper


# ----------------------------------------------------------------------------- configuration
LOSS_RANGES = {"lambda_distill": "[0, 1]", "w_i2t": "[0, inf)", "w_t2i": "[0, inf)",
               "default_teacher_scale": "(0, inf)", "w_mask_nce": "[0, inf)", "lambda_sparse": "[0, inf)",
               "mu_consistency": "[0, inf)", "w_local": "[0, inf)", "label_temperature": "(0, inf)",
               "beta_min": "[0, inf)", "beta_max": "[0, inf)", "queue_size": "[0, inf)",
               "local_temperature": "(0, inf)", "local_tokens": "[1, inf)", "local_entropy": "[0, inf)"}


@dataclass
class LossConfig:
    """Weights and pair-selection options of the training objective (YAML `loss:` section)."""

    lambda_distill: float = 0.7  # MobileCLIP's lambda: (1-l)*CLIP + l*distill
    w_i2t: float = 0.5
    w_t2i: float = 0.5
    use_syn: bool = True  # also apply CLIP + distill on B_syn (aug image, synthetic caption)
    distill_kind: str = "kl"  # "kl" (0 at a perfect match) or "ce" (soft-target cross-entropy)
    teacher_scales: dict[str, float] = field(default_factory=dict)  # per-teacher logit scale
    default_teacher_scale: float = 100.0
    # Patch-IB and local alignment
    w_mask_nce: float = 1.0
    lambda_sparse: float = 0.01
    mu_consistency: float = 1.0
    detach_full_similarity: bool = True  # s_full is the target of the consistency MSE
    w_local: float = 0.5
    local_loss: str = "contrastive"  # LOCAL_LOSSES; chosen by the pointing game (README, Localisation)
    local_temperature: float = 0.1  # softmax temperature of the token-region contrastive term
    local_tokens: int = 16  # text tokens per report drawn each step for the contrastive term (cost ~ B^2 x this)
    local_entropy: float = 0.0  # weight of the word-attention entropy penalty (attention_entropy); 0 = off
    local_word_contrast: bool = False  # also across the words of a report (word_contrastive_loss); off: it
    # made the attention flatter on the CPU ladder (README, Localisation)
    # Pair selection
    fn_masking: str = "none"  # "none", "all" or a comma list of subject,study,text
    fn_mode: str = "multi"  # "multi": uniform target over positives; "mask": drop them from denominators
    label_soft_targets: bool = False
    label_temperature: float = 0.1
    # hard-negative curriculum (beta_max = 0 disables it). beta multiplies the *scaled* logits
    # (Robinson's beta/t), so with logit scales of ~14-100 useful values are ~0.05-0.5.
    beta_min: float = 0.0
    beta_max: float = 0.0
    queue_size: int = 0  # memory bank of past text embeddings (i2t negatives); 0 = off

    def __post_init__(self) -> None:
        from cxrdr.common.yamlio import validate_fields

        validate_fields(self, "loss option", LOSS_RANGES)
        if self.distill_kind not in DISTILL_KINDS:
            raise ValueError(f"loss.distill_kind must be one of {DISTILL_KINDS}, got {self.distill_kind!r}")
        if self.fn_mode not in FN_MODES:
            raise ValueError(f"loss.fn_mode must be one of {FN_MODES}, got {self.fn_mode!r}")
        if not 0.0 <= self.lambda_distill <= 1.0:
            raise ValueError(f"loss.lambda_distill must be in [0, 1], got {self.lambda_distill}")
        if self.label_temperature <= 0:
            raise ValueError(f"loss.label_temperature must be > 0, got {self.label_temperature}")
        if self.queue_size < 0:
            raise ValueError(f"loss.queue_size must be >= 0, got {self.queue_size}")
        if self.local_loss not in LOCAL_LOSSES:
            raise ValueError(f"loss.local_loss must be one of {LOCAL_LOSSES}, got {self.local_loss!r}")
        parse_fn_masking(self.fn_masking)  # validates

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "LossConfig":
        from cxrdr.common.yamlio import check_known_fields

        data = dict(data or {})
        check_known_fields(cls, data, "loss option")
        return cls(**data)

    def teacher_scale(self, name: str) -> float:
        return float(self.teacher_scales.get(name, self.default_teacher_scale))


def parse_fn_masking(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """'none' -> (), 'all' -> subject,study,text, else a comma list (or sequence) of those."""
    if spec is None:
        return ()
    items = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if items in ([], ["none"]):
        return ()
    if items == ["all"]:
        return FN_CRITERIA
    bad = [s for s in items if s not in FN_CRITERIA]
    if bad:
        raise ValueError(f"loss.fn_masking: unknown criterion {bad}; use none, all or a comma list of {FN_CRITERIA}")
    return tuple(dict.fromkeys(items))


def teacher_scales_from_info(dataset_info: dict) -> dict[str, float]:
    """{teacher name: logit_scale} from dataset.json's "teachers" list (entries without one skipped)."""
    out = {}
    for t in dataset_info.get("teachers", []) or []:
        if t.get("name") and t.get("logit_scale") is not None:
            out[str(t["name"])] = float(t["logit_scale"])
    return out


# ----------------------------------------------------------------------------- pair selection
def _id_list(values: Any) -> list | None:
    if values is None:
        return None
    if torch.is_tensor(values):
        return values.tolist()
    return list(values)


def _norm_text(text: Any) -> str | None:
    if text is None:
        return None
    norm = " ".join(str(text).split()).lower()
    return norm or None


def positive_mask(
    subject_ids: Sequence | torch.Tensor | None = None,
    study_ids: Sequence | torch.Tensor | None = None,
    texts: Sequence[str] | None = None,
    criteria: Sequence[str] = FN_CRITERIA,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(B, B) bool: i and j share a subject, a study, or an identical text (whitespace/case
    normalised); the diagonal is always true. Missing ids ('' or None) never match."""
    columns = {"subject": _id_list(subject_ids), "study": _id_list(study_ids), "text": _id_list(texts)}
    lengths = {len(v) for v in columns.values() if v is not None}
    if len(lengths) > 1:
        raise ValueError(f"positive_mask: subject/study/text lists differ in length: {sorted(lengths)}")
    if not lengths:
        raise ValueError("positive_mask: give at least one of subject_ids, study_ids, texts")
    n = lengths.pop()
    mask = torch.eye(n, dtype=torch.bool)
    for name in criteria:
        values = columns.get(name)
        if values is None:
            continue
        if name == "text":
            values = [_norm_text(v) for v in values]
        else:
            values = [None if v is None or v == "" else v for v in values]
        # integer codes per distinct value (-1 = missing), compared as a (B, B) outer equality
        table: dict = {}
        codes = torch.tensor([-1 if v is None else table.setdefault(v, len(table)) for v in values])
        mask |= (codes[:, None] == codes[None, :]) & (codes[:, None] >= 0)
    return mask.to(device) if device is not None else mask


def label_soft_targets(labels: torch.Tensor, temperature: float = 0.1) -> torch.Tensor:
    """MedCLIP-style targets: softmax_j(cos(l_i, l_j) / temperature), rows summing to 1.

    `labels` (B, C) label vectors in [0, 1] (NaN and negatives count as 0). An all-zero row gets an
    extra "no label" dimension so that two unlabelled/normal studies are similar to each other.
    """
    lab = torch.nan_to_num(labels.detach().float(), nan=0.0).clamp_min(0.0)
    empty = (lab.sum(dim=1, keepdim=True) == 0).float()
    vec = F.normalize(torch.cat([lab, empty], dim=1), dim=1)
    return torch.softmax(vec @ vec.T / temperature, dim=1)


def beta_schedule(step: int, total: int, beta_min: float, beta_max: float) -> float:
    """Hard-negative curriculum: beta rises linearly from beta_min (step 0) to beta_max (step total)."""
    if total <= 0:
        return float(beta_max)
    frac = min(max(step / total, 0.0), 1.0)
    return float(beta_min + (beta_max - beta_min) * frac)


class TextQueue:
    """FIFO memory bank of past (detached) text embeddings used as extra i2t negatives (MoCo-style).

    Under DDP enqueue the *gathered* texts so every rank holds the same queue.
    """

    def __init__(self, size: int, dim: int, device: torch.device | str = "cpu"):
        if size <= 0 or dim <= 0:
            raise ValueError(f"TextQueue needs size > 0 and dim > 0, got size={size}, dim={dim}")
        self.size, self.dim = size, dim
        self.buffer = torch.zeros(size, dim, device=device)
        self.ptr = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def get(self) -> torch.Tensor | None:
        """The stored embeddings (n, dim), or None while empty."""
        return None if self.count == 0 else self.buffer[: self.count]

    @torch.no_grad()
    def enqueue(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"TextQueue.enqueue: expected (n, {self.dim}), got {tuple(x.shape)}")
        x = x.detach().to(self.buffer.device, self.buffer.dtype)[-self.size:]
        n = x.shape[0]
        idx = (self.ptr + torch.arange(n, device=self.buffer.device)) % self.size
        self.buffer[idx] = x
        self.ptr = (self.ptr + n) % self.size
        self.count = min(self.count + n, self.size)

    def to(self, device: torch.device | str) -> "TextQueue":
        self.buffer = self.buffer.to(device)
        return self

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.cpu(), "ptr": self.ptr, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["buffer"].shape) != (self.size, self.dim):
            raise ValueError(f"TextQueue state has shape {tuple(state['buffer'].shape)}, "
                             f"expected {(self.size, self.dim)}")
        self.buffer = state["buffer"].to(self.buffer.device, self.buffer.dtype)
        self.ptr, self.count = int(state["ptr"]), int(state["count"])


# ----------------------------------------------------------------------------- contrastive core
def _soft_ce_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row -sum_j t_ij log softmax(logits)_ij; entries with zero target contribute nothing
    (so -inf logits there are safe)."""
    logp = torch.log_softmax(logits, dim=1)
    logp = torch.where(targets > 0, logp, torch.zeros_like(logp))
    return -(targets * logp).sum(dim=1)


def _direction_loss(logits: torch.Tensor, targets: torch.Tensor, exclude: torch.Tensor | None,
                    beta: float) -> torch.Tensor:
    """Mean over anchors of the soft-target InfoNCE of one direction, with optional exclusions
    (dropped from the denominator) and Robinson hard-negative reweighting of zero-target entries."""
    if exclude is not None:
        logits = logits.masked_fill(exclude, float("-inf"))
        targets = targets.masked_fill(exclude, 0.0)
        targets = targets / targets.sum(dim=1, keepdim=True).clamp_min(1e-12)
    if beta != 0.0:
        neg = targets == 0
        if exclude is not None:
            neg = neg & ~exclude
        n_neg = neg.sum(dim=1, keepdim=True)
        has_neg = n_neg > 0
        weights_in = (beta * logits.detach()).masked_fill(~neg, float("-inf"))
        weights_in = torch.where(has_neg, weights_in, torch.zeros_like(weights_in))
        log_w = torch.log_softmax(weights_in, dim=1)  # log w_ij over N_i
        adjust = torch.log(n_neg.clamp_min(1).to(logits.dtype)) + log_w
        logits = torch.where(neg, logits + adjust, logits)
    return _soft_ce_rows(logits, targets).mean()


def _targets(n: int, positives: torch.Tensor | None, soft_targets: torch.Tensor | None,
             fn_mode: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    eye = torch.eye(n, dtype=torch.bool, device=device)
    exclude = None
    if positives is not None:
        if tuple(positives.shape) != (n, n):
            raise ValueError(f"positives must be ({n}, {n}), got {tuple(positives.shape)}")
        positives = positives.to(device=device, dtype=torch.bool) | eye
        if fn_mode == "mask":
            exclude = positives & ~eye
    if soft_targets is not None:
        if tuple(soft_targets.shape) != (n, n):
            raise ValueError(f"soft_targets must be ({n}, {n}), got {tuple(soft_targets.shape)}")
        targets = soft_targets.to(device=device, dtype=dtype)
    elif positives is not None and fn_mode == "multi":
        targets = positives.to(dtype)
        targets = targets / targets.sum(dim=1, keepdim=True)
    else:
        targets = eye.to(dtype)
    return targets, exclude


@_full_precision
def clip_loss(
    img: torch.Tensor,
    txt: torch.Tensor,
    logit_scale: torch.Tensor | float,
    w_i2t: float = 0.5,
    w_t2i: float = 0.5,
    positives: torch.Tensor | None = None,
    beta: float = 0.0,
    soft_targets: torch.Tensor | None = None,
    fn_mode: str = "multi",
    extra_txt: torch.Tensor | None = None,
    gather: bool | None = None,
) -> torch.Tensor:
    """Symmetric InfoNCE  w_i2t * L_i2t + w_t2i * L_t2i  with the pair selection of the module doc.

    img, txt: (B, D) normalised; positives: (B, B) bool; soft_targets: (B, B) row-stochastic;
    extra_txt: (Q, D) extra i2t negatives (memory bank); gather: all-gather img/txt over DDP ranks
    first (None = when a process group runs; positives/soft_targets must then be global).
    """
    if fn_mode not in FN_MODES:
        raise ValueError(f"fn_mode must be one of {FN_MODES}, got {fn_mode!r}")
    if gather is None:
        gather = dist_utils.is_dist()
    if gather:
        img, txt = dist_utils.gather_features(img), dist_utils.gather_features(txt)
        logit_scale = dist_utils.replicated(logit_scale)
    if img.shape != txt.shape:
        raise ValueError(f"clip_loss: image {tuple(img.shape)} and text {tuple(txt.shape)} embeddings differ in shape")
    img, txt = img.float(), txt.float()
    scale = torch.as_tensor(logit_scale, device=img.device).float()
    n = img.shape[0]
    logits = scale * img @ txt.T
    targets, exclude = _targets(n, positives, soft_targets, fn_mode, img.device, img.dtype)

    loss = img.new_zeros(())
    if w_i2t:
        logits_i2t, targets_i2t, exclude_i2t = logits, targets, exclude
        if extra_txt is not None and extra_txt.shape[0] > 0:
            extra = scale * img @ extra_txt.to(img.device, img.dtype).T
            logits_i2t = torch.cat([logits, extra], dim=1)
            targets_i2t = torch.cat([targets, targets.new_zeros(n, extra.shape[1])], dim=1)
            if exclude is not None:
                exclude_i2t = torch.cat([exclude, exclude.new_zeros(n, extra.shape[1])], dim=1)
        loss = loss + w_i2t * _direction_loss(logits_i2t, targets_i2t, exclude_i2t, beta)
    if w_t2i:
        exclude_t2i = exclude.T if exclude is not None else None
        loss = loss + w_t2i * _direction_loss(logits.T, targets, exclude_t2i, beta)
    return loss


# ----------------------------------------------------------------------------- distillation
def teacher_probabilities(
    teacher_img_list: Sequence[torch.Tensor | None],
    teacher_txt_list: Sequence[torch.Tensor],
    teacher_scales: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ensemble targets (P_i2t, P_t2i), each (B, B): every teacher's softmax with its own scale,
    averaged after the softmax. A teacher with img None contributes softmax(scale * txt @ txt.T)."""
    if not (len(teacher_img_list) == len(teacher_txt_list) == len(teacher_scales)) or not teacher_txt_list:
        raise ValueError("teacher_probabilities: need equally long, non-empty teacher img/txt/scale lists")
    p_i2t, p_t2i = [], []
    for t_img, t_txt, t_scale in zip(teacher_img_list, teacher_txt_list, teacher_scales):
        t_txt = F.normalize(t_txt.detach().float(), dim=-1)
        if t_img is None:  # text-only teacher: text-text affinities as soft targets
            probs = torch.softmax(float(t_scale) * t_txt @ t_txt.T, dim=1)
            p_i2t.append(probs)
            p_t2i.append(probs)
        else:
            t_img = F.normalize(t_img.detach().float().to(t_txt.device), dim=-1)
            t_logits = float(t_scale) * t_img @ t_txt.T
            p_i2t.append(torch.softmax(t_logits, dim=1))
            p_t2i.append(torch.softmax(t_logits.T, dim=1))
    return torch.stack(p_i2t).mean(0), torch.stack(p_t2i).mean(0)


def _soft_divergence(student_logits: torch.Tensor, probs: torch.Tensor, kind: str) -> torch.Tensor:
    ce = _soft_ce_rows(student_logits, probs)
    if kind == "ce":
        return ce.mean()
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=1)
    return (ce - entropy).mean()


@_full_precision
def distill_loss(
    student_img: torch.Tensor,
    student_txt: torch.Tensor,
    student_scale: torch.Tensor | float,
    teacher_img_list: Sequence[torch.Tensor | None],
    teacher_txt_list: Sequence[torch.Tensor],
    teacher_scales: Sequence[float],
    kind: str = "kl",
    gather: bool | None = None,
) -> torch.Tensor:
    """MobileCLIP distillation 1/2 (D_i2t + D_t2i) of the student's similarity matrix against the
    teachers' averaged probabilities. kind="kl": KL(P||Q) (0 when the matrices match);
    kind="ce": soft-target cross-entropy (KL + teacher entropy). Same gradient."""
    if kind not in DISTILL_KINDS:
        raise ValueError(f"distill kind must be one of {DISTILL_KINDS}, got {kind!r}")
    if gather is None:
        gather = dist_utils.is_dist()
    if gather:
        student_img = dist_utils.gather_features(student_img)
        student_txt = dist_utils.gather_features(student_txt)
        teacher_img_list = [dist_utils.gather_features(t) for t in teacher_img_list]
        teacher_txt_list = [dist_utils.gather_features(t) for t in teacher_txt_list]
        student_scale = dist_utils.replicated(student_scale)
    for t in list(teacher_txt_list) + [t for t in teacher_img_list if t is not None]:
        if t.shape[0] != student_img.shape[0]:
            raise ValueError(f"distill_loss: teacher batch {t.shape[0]} != student batch {student_img.shape[0]}")
    img, txt = student_img.float(), student_txt.float()
    scale = torch.as_tensor(student_scale, device=img.device).float()
    logits = scale * img @ txt.T
    p_i2t, p_t2i = teacher_probabilities(
        [None if t is None else t.to(img.device) for t in teacher_img_list],
        [t.to(img.device) for t in teacher_txt_list],
        teacher_scales,
    )
    return 0.5 * (_soft_divergence(logits, p_i2t, kind) + _soft_divergence(logits.T, p_t2i, kind))


# ----------------------------------------------------------------------------- Patch-IB, local
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


def local_contrastive_loss(pair_similarity: torch.Tensor, text_mask: torch.Tensor | None = None,
                           temperature: float = 0.1) -> torch.Tensor:
    """Token-region InfoNCE: each text token's region pooled from its own image must beat the same
    token pooled over every other image of the batch.

    pair_similarity (B_text, B_image, L): cos(v~_{j<-i,k}, t_{i,k}) (``LocalAlign.pair_similarity``);
    the target of text i is image i. Mean cross-entropy over valid tokens (text_mask (B, L)).
    Negatives are this rank's images only (the attention needs the other images' patches).
    """
    b, b_img, length = pair_similarity.shape
    if b != b_img:
        raise ValueError(f"pair_similarity must be (B, B, L), got {tuple(pair_similarity.shape)}")
    logits = pair_similarity.float().permute(0, 2, 1) / temperature  # (B_text, L, B_image)
    target = torch.arange(b, device=logits.device).unsqueeze(1).expand(b, length)
    ce = F.cross_entropy(logits.reshape(b * length, b), target.reshape(-1), reduction="none").view(b, length)
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


def local_losses(out: Any, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """The weighted 'local' term of one StudentOutput: cosine, contrastive or both (cfg.local_loss)."""
    local_v, local_t = getattr(out, "local_visual", None), getattr(out, "local_text", None)
    if local_v is None or local_t is None or not cfg.w_local:
        return {}
    text_mask = getattr(out, "text_mask", None)
    parts = []
    if cfg.local_loss in ("cosine", "both"):
        parts.append(local_alignment_loss(local_v, local_t, text_mask))
    if cfg.local_loss in ("contrastive", "both"):
        pairs = getattr(out, "local_pair_similarity", None)
        if pairs is None:
            raise ValueError("loss.local_loss 'contrastive' needs the student's forward(..., local_pairs=True)")
        mask = getattr(out, "local_pair_mask", None)
        parts.append(local_contrastive_loss(pairs, mask, cfg.local_temperature))
        if cfg.local_word_contrast:
            words = getattr(out, "local_word_similarity", None)
            if words is None:
                raise ValueError("loss.local_word_contrast needs the student's forward(..., local_words=True)")
            parts.append(word_contrastive_loss(words, out.local_pair_ids, mask, cfg.local_temperature))
    if cfg.local_entropy and getattr(out, "local_attn", None) is not None:
        parts.append(cfg.local_entropy * attention_entropy(out.local_attn, text_mask))
    return {"local": cfg.w_local * torch.stack(parts).sum()}


def patch_ib_losses(
    masked_img: torch.Tensor | None,
    full_img: torch.Tensor,
    txt: torch.Tensor,
    logit_scale: torch.Tensor | float,
    mask: torch.Tensor | None,
    cfg: LossConfig,
    positives: torch.Tensor | None = None,
    soft_targets: torch.Tensor | None = None,
    gather: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Weighted Patch-IB terms on local (per-rank) features: 'mask_nce' (w_mask_nce * InfoNCE of
    the masked pooled embedding), 'sparsity' (lambda_sparse * mean z), 'consistency' (mu * MSE)."""
    if gather is None:
        gather = dist_utils.is_dist()
    out: dict[str, torch.Tensor] = {}
    if masked_img is not None:
        if cfg.w_mask_nce:
            if gather:
                logit_scale = dist_utils.replicated(logit_scale)
            g = dist_utils.gather_features if gather else (lambda x: x)
            out["mask_nce"] = cfg.w_mask_nce * clip_loss(
                g(masked_img), g(txt), logit_scale, cfg.w_i2t, cfg.w_t2i,
                positives=positives, soft_targets=soft_targets, fn_mode=cfg.fn_mode, gather=False)
        if cfg.mu_consistency:
            out["consistency"] = cfg.mu_consistency * consistency_loss(
                masked_img, full_img, txt, cfg.detach_full_similarity)
    if mask is not None and cfg.lambda_sparse:
        out["sparsity"] = cfg.lambda_sparse * sparsity_loss(mask)
    return out


# ----------------------------------------------------------------------------- the objective
def _pair_targets(batch: dict, text_key: str, cfg: LossConfig, gather: bool, device) -> tuple:
    """Global (positives, soft_targets) for one of B_real / B_syn, or Nones when off/unavailable."""
    positives = soft = None
    criteria = parse_fn_masking(cfg.fn_masking)
    glist = dist_utils.gather_list if gather else _id_list
    if criteria:
        subjects = glist(_id_list(batch.get("subject_id")))
        studies = glist(_id_list(batch.get("study_id")))
        texts = glist(_id_list(batch.get(text_key)))
        if any(v is not None for v in (subjects, studies, texts)):
            positives = positive_mask(subjects, studies, texts, criteria, device=device)
    labels = batch.get("labels")
    if cfg.label_soft_targets and labels is not None:
        labels = torch.as_tensor(labels, dtype=torch.float32, device=device)
        if gather:
            labels = dist_utils.gather_features(labels)
        soft = label_soft_targets(labels, cfg.label_temperature)
    return positives, soft


def _distill_for(img, txt, scale, teachers: dict, part: str, cfg: LossConfig, gather: bool) -> torch.Tensor | None:
    """Distillation on one batch; part 'txt' (B_real) or 'syn' (B_syn). None when no teacher has it."""
    g = dist_utils.gather_features if gather else (lambda x: x)
    t_imgs, t_txts, scales = [], [], []
    for name in sorted(teachers):
        entry = teachers[name] or {}
        t_txt = entry.get(part)
        if t_txt is None:
            continue
        t_img = entry.get("img")
        t_imgs.append(None if t_img is None else g(torch.as_tensor(t_img).to(img.device).float()))
        t_txts.append(g(torch.as_tensor(t_txt).to(img.device).float()))
        scales.append(cfg.teacher_scale(name))
    if not t_txts:
        return None
    return distill_loss(img, txt, scale, t_imgs, t_txts, scales, kind=cfg.distill_kind, gather=False)


@_full_precision
def compute_losses(
    out_real: Any,
    out_syn: Any,
    batch: dict,
    cfg: LossConfig,
    step: int = 0,
    total_steps: int = 1,
    queue: TextQueue | None = None,
    *,
    update_queue: bool = True,
    gather: bool | None = None,
) -> dict[str, torch.Tensor]:
    """All weighted loss terms (keys in LOSS_KEYS, absent terms left out) and 'total' (their sum).

    out_real / out_syn: StudentOutput-like objects for B_real (aug image, report) and B_syn (aug
    image, synthetic caption); out_syn may be None. None fields mean "term absent". batch: the
    data dict (teacher, subject_id, study_id, report_text, caption_text, labels). The queue, when
    given and cfg.queue_size > 0, adds i2t negatives to the B_real CLIP term and then receives the
    (gathered) report embeddings unless update_queue is False. gather: None = when DDP runs.
    """
    if gather is None:
        gather = dist_utils.is_dist()
    g = dist_utils.gather_features if gather else (lambda x: x)
    teachers = batch.get("teacher") or {}
    lam = cfg.lambda_distill if teachers else 0.0
    beta = beta_schedule(step, total_steps, cfg.beta_min, cfg.beta_max) if cfg.beta_max or cfg.beta_min else 0.0
    terms: dict[str, torch.Tensor] = {}

    rep = dist_utils.replicated if gather else (lambda x: x)
    img = g(out_real.image_emb.float())
    txt = g(out_real.text_emb.float())
    scale = rep(out_real.logit_scale)
    device = img.device
    positives, soft = _pair_targets(batch, "report_text", cfg, gather, device)
    use_queue = queue is not None and cfg.queue_size > 0
    if lam < 1.0:
        terms["clip"] = (1.0 - lam) * clip_loss(
            img, txt, scale, cfg.w_i2t, cfg.w_t2i, positives=positives, beta=beta, soft_targets=soft,
            fn_mode=cfg.fn_mode, extra_txt=queue.get() if use_queue else None, gather=False)
    if lam > 0.0:
        d = _distill_for(img, txt, scale, teachers, "txt", cfg, gather)
        if d is not None:
            terms["distill"] = lam * d

    if cfg.use_syn and out_syn is not None and out_syn.image_emb is not None and out_syn.text_emb is not None:
        s_img = g(out_syn.image_emb.float())
        s_txt = g(out_syn.text_emb.float())
        s_scale = rep(out_syn.logit_scale)
        s_positives, _ = _pair_targets(batch, "caption_text", cfg, gather, device)
        if lam < 1.0:
            terms["clip_syn"] = (1.0 - lam) * clip_loss(
                s_img, s_txt, s_scale, cfg.w_i2t, cfg.w_t2i, positives=s_positives, beta=beta,
                soft_targets=soft, fn_mode=cfg.fn_mode, gather=False)
        if lam > 0.0:
            d = _distill_for(s_img, s_txt, s_scale, teachers, "syn", cfg, gather)
            if d is not None:
                terms["distill_syn"] = lam * d

    terms.update(patch_ib_losses(
        getattr(out_real, "masked_image_emb", None), out_real.image_emb, out_real.text_emb, out_real.logit_scale,
        getattr(out_real, "mask", None), cfg, positives=positives, soft_targets=soft, gather=gather))

    terms.update(local_losses(out_real, cfg))

    if not terms:
        raise ValueError("compute_losses: no loss term is active (all weights zero or outputs missing)")
    terms["total"] = torch.stack([v for v in terms.values()]).sum()
    if use_queue and update_queue:
        queue.enqueue(txt.detach())
    return terms


# ----------------------------------------------------------------------------- loss balance
def loss_balance(terms: dict[str, torch.Tensor], params: Sequence[torch.nn.Parameter]) -> dict[str, float]:
    """Gradient norm each term puts on `params` (e.g. model.trunk_parameters()); 'total' skipped,
    terms without a graph (or not reaching the params) give 0.0. Keeps the graph for backward()."""
    params = [p for p in params if p.requires_grad]
    out: dict[str, float] = {}
    for key, value in terms.items():
        if key == "total" or not torch.is_tensor(value):
            continue
        if not value.requires_grad or not params:
            out[key] = 0.0
            continue
        grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        squares = [g.detach().float().pow(2).sum() for g in grads if g is not None]
        out[key] = math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0
    return out
