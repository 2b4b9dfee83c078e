"""LossConfig: weights and pair-selection options of the training objective (YAML `train.loss:`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from cxrdr.common.yamlio import check_known_fields, validate_fields

FN_CRITERIA = ("subject", "study", "text")
FN_MODES = ("multi", "mask")
DISTILL_KINDS = ("kl", "ce")
# Local alignment objectives: "contrastive" (token-region InfoNCE over the batch's images, GLoRIA/MGCA
# style), "cosine" (the seeds' mean 1 - cos(v~_k, t_k), which a constant attention map satisfies), "both".
LOCAL_LOSSES = ("contrastive", "cosine", "both")
# Keys the objective may return (absent terms are left out), plus "total".
LOSS_KEYS = ("clip", "distill", "clip_syn", "distill_syn", "affinity", "affinity_syn", "feature", "feature_syn",
             "mask_nce", "sparsity", "consistency", "mask_words", "local")

LOSS_RANGES = {"lambda_distill": "[0, 1]", "w_i2t": "[0, inf)", "w_t2i": "[0, inf)",
               "default_teacher_scale": "(0, inf)", "w_mask_nce": "[0, inf)", "lambda_sparse": "[0, inf)",
               "mu_consistency": "[0, inf)", "w_local": "[0, inf)", "label_temperature": "(0, inf)",
               "beta_min": "[0, inf)", "beta_max": "[0, inf)", "queue_size": "[0, inf)",
               "local_temperature": "(0, inf)", "local_tokens": "[1, inf)", "local_entropy": "[0, inf)",
               "w_mask_words": "[0, inf)", "w_affinity": "[0, inf)", "w_feature": "[0, inf)",
               "local_group_size": "[0, inf)"}


@dataclass
class LossConfig:
    """Weights and pair-selection options of the training objective (YAML `loss:` section)."""

    lambda_distill: float = 0.7  # MobileCLIP's lambda: (1-l)*CLIP + l*distill
    w_i2t: float = 0.5
    w_t2i: float = 0.5
    use_syn: bool = True  # also apply CLIP + distill on B_syn (aug image, synthetic caption)
    distill_kind: str = "kl"  # "kl" (0 at a perfect match) or "ce" (soft-target cross-entropy)
    # relational distillation (distill.affinity_loss): the teachers' in-batch cosine similarities, image-text,
    # image-image and text-text, as MSE targets; 0 = off (MobileCLIP's KL alone)
    w_affinity: float = 0.0
    # feature distillation (distill.feature_loss): 1 - cos between the student's embeddings mapped into each
    # teacher's space (the student's teacher heads) and the teacher's stored embedding of that crop/caption;
    # 0 = off. The trainer gives the student one head per teacher when this is > 0
    w_feature: float = 0.0
    teacher_scales: dict[str, float] = field(default_factory=dict)  # per-teacher logit scale
    default_teacher_scale: float = 100.0
    # Patch-IB and local alignment
    w_mask_nce: float = 1.0
    lambda_sparse: float = 0.01
    mu_consistency: float = 1.0
    detach_full_similarity: bool = True  # s_full is the target of the consistency MSE
    # the mask z learns where the report's words look (patch_ib.mask_follows_words_loss): z's pointing game
    # on the CPU ladder 0.64 -> 0.79-0.84 (README, Localisation); 0 = off
    w_mask_words: float = 1.0
    w_local: float = 1.0  # 0.5 -> 1.0: attention pointing game +0.04 to +0.07 on two seeds (README, Localisation)
    local_loss: str = "contrastive"  # LOCAL_LOSSES; chosen by the pointing game (README, Localisation)
    local_temperature: float = 0.1  # softmax temperature of the token-region contrastive term
    # text tokens per report drawn each step for the contrastive term (cost ~ B^2 x this); with negated and
    # normal-statement words out, 8 still hold a report's findings and halve the term's cost (README)
    local_tokens: int = 8
    # the images a word's region contrasts with: its own and the others of its group of this many consecutive batch
    # rows (0: every image of the batch). The term's cost grows with B x this, not B^2: a GPU step's largest Patch-IB
    # kernel (the all-pairs pooled cosines, 12.8 ms of an H200's batch-256 step) shrinks B / this times
    local_group_size: int = 0
    # draw those words outside negations only: grounding "effusion" of "no pleural effusion" in its image
    # teaches the word to avoid effusions (README, Localisation)
    local_affirmed_only: bool = True
    # nor from sentences that state normal anatomy ("Heart size is normal.", "The lungs are clear."): they
    # name no finding to ground, and the mask that follows the words should not learn the normal heart
    local_skip_normal: bool = True
    # a word's negatives are only images whose reports do not name the word too (false-negative masking)
    local_mask_shared_words: bool = False
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
        validate_fields(self, "loss option", LOSS_RANGES)
        for name, value, choices in (("distill_kind", self.distill_kind, DISTILL_KINDS),
                                     ("fn_mode", self.fn_mode, FN_MODES),
                                     ("local_loss", self.local_loss, LOCAL_LOSSES)):
            if value not in choices:
                raise ValueError(f"loss.{name} must be one of {choices}, got {value!r}")
        parse_fn_masking(self.fn_masking)  # validates

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "LossConfig":
        data = dict(data or {})
        check_known_fields(cls, data, "loss option")
        return cls(**data)

    def teacher_scale(self, name: str) -> float:
        return float(self.teacher_scales.get(name, self.default_teacher_scale))

    @property
    def criteria(self) -> tuple[str, ...]:
        return parse_fn_masking(self.fn_masking)

    @property
    def local_pairs(self) -> bool:
        """The token-region contrastive term is on: the student must pool every text over every image."""
        return self.w_local > 0 and self.local_loss in ("contrastive", "both")


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
