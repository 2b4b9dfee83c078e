"""Training losses, one module per concern:

config.py       LossConfig (YAML `train.loss:`), fn-masking criteria, teacher scales from dataset.json
targets.py      target matrices: positives (same subject/study/text), label soft targets
contrastive.py  CLIP InfoNCE (clip_loss / ClipLoss), hard negatives (beta_schedule), TextQueue
distill.py      MobileCLIP distillation from stored teacher embeddings (distill_loss / DistillLoss)
patch_ib.py     Patch-IB: masked InfoNCE, sparsity, consistency
local.py        local alignment: cosine, token-region contrastive, word contrast, attention entropy
objective.py    Objective: every weighted term of a step and their total (DDP gathering); loss_balance
"""
from cxrdr.train.losses.config import LOSS_KEYS, LossConfig, parse_fn_masking, teacher_scales_from_info
from cxrdr.train.losses.contrastive import ClipLoss, TextQueue, beta_schedule, clip_loss
from cxrdr.train.losses.distill import DistillLoss, distill_loss, teacher_probabilities
from cxrdr.train.losses.local import (LocalLoss, attention_entropy, local_alignment_loss, local_contrastive_loss,
                                      word_contrastive_loss)
from cxrdr.train.losses.objective import Objective, loss_balance
from cxrdr.train.losses.patch_ib import PatchIBLoss, consistency_loss, sparsity_loss
from cxrdr.train.losses.targets import label_soft_targets, positive_mask

__all__ = [
    "LOSS_KEYS", "LossConfig", "parse_fn_masking", "teacher_scales_from_info", "ClipLoss", "TextQueue",
    "beta_schedule", "clip_loss", "DistillLoss", "distill_loss", "teacher_probabilities", "LocalLoss",
    "attention_entropy", "local_alignment_loss", "local_contrastive_loss", "word_contrastive_loss", "Objective",
    "loss_balance", "PatchIBLoss", "consistency_loss", "sparsity_loss", "label_soft_targets", "positive_mask",
]
