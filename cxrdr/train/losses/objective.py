"""The training objective: every weighted term of one step, and their sum.

For B in {B_real (aug image, report), B_syn (the same image, synthetic caption)}:
(1-lambda) * CLIP(B) + lambda * Distill(B) (lambda -> 0 when the batch has no teacher embeddings),
plus Patch-IB on B_real and w_local * local alignment. Each *weighted* contribution is returned under
its key (LOSS_KEYS), so 'total' is their sum and `loss_balance` compares like with like.

DDP: the objective gathers every feature across ranks once (`cxrdr.train.distributed.gather_features`:
the local slice keeps its gradient) and the logit scale goes through `replicated`; contrastive and
distillation terms then see the global batch, per-sample means use `global_mean`. On every rank each
value equals the single-process value on the global batch, and the loop backwards
`total * distributed.loss_scale_for_ddp()` (see train/distributed.py).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import torch
from torch import nn

from cxrdr.train import distributed as dist_utils
from cxrdr.train.device import to_device
from cxrdr.train.losses.config import LossConfig
from cxrdr.train.losses.contrastive import ClipLoss, TextQueue, beta_schedule
from cxrdr.train.losses.distill import DistillLoss
from cxrdr.train.losses.local import LocalLoss
from cxrdr.train.losses.patch_ib import MaskWordsLoss, PatchIBLoss
from cxrdr.train.losses.precision import full_precision
from cxrdr.train.losses.targets import id_list, label_soft_targets, positive_mask


def _identity(x):
    return x


class Objective(nn.Module):
    """``forward(out, batch, step, total_steps, syn_text_emb)`` -> {term: weighted loss, 'total': sum}.

    ``out``: the student's StudentOutput on B_real; ``syn_text_emb``: the captions' text embeddings
    (B_syn reuses ``out.image_emb``), or None; ``batch``: the loader's dict (teacher, subject_id,
    study_id, report_text, caption_text, labels). With ``cfg.queue_size`` > 0 and ``embed_dim`` given
    the objective keeps a TextQueue of past report embeddings as extra i2t negatives of the B_real
    CLIP term. ``gather``: all-gather features over DDP ranks (None: when a process group runs).
    """

    def __init__(self, cfg: LossConfig, embed_dim: int | None = None, device: torch.device | str = "cpu",
                 gather: bool | None = None):
        super().__init__()
        self.cfg = cfg
        self.gather = dist_utils.is_dist() if gather is None else gather
        self.clip = ClipLoss(cfg.w_i2t, cfg.w_t2i, cfg.fn_mode)
        self.distill = DistillLoss(cfg.distill_kind, cfg.teacher_scales, cfg.default_teacher_scale)
        self.patch_ib = PatchIBLoss(self.clip, cfg.w_mask_nce, cfg.lambda_sparse, cfg.mu_consistency,
                                    cfg.detach_full_similarity)
        self.mask_words = MaskWordsLoss(cfg.w_mask_words)
        self.local = LocalLoss(cfg.w_local, cfg.local_loss, cfg.local_temperature, cfg.local_word_contrast,
                               cfg.local_entropy, cfg.local_mask_shared_words)
        self.queue = (TextQueue(cfg.queue_size, embed_dim, device)
                      if cfg.queue_size > 0 and embed_dim is not None else None)
        self.graphs = None  # --cuda-graphs-losses: the student's BlockGraphs (train/models/block_graphs.py)
        self._global_modules: dict[tuple, GlobalTerms] = {}  # one per layout of the global terms' tensors

    # ---- gathering (once per feature) ---------------------------------------------------------------
    def _features(self, x):
        return dist_utils.gather_features(x) if self.gather else x

    def _ids(self, values) -> list | None:
        values = id_list(values)
        return dist_utils.gather_list(values) if self.gather else values

    def _teachers(self, teachers: dict, device) -> dict:
        return {name: {part: None if t is None else self._features(to_device(torch.as_tensor(t), device).float())
                       for part, t in (entry or {}).items()}
                for name, entry in teachers.items()}

    def _teacher_space(self, teacher_space: dict | None) -> dict | None:
        """The student's embeddings mapped into each teacher's space, over the global batch."""
        if not teacher_space:
            return None
        return {name: {part: None if t is None else self._features(t.float()) for part, t in entry.items()}
                for name, entry in teacher_space.items()}

    def _positives(self, batch: dict, text_key: str, device) -> torch.Tensor | None:
        criteria = self.cfg.criteria
        if not criteria:
            return None
        columns = [self._ids(batch.get(k)) for k in ("subject_id", "study_id", text_key)]
        if all(v is None for v in columns):
            return None
        return positive_mask(*columns, criteria, device=device)

    def _soft_targets(self, batch: dict, device) -> torch.Tensor | None:
        labels = batch.get("labels")
        if not self.cfg.label_soft_targets or labels is None:
            return None
        labels = self._features(to_device(torch.as_tensor(labels), device).float())
        return label_soft_targets(labels, self.cfg.label_temperature)

    # ---- the terms ----------------------------------------------------------------------------------
    def _pair_terms(self, img, txt, scale, lam, teachers, part, positives, soft, beta, extra_txt=None,
                    teacher_space=None) -> dict:
        """(1-lambda) * CLIP and lambda * distill of one batch (B_real: part 'txt', B_syn: 'syn'), plus the
        affinity and feature distillation terms when weighted."""
        suffix = "" if part == "txt" else "_syn"
        terms = {}
        if lam < 1.0:
            terms["clip" + suffix] = (1.0 - lam) * self.clip(img, txt, scale, positives=positives,
                                                             soft_targets=soft, beta=beta, extra_txt=extra_txt)
        if lam > 0.0:
            d = self.distill(img, txt, scale, teachers, part)
            if d is not None:
                terms["distill" + suffix] = lam * d
        if self.cfg.w_affinity and teachers:
            a = self.distill.affinity(img, txt, teachers, part)
            if a is not None:
                terms["affinity" + suffix] = self.cfg.w_affinity * a
        if teacher_space:  # set only when w_feature is on and teachers are present (forward)
            f = self.distill.feature(teacher_space, teachers, part)
            if f is not None:
                terms["feature" + suffix] = self.cfg.w_feature * f
        return terms

    @full_precision
    def forward(self, out, batch: dict, step: int = 0, total_steps: int = 1,
                syn_text_emb: torch.Tensor | None = None, update_queue: bool = True) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        teachers = batch.get("teacher") or {}
        lam = cfg.lambda_distill if teachers else 0.0
        beta = beta_schedule(step, total_steps, cfg.beta_min, cfg.beta_max) if cfg.beta_max or cfg.beta_min else 0.0
        img = self._features(out.image_emb.float())
        txt = self._features(out.text_emb.float())
        scale = dist_utils.replicated(out.logit_scale) if self.gather else out.logit_scale
        device = img.device
        teachers = self._teachers(teachers, device)
        space = self._teacher_space(out.teacher_space) if cfg.w_feature and teachers else None
        positives, soft = self._positives(batch, "report_text", device), self._soft_targets(batch, device)
        extra = self.queue.get() if self.queue is not None else None
        syn_txt = positives_syn = None
        if cfg.use_syn and syn_text_emb is not None:
            syn_txt = self._features(syn_text_emb.float())
            positives_syn = self._positives(batch, "caption_text", device)
        terms = None
        if self.graphs is not None and self.queue is None and space is None and not self.gather:
            terms = self._graphed_global_terms(out, img, txt, syn_txt, scale, lam, teachers, positives, positives_syn,
                                               soft, beta)
        if terms is None:
            terms = self._pair_terms(img, txt, scale, lam, teachers, "txt", positives, soft, beta, extra, space)
            if syn_txt is not None:
                terms.update(self._pair_terms(img, syn_txt, scale, lam, teachers, "syn", positives_syn, soft, beta,
                                              teacher_space=space))
            local = {"img": out.image_emb, "txt": out.text_emb, "masked_img": out.masked_image_emb, "mask": out.mask}
            global_ = {"txt": txt, "masked_img": self._features(out.masked_image_emb)}
            terms.update(self.patch_ib(local, global_, scale, positives=positives, soft_targets=soft))
        terms.update(self.mask_words(out))
        terms.update(self.local(out))
        if not terms:
            raise ValueError("the objective has no active term (all weights zero or outputs missing)")
        terms["total"] = torch.stack(list(terms.values())).sum()
        if self.queue is not None and update_queue:
            self.queue.enqueue(txt.detach())
        return terms

    def _graphed_global_terms(self, out, img, txt, syn_txt, scale, lam, teachers, positives, positives_syn, soft,
                              beta) -> dict | None:
        """The pair terms of B_real and B_syn (``_pair_terms``) and the Patch-IB terms through ``graphs`` as one CUDA
        graph, or None where none applies (see ``graphs.applies``; a hard-negative beta that changes every step,
        which a graph would hold fixed; the caller leaves out a text queue, feature distillation and DDP). Their
        tensors go in by a layout of names; each layout has its graph."""
        if self.cfg.beta_min != self.cfg.beta_max or not self.graphs.applies(self, img, tag="losses"):
            return None
        named = {"img": img, "txt": txt, "scale": scale, "syn_txt": syn_txt, "positives": positives,
                 "positives_syn": positives_syn, "soft": soft, "local_img": out.image_emb, "local_txt": out.text_emb,
                 "masked_img": out.masked_image_emb, "mask": out.mask}
        for name in sorted(teachers):
            named.update({("teacher", name, part): t for part, t in (teachers[name] or {}).items()})
        layout = tuple(k for k, v in named.items() if v is not None)
        absent = tuple(k for k, v in named.items() if v is None and isinstance(k, tuple))
        key = (layout, absent, lam, beta)
        module = self._global_modules.get(key)
        if module is None:  # built once a layout (setdefault would build one every step, on the host's hot path)
            module = self._global_modules[key] = GlobalTerms(self, lam, beta, layout, absent)
        outputs = self.graphs.run_module("losses", ("global terms", f"{len(layout)} inputs"), lambda: module,
                                         tuple(named[k] for k in layout), module)
        return dict(zip(module.keys, outputs))


class GlobalTerms(nn.Module):
    """The objective's terms on the batch's global embeddings and mask, on a flat tuple of tensors named by
    ``layout`` (teachers' parts as ("teacher", name, part); ``absent`` those the batch holds as None): the CLIP and
    distillation terms of B_real and (with captions) B_syn (``Objective._pair_terms``) and the Patch-IB terms, what
    ``--cuda-graphs-losses`` replays as one CUDA graph. Returns the terms' values in the eager order; ``keys`` names
    them (set at its first run, which the capture makes)."""

    def __init__(self, objective: Objective, lam: float, beta: float, layout: tuple, absent: tuple):
        super().__init__()
        object.__setattr__(self, "objective", objective)  # not a submodule: its state stays the objective's
        self.lam, self.beta, self.layout, self.absent = lam, beta, layout, absent
        self.keys: tuple[str, ...] = ()

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        named = dict(zip(self.layout, tensors))
        teachers: dict[str, dict] = {}
        for key in sorted([k for k in self.layout if isinstance(k, tuple)] + list(self.absent)):
            teachers.setdefault(key[1], {})[key[2]] = named.get(key)
        pair = functools.partial(self.objective._pair_terms, named["img"], scale=named["scale"], lam=self.lam,
                                 teachers=teachers, soft=named.get("soft"), beta=self.beta)
        terms = pair(named["txt"], part="txt", positives=named.get("positives"))
        if "syn_txt" in named:
            terms.update(pair(named["syn_txt"], part="syn", positives=named.get("positives_syn")))
        local = {"img": named["local_img"], "txt": named["local_txt"], "masked_img": named.get("masked_img"),
                 "mask": named.get("mask")}
        terms.update(self.objective.patch_ib(local, {"txt": named["txt"], "masked_img": named.get("masked_img")},
                                             named["scale"], positives=named.get("positives"),
                                             soft_targets=named.get("soft")))
        self.keys = tuple(terms)
        return tuple(terms.values())


def loss_balance(terms: dict[str, torch.Tensor], params: Sequence[torch.nn.Parameter]) -> dict[str, float]:
    """Gradient norm each term puts on `params` (e.g. model.trunk_parameters()); 'total' skipped. Terms
    without a graph, or whose graph does not reach the params, are left out rather than given 0.0: with the
    heads on early layers (head_layer 0, local_text_layer 0) the local, mask-words and sparsity terms never
    reach the last block, and a logged 0.0 read as a term with no gradient at all. Keeps the graph for
    backward()."""
    params = [p for p in params if p.requires_grad]
    out: dict[str, float] = {}
    for key, value in terms.items():
        if key == "total" or not torch.is_tensor(value) or not value.requires_grad or not params:
            continue
        grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
        squares = [g.detach().float().pow(2).sum() for g in grads if g is not None]
        if squares:
            out[key] = math.sqrt(float(torch.stack(squares).sum()))
    return out
