"""Task: what one training step computes, from a loader batch to the weighted loss terms.

It owns the student, the optional online teacher, and the objective (loss config, loss modules,
text queue). Per micro-batch::

    batch = (aug image, report, synthetic caption, teachers' embeddings of exactly that view/caption)
    out_real = student(image, report, caption)                 # B_real; the captions' embedding as
    syn_txt  = out_real.caption_emb                            # B_syn, reusing the image embedding
    terms    = objective(out_real, batch, step, syn_txt)       # CLIP/distill/Patch-IB/local + total

The trainer (`cxrdr.train.loop.Trainer`) runs it with the optimiser around it; the efficiency
measurement (`cxrdr.train.evaluation.efficiency`) times the same Task on a synthetic batch.

Online-teacher mode: the teacher ignores the stored embeddings and embeds the crop (replayed at its
own input size by the loader) and the report/caption inside the step, to measure what storing
embeddings saves.
"""
from __future__ import annotations

import torch
from torch import nn

from cxrdr.train.device import to_device
from cxrdr.train.losses import LossConfig, Objective


class StudentStep(nn.Module):
    """One forward for B_real and B_syn, so that DDP sees one forward per backward."""

    def __init__(self, student: nn.Module):
        super().__init__()
        self.student = student

    def forward(self, images, report_ids, report_mask, caption_ids=None, caption_mask=None, step=None,
                local_pairs=0, local_words=False, local_affirmed=False, local_skip_normal=False,
                report_token_index=None, caption_token_index=None, local_group=0):
        out = self.student(images, report_ids, report_mask, step=step, local_pairs=local_pairs,
                           local_group=local_group, local_words=local_words, local_affirmed=local_affirmed,
                           local_skip_normal=local_skip_normal, token_index=report_token_index,
                           caption_ids=caption_ids, caption_mask=caption_mask, caption_token_index=caption_token_index)
        syn = out.caption_emb
        heads = getattr(self.student, "teacher_heads", None)
        if heads is not None:  # inside the forward DDP wraps, so the heads' gradients are synchronised
            out.teacher_space = heads(out.image_emb, {"txt": out.text_emb, "syn": syn})
        return out, syn


class Task:
    """``forward(batch, step)`` -> {term: weighted loss tensor, 'total': their sum} for one micro-batch.

    ``model`` is the module the forward goes through: ``StudentStep(student)``, which the trainer may
    replace by its DDP wrapper. ``total_steps`` drives the hard-negative beta schedule.
    """

    def __init__(self, student: nn.Module, loss_cfg: LossConfig, total_steps: int, teacher=None,
                 device: torch.device | str = "cpu", gather: bool | None = None):
        self.student, self.loss_cfg, self.teacher = student, loss_cfg, teacher
        self.total_steps, self.device = total_steps, torch.device(device)
        self.objective = Objective(loss_cfg, student.embed_dim, self.device, gather=gather)
        self.model: nn.Module = StudentStep(student)
        # The token-region contrastive term needs every text pooled over every image of the batch.
        contrastive = getattr(student, "local_align", None) is not None and loss_cfg.local_pairs
        self.local_pairs = loss_cfg.local_tokens if contrastive else 0
        self.local_words = bool(self.local_pairs) and loss_cfg.local_word_contrast
        self.keep_ratio = 1.0  # of the last forward (token dropping), for logging

    @property
    def queue(self):
        return self.objective.queue

    @torch.no_grad()
    def add_online_teacher(self, batch: dict) -> dict:
        """Replace stored embeddings by the online teacher's, on the same crops and texts."""
        t = self.teacher
        img = t.encode_images(batch["teacher_images"]) if t.kind == "clip" else None
        txt = t.encode_texts(batch["report_text"])
        syn = t.encode_texts(batch["caption_text"])
        batch["teacher"] = {t.name: {"img": img, "txt": txt, "syn": syn}}
        return batch

    def forward(self, batch: dict, step: int, compiled: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """``compiled``: the trainer's torch.compile of ``self.model``, run in its place with the model's
        step None (one graph for every step), which it may only pass once the student's step schedules
        are over (``StudentConfig.warmup_steps_to_target``): the forward then equals the step's."""
        batch = to_device(batch, self.device)  # every tensor at once, without waiting for the GPU
        args = [batch["images"], batch["report_ids"], batch["report_mask"]]
        if self.loss_cfg.use_syn:
            args += [batch["caption_ids"], batch["caption_mask"]]
        model, model_step = (self.model, step) if compiled is None else (compiled, None)
        packing = self._packing(batch, compiled is not None)
        out, syn_txt = model(*args, step=model_step, local_pairs=self.local_pairs,
                             local_group=self.loss_cfg.local_group_size, local_words=self.local_words,
                             local_affirmed=self.loss_cfg.local_affirmed_only,
                             local_skip_normal=self.loss_cfg.local_skip_normal, **packing)
        self.keep_ratio = float(out.keep_ratio)  # a Python number (k / n), no device read
        return self.objective(out, batch, step, self.total_steps, syn_text_emb=syn_txt)

    def _packing(self, batch: dict, compiled: bool) -> dict:
        """The texts' packing indices for the forward (``models/packed_text.py``: the text tower runs on the real
        tokens only), where the student packs. In the one-graph compile their lengths (the batch's real token
        counts, new every batch) are dynamic sizes: one graph for every batch, not one per count."""
        if not getattr(getattr(self.student, "text_tower", None), "pack", False):
            return {}
        packing = {"report_token_index": batch.get("report_token_index"),
                   "caption_token_index": batch.get("caption_token_index") if self.loss_cfg.use_syn else None}
        if compiled:
            for index in packing.values():
                if index is not None:
                    torch._dynamo.mark_dynamic(index, 0)
        return packing

    __call__ = forward
