"""MobileCLIP distillation from the teachers' embeddings stored in the shards (or an online teacher).

D = 1/2 (D_i2t + D_t2i) with the teachers' probabilities averaged after each teacher's own softmax
(own logit scale). `kind="kl"` reports KL(P_teacher || Q_student) (0 when the matrices match);
`kind="ce"` the soft-target cross-entropy (= KL + teacher entropy); gradients are identical. A
text-only teacher (no image embeddings) supplies its text-text affinities A = t_txt @ t_txt.T:
since image i is paired with text i, softmax(scale * A[i]) is used as the teacher's i2t *and* t2i
target row for anchor i (A is symmetric). Inputs are the global batch (the objective gathers).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cxrdr.train.losses.config import DISTILL_KINDS
from cxrdr.train.losses.contrastive import soft_ce_rows
from cxrdr.train.losses.precision import full_precision


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
    ce = soft_ce_rows(student_logits, probs)
    if kind == "ce":
        return ce.mean()
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=1)
    return (ce - entropy).mean()


@full_precision
def distill_loss(
    student_img: torch.Tensor,
    student_txt: torch.Tensor,
    student_scale: torch.Tensor | float,
    teacher_img_list: Sequence[torch.Tensor | None],
    teacher_txt_list: Sequence[torch.Tensor],
    teacher_scales: Sequence[float],
    kind: str = "kl",
) -> torch.Tensor:
    """MobileCLIP distillation 1/2 (D_i2t + D_t2i) of the student's similarity matrix against the
    teachers' averaged probabilities. kind="kl": KL(P||Q) (0 when the matrices match);
    kind="ce": soft-target cross-entropy (KL + teacher entropy). Same gradient."""
    if kind not in DISTILL_KINDS:
        raise ValueError(f"distill kind must be one of {DISTILL_KINDS}, got {kind!r}")
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


@full_precision
def affinity_loss(student_img: torch.Tensor, student_txt: torch.Tensor,
                  teacher_img_list: Sequence[torch.Tensor | None], teacher_txt_list: Sequence[torch.Tensor]) -> torch.Tensor:
    """Relational distillation: mean squared difference between the student's and the teachers' cosine
    similarities within the batch — image-text, image-image and text-text (text-text alone for a text-only
    teacher) — averaged over teachers. No projection between embedding widths is needed.

    Why beside the KL: the KL passes on the teacher's image-text ranking after a softmax; this also passes
    on how similar the batch's images are to each other, and its text to each other, value for value
    (CLIP-KD, Yang et al. 2024: mimicking the teacher's geometry is what transfers best)."""
    img = F.normalize(student_img.float(), dim=-1)
    txt = F.normalize(student_txt.float(), dim=-1)
    parts = []
    for t_img, t_txt in zip(teacher_img_list, teacher_txt_list):
        t_txt = F.normalize(t_txt.detach().float().to(img.device), dim=-1)
        pairs = [(txt @ txt.T, t_txt @ t_txt.T)]
        if t_img is not None:
            t_img = F.normalize(t_img.detach().float().to(img.device), dim=-1)
            pairs += [(img @ txt.T, t_img @ t_txt.T), (img @ img.T, t_img @ t_img.T)]
        parts += [F.mse_loss(s, t) for s, t in pairs]
    return torch.stack(parts).mean()


@full_precision
def feature_loss(student_list: Sequence[torch.Tensor], teacher_list: Sequence[torch.Tensor]) -> torch.Tensor:
    """Feature distillation: 1 - cosine between each student embedding mapped into a teacher's space
    (``heads.TeacherSpaceHeads``) and that teacher's embedding of the same crop or text, averaged over
    samples and pairs. 0 when every mapped embedding points along its teacher's.

    Why beside the KL and the affinities: those pass on similarities within the batch; this hands every
    sample its own target, and the from-scratch text tower learns the teacher's text space from the first
    steps (CLIP-KD, Yang et al. 2024: FD was their strongest single distiller)."""
    if len(student_list) != len(teacher_list) or not student_list:
        raise ValueError("feature_loss: need equally long, non-empty student/teacher lists")
    parts = []
    for s, t in zip(student_list, teacher_list):
        t = t.detach().float().to(s.device)
        if s.shape != t.shape:
            raise ValueError(f"feature_loss: student {tuple(s.shape)} mapped into the teacher's space does not "
                             f"match the teacher's {tuple(t.shape)}")
        parts.append(1.0 - F.cosine_similarity(s.float(), t, dim=-1).mean())
    return torch.stack(parts).mean()


class DistillLoss(nn.Module):
    """Distillation of one batch (B_real or B_syn) from the teachers present in it
    (cf. open_clip's DistillClipLoss, with several teachers and stored embeddings).

    ``teachers``: {name: {"img": (B, Dt) or None, "txt": ..., "syn": ...}} as the loader yields;
    ``part``: "txt" (B_real) or "syn" (B_syn); the embeddings must already cover the global batch.
    Returns None when no teacher has embeddings for that part.
    """

    def __init__(self, kind: str = "kl", teacher_scales: dict[str, float] | None = None,
                 default_scale: float = 100.0):
        super().__init__()
        self.kind, self.default_scale = kind, float(default_scale)
        self.teacher_scales = dict(teacher_scales or {})

    def affinity(self, img, txt, teachers: dict, part: str) -> torch.Tensor | None:
        """``affinity_loss`` against the teachers present for ``part`` (None when there is none)."""
        t_imgs, t_txts, _ = self._teachers(teachers, part)
        return affinity_loss(img, txt, t_imgs, t_txts) if t_txts else None

    def feature(self, teacher_space: dict, teachers: dict, part: str) -> torch.Tensor | None:
        """``feature_loss`` of the student's embeddings mapped into each teacher's space (``teacher_space``:
        {teacher: {"img", "txt", "syn"}}) against the teachers' own for ``part``; the image only on B_real
        (B_syn holds the same crops). None when no teacher has both."""
        students, targets = [], []
        for name in sorted(teachers):
            entry, mapped = teachers[name] or {}, teacher_space.get(name)
            if mapped is None or entry.get(part) is None:
                continue
            students.append(mapped[part])
            targets.append(entry[part])
            if part == "txt" and entry.get("img") is not None:
                students.append(mapped["img"])
                targets.append(entry["img"])
        return feature_loss(students, targets) if students else None

    def _teachers(self, teachers: dict, part: str) -> tuple[list, list, list]:
        t_imgs, t_txts, scales = [], [], []
        for name in sorted(teachers):
            entry = teachers[name] or {}
            if entry.get(part) is None:
                continue
            t_img = entry.get("img")
            t_imgs.append(t_img)
            t_txts.append(entry[part])
            scales.append(float(self.teacher_scales.get(name, self.default_scale)))
        return t_imgs, t_txts, scales

    def forward(self, img, txt, logit_scale, teachers: dict, part: str) -> torch.Tensor | None:
        t_imgs, t_txts, scales = self._teachers(teachers, part)
        if not t_txts:
            return None
        return distill_loss(img, txt, logit_scale, t_imgs, t_txts, scales, kind=self.kind)
