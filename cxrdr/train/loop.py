"""`train run`: the step-based training loop of the Patch-IB student on reinforced shards.

Per optimiser step (``accum_steps`` micro-batches):
    batch = (aug image, report, synthetic caption, teachers' embeddings of exactly that view/caption)
    out_real = student(image, report)                   # B_real
    out_syn  = (same image embedding, student text(caption))   # B_syn: the image tower runs once
    losses   = train.losses.compute_losses(out_real, out_syn, batch, ...)   # CLIP/distill/Patch-IB/local
then clip, step (AdamW + warm-up/cosine per group), and on logging steps each term's gradient norm
on the shared trunk (``loss_balance``). Staged training freezes the towers for the first
``freeze_steps`` (heads at a higher LR). Every ``eval_every`` steps, and at the end, rank 0 runs
the quick validation (retrieval + linear-probe AUC, ``cxrdr.train.quick_eval``) and keeps ``best.pt`` on
the early-stopping score; ``last.pt`` holds the full resume state.

Online-teacher mode (``--online-teacher SPEC``) replays the same stored views but ignores the
stored embeddings: the teacher embeds the crop (replayed at its own input size by the loader)
and the report/caption inside the loop. It exists to measure what storing embeddings saves.

DDP (``torchrun``): ``cxrdr.train.distributed`` initialises the group; the model is wrapped once per
training stage (DDP only syncs parameters that require grad when it is built); the losses gather
features across ranks, so the loss is multiplied by the world size before ``backward``
(see train/distributed.py); each rank resamples its own shards; only rank 0 evaluates and writes.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from cxrdr.train.config import TrainConfig
from cxrdr.train.integrity import SKIP_LOG, count_skipped


# --------------------------------------------------------------------------- small helpers


def resolve_device(name: str):
    import torch

    from cxrdr.train import distributed as dist_utils

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device("cuda", dist_utils.local_rank())


def amp_dtype_for(amp: str, device):
    """Autocast dtype on CUDA; None (full precision) on CPU or with --amp none."""
    import torch

    if device.type != "cuda" or amp == "none":
        return None
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16 if amp == "bf16" else torch.float16


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state() -> dict:
    import numpy as np
    import torch

    # Tensors and plain types only (checkpoints are read with weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if hasattr(keys, "numpy") else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu() if hasattr(state["torch"], "cpu") else state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(state["cuda"])
        except (RuntimeError, ValueError):  # different GPU count on resume: keep fresh CUDA RNG
            pass


def _to_float(value) -> float:
    return float(value.detach().float().item()) if hasattr(value, "detach") else float(value)


@dataclass
class SynView:
    """B_syn as compute_losses reads it: the real batch's image embedding, the captions' text."""

    image_emb: object
    text_emb: object
    logit_scale: object


def _two_text_module():
    import torch.nn as nn

    class TwoTextStudent(nn.Module):
        """One forward for B_real and B_syn (so DDP sees one forward per backward)."""

        def __init__(self, student):
            super().__init__()
            self.student = student

        def forward(self, images, report_ids, report_mask, caption_ids=None, caption_mask=None, step=None,
                    local_pairs=0, local_words=False):
            out = self.student(images, report_ids, report_mask, step=step, local_pairs=local_pairs,
                               local_words=local_words)
            syn = None
            if caption_ids is not None:
                syn = self.student.encode_text(caption_ids, caption_mask)
            return out, syn

    return TwoTextStudent


class MetricsLog:
    """RUN/metrics.jsonl, one JSON object per line (rank 0 only); on resume, lines after the
    resumed step are dropped so the file reads as one consistent run."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None = None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if resume_step is not None and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif path.exists():
            path.unlink()

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=_json_default) + "\n")


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


# --------------------------------------------------------------------------- run folder

# Settings a resumed run may change: they decide how long, where and how visibly it runs, not
# what one training step computes (everything else must equal the checkpoint's train_config).
RESUME_OVERRIDABLE = frozenset({"steps", "eval_every", "eval_batch_size", "eval_max_samples",
                                "early_stop_patience", "workers", "device", "progress", "log_every",
                                "save_every", "resume", "overwrite", "out", "on_corrupt"})
RUN_OUTPUTS = ("last.pt", "best.pt", "metrics.jsonl", "summary.json", "config.yaml", "skipped.jsonl")


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """'name saved -> current' for every setting that differs and may not change on resume
    (a field the checkpoint predates is compared with its current default)."""
    from cxrdr.train.config import TrainConfig

    defaults = TrainConfig().to_dict()
    out = []
    for name in sorted(set(current) - RESUME_OVERRIDABLE):
        old = saved.get(name, defaults.get(name))
        if old != current[name]:
            out.append(f"{name} {old!r} -> {current[name]!r}")
    return out


def check_run_folder(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to replace another run's outputs unless --overwrite (then delete them first)."""
    existing = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if not existing or resume:
        return
    if not overwrite:
        raise ValueError(f"--out {out} already holds a run ({', '.join(existing)}); pass --resume to "
                         f"continue it, --overwrite to replace it, or choose another --out")
    for name in existing:
        (out / name).unlink()


def lock_run_folder(cfg: TrainConfig):
    """Rank 0 holds an exclusive lock on the run folder while it trains (None on other ranks)."""
    from cxrdr.common.locking import lock_folder, remove_stale_temp_files

    if int(os.environ.get("RANK", 0)) != 0:
        return None
    lock = lock_folder(cfg.out, "train run")
    remove_stale_temp_files(cfg.out)  # checkpoint temp files of a killed run
    return lock


# --------------------------------------------------------------------------- the loop


class Trainer:
    """Holds the run's state; ``run()`` trains to ``cfg.steps`` (or early stop) and returns the summary."""

    def __init__(self, cfg: TrainConfig):
        import torch

        from cxrdr.common.augment import stable_seed
        from cxrdr.train import distributed as dist_utils
        from cxrdr.train.data import make_eval_loader, read_info, split_shards
        from cxrdr.train.losses import LossConfig, TextQueue, teacher_scales_from_info
        from cxrdr.train.models import StudentConfig, build_student
        from cxrdr.train.optim import OptimConfig, apply_stage, build_optimizer, build_scheduler

        self.cfg = cfg
        self.torch = torch
        self.dist = dist_utils
        self.ddp = dist_utils.init_distributed()
        self.rank, self.world = dist_utils.rank(), dist_utils.world_size()
        self.main = dist_utils.is_main()
        self.device = resolve_device(cfg.device)
        self.amp_dtype = amp_dtype_for(cfg.amp, self.device)
        self.out = Path(cfg.out)
        seed_everything(stable_seed("train", cfg.seed, self.rank) % (2**31))

        # data description
        self.info = read_info(cfg.shards)
        _, self.n_train = split_shards(cfg.shards, "train", self.info)
        if self.n_train == 0:
            raise ValueError(f"{cfg.shards}: the train split is empty")
        global_batch = cfg.batch_size * cfg.accum_steps * self.world
        self.steps_per_epoch = max(1, self.n_train // global_batch)

        # model
        overrides = dict(cfg.model_overrides)
        if cfg.grad_checkpointing:
            overrides["grad_checkpointing"] = True
        student_cfg = StudentConfig.from_yaml(cfg.model, **overrides)
        self.student = build_student(student_cfg).to(self.device)

        # online teacher
        self.teacher = None
        if cfg.online_teacher:
            from cxrdr.teachers import load_teacher

            self.teacher = load_teacher(cfg.online_teacher, device=str(self.device))

        # losses
        loss_data = dict(cfg.loss)
        loss_data["lambda_distill"] = cfg.lambda_distill
        scales = teacher_scales_from_info(self.info)
        if self.teacher is not None:
            scales = {self.teacher.name: float(self.teacher.logit_scale)}
        loss_data["teacher_scales"] = {**scales, **loss_data.get("teacher_scales", {})}
        self.loss_cfg = LossConfig.from_dict(loss_data)
        # the token-region contrastive term needs every text pooled over every image of the batch
        contrastive = (self.student.local_align is not None and self.loss_cfg.w_local > 0
                       and self.loss_cfg.local_loss in ("contrastive", "both"))
        self.local_pairs = self.loss_cfg.local_tokens if contrastive else 0
        self.queue = (TextQueue(self.loss_cfg.queue_size, self.student.embed_dim, self.device)
                      if self.loss_cfg.queue_size > 0 else None)

        # optimisation
        optim_data = dict(cfg.optim)
        optim_data["lr"] = cfg.lr
        freeze = cfg.freeze_steps or int(math.ceil(cfg.freeze_epochs * self.steps_per_epoch))
        if freeze:
            optim_data["freeze_steps"] = freeze
            optim_data["frozen_head_lr_mult"] = cfg.head_lr_mult
        for key in ("weight_decay", "llrd"):
            if getattr(cfg, key) is not None:
                optim_data[key] = getattr(cfg, key)
        if cfg.warmup_steps is not None:
            optim_data["warmup_steps"] = cfg.warmup_steps
        elif "warmup_steps" not in optim_data:
            optim_data["warmup_steps"] = min(100, max(1, cfg.steps // 20))
        self.optim_cfg = OptimConfig.from_dict(optim_data)
        self.optimizer = build_optimizer(self.student, self.optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, self.optim_cfg, cfg.steps)
        self.scaler = (torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None)
        self._apply_stage = apply_stage

        # state
        self.step = 0
        self.data_epoch = 0
        self.samples_seen = 0
        self.best_score = -math.inf
        self.best_step = -1
        self.evals_since_best = 0
        self.last_eval: dict = {}
        self.train_time = 0.0
        if self.main:
            check_run_folder(self.out, cfg.resume, cfg.overwrite)
        resumed = self._maybe_resume()

        # outputs
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            cfg.save_yaml(self.out / "config.yaml")
        self.log = MetricsLog(self.out / "metrics.jsonl", self.main, self.step if resumed else None)

        # evaluation data (rank 0 evaluates; every rank knows whether there is an eval split)
        from cxrdr.train.data import select_teachers

        self.teacher_names = ([self.teacher.name] if self.teacher is not None else
                              select_teachers(self.info, cfg.teachers) if cfg.mode == "reinforced" else [])
        self.eval_loader = None
        eval_urls, n_eval = split_shards(cfg.shards, cfg.eval_split, self.info)
        self.has_eval = bool(eval_urls and n_eval)
        if self.main:
            if self.has_eval:
                self.eval_loader = make_eval_loader(cfg.shards, cfg.eval_split, self.student,
                                                    batch_size=cfg.eval_batch_size,
                                                    workers=min(cfg.workers, 1), on_corrupt=cfg.on_corrupt,
                                                    corrupt_log=str(self.out / SKIP_LOG))
            else:
                print(f"note: no {cfg.eval_split!r} split in {cfg.shards}: no validation, "
                      f"best.pt = last.pt", file=sys.stderr)
        self.model = None  # the (DDP-wrapped) forward module, built per stage
        self._stage = None

    # ---- state ------------------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        from cxrdr.train.checkpoint import load_training_state

        last = self.out / "last.pt"
        if not self.cfg.resume:
            return False
        if not last.is_file():
            if self.main:
                print(f"note: --resume but no {last}: starting from scratch", file=sys.stderr)
            return False
        state = load_training_state(last, map_location="cpu")
        changed = resume_conflicts(state.get("train_config") or {}, self.cfg.to_dict())
        if changed:
            raise ValueError(f"--resume: {last} was trained with other settings ({'; '.join(changed)}); "
                             f"rerun with the run's settings (changeable on resume: "
                             f"{', '.join(sorted(RESUME_OVERRIDABLE))}), or pass --overwrite to start afresh")
        try:
            self.student.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(f"--resume: {last} does not fit the model {self.cfg.model!r}: {first}") from exc
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.queue is not None and state.get("queue"):
            self.queue.load_state_dict(state["queue"])
        self.step = int(state["step"])
        loop_state = state.get("loop", {})
        self.data_epoch = int(loop_state.get("data_epoch", 0))
        self.samples_seen = int(loop_state.get("samples_seen", 0))
        self.best_step = int(loop_state.get("best_step", -1))
        self.evals_since_best = int(loop_state.get("evals_since_best", 0))
        self.train_time = float(loop_state.get("train_time", 0.0))
        self.best_score = float(state.get("best_score", -math.inf))
        self.last_eval = state.get("metrics") or {}
        rng = state.get("rng") or {}
        if str(self.rank) in rng:
            set_rng_state(rng[str(self.rank)])
        elif rng:
            set_rng_state(next(iter(rng.values())))
        if self.main:
            print(f"resumed from {last} at step {self.step}", file=sys.stderr)
        return True

    def _state(self) -> dict:
        rngs = self.dist.all_gather_object(rng_state())
        return {
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "queue": self.queue.state_dict() if self.queue is not None else None,
            "step": self.step, "rng": {str(r): s for r, s in enumerate(rngs)},
            "train_config": self.cfg.to_dict(), "metrics": self.last_eval, "best_score": self.best_score,
            "loop": {"data_epoch": self.data_epoch, "samples_seen": self.samples_seen,
                     "best_step": self.best_step, "evals_since_best": self.evals_since_best,
                     "train_time": self.train_time},
        }

    def save(self, name: str) -> None:
        from cxrdr.train.checkpoint import save_checkpoint

        state = self._state()  # collective (RNG gather): every rank calls it
        if self.main:
            save_checkpoint(self.out / name, self.student, **state)

    # ---- data -------------------------------------------------------------------------------
    def _loader(self):
        from cxrdr.train.data import make_loader

        cfg = self.cfg
        # Random picks stream resampled shards forever; sequential picks need real epochs
        # (view = epoch % K), so they take one pass per epoch.
        resampled = cfg.pick == "random"
        teacher_size = None
        if self.teacher is not None and self.teacher.kind == "clip":
            teacher_size = int(self.teacher.image_size)
        return make_loader(cfg.shards, "train", self.student, cfg.batch_size, mode=cfg.mode,
                           workers=cfg.workers, resampled=resampled, shuffle_buffer=cfg.shuffle_buffer,
                           seed=cfg.seed, pick=cfg.pick,
                           epoch=self.data_epoch if not resampled else self.step,
                           teachers=cfg.teachers, teacher_image_size=teacher_size,
                           stored_embeddings=self.teacher is None, on_corrupt=cfg.on_corrupt,
                           corrupt_log=str(self.out / SKIP_LOG), aug_limit=cfg.aug_limit,
                           caption_sources=cfg.caption_sources)

    def _batches(self):
        """Endless batches; a one-pass loader is rebuilt with the next epoch when it runs out."""
        while True:
            empty = True
            for batch in self._loader():
                empty = False
                yield batch
            if empty:
                raise ValueError(f"{self.cfg.shards}: no training samples reached this rank "
                                 f"(fewer train shards than ranks x workers?)")
            self.data_epoch += 1

    def _online_teacher(self, batch: dict) -> dict:
        """Replace stored embeddings by the online teacher's, on the same crops and texts."""
        torch = self.torch
        t = self.teacher
        with torch.no_grad():
            img = t.encode_images(batch["teacher_images"]) if t.kind == "clip" else None
            txt = t.encode_texts(batch["report_text"])
            syn = t.encode_texts(batch["caption_text"])
        batch["teacher"] = {t.name: {"img": img, "txt": txt, "syn": syn}}
        return batch

    # ---- model wrapping per stage -------------------------------------------------------------
    def _wrap(self) -> None:
        stage = self._apply_stage(self.student, self.step, self.optim_cfg)
        if self.model is not None and stage == self._stage:
            return
        self._stage = stage
        module = _two_text_module()(self.student)
        if self.ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            kwargs = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
            # Unused parameters occur (e.g. the E score head's dropped branch, caption pass off).
            module = DDP(module, find_unused_parameters=True, **kwargs)
        self.model = module

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return self.torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    # ---- one optimiser step -------------------------------------------------------------------
    def train_step(self, batches, log_balance: bool) -> dict:
        from cxrdr.train.losses import compute_losses, loss_balance

        torch, cfg = self.torch, self.cfg
        self._wrap()
        self.model.train()
        use_syn = self.loss_cfg.use_syn
        sums: dict[str, float] = {}
        balance: dict[str, float] = {}
        data_time = teacher_time = 0.0
        keep_ratio = 1.0
        for micro in range(cfg.accum_steps):
            t0 = time.perf_counter()
            batch = next(batches)
            data_time += time.perf_counter() - t0
            if self.teacher is not None:
                t0 = time.perf_counter()
                batch = self._online_teacher(batch)
                teacher_time += time.perf_counter() - t0
            dev = self.device
            images = batch["images"].to(dev, non_blocking=True)
            args = [images, batch["report_ids"].to(dev), batch["report_mask"].to(dev)]
            if use_syn:
                args += [batch["caption_ids"].to(dev), batch["caption_mask"].to(dev)]
            sync = (self.ddp and micro < cfg.accum_steps - 1)
            with (self.model.no_sync() if sync else contextlib.nullcontext()):
                with self._autocast():
                    out, syn_txt = self.model(*args, step=self.step, local_pairs=self.local_pairs,
                                              local_words=bool(self.local_pairs) and self.loss_cfg.local_word_contrast)
                out_syn = (SynView(out.image_emb, syn_txt, out.logit_scale) if syn_txt is not None else None)
                terms = compute_losses(out, out_syn, batch, self.loss_cfg, self.step, cfg.steps, self.queue)
                if log_balance and micro == 0:
                    balance = loss_balance(terms, self.student.trunk_parameters())
                loss = terms["total"] * (self.dist.loss_scale_for_ddp() / cfg.accum_steps)
                if not torch.isfinite(terms["total"]):
                    raise FloatingPointError(f"non-finite loss at step {self.step}: "
                                             f"{ {k: _to_float(v) for k, v in terms.items()} }")
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + _to_float(v) / cfg.accum_steps
            keep_ratio = float(getattr(out, "keep_ratio", 1.0))
            self.samples_seen += images.shape[0] * self.world
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.student.parameters() if p.grad is not None]
        if cfg.clip_grad and cfg.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip_grad)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.detach().float().norm() for p in params])) if params else torch.zeros(())
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler.step()
        self.step += 1
        return {"terms": sums, "balance": balance, "grad_norm": _to_float(grad_norm), "lr": max(lrs),
                "logit_scale": _to_float(self.student.current_logit_scale()), "data_time": data_time,
                "teacher_time": teacher_time, "keep_ratio": keep_ratio, "stage": self._stage}

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self) -> dict | None:
        """Quick validation on rank 0; every rank learns whether to stop (early stopping)."""
        from cxrdr.train.quick_eval import quick_evaluate

        improved, stop = False, False
        if not self.has_eval:
            self.save("last.pt")
            return False
        if self.main:
            t0 = time.perf_counter()
            metrics = quick_evaluate(self.student, self.eval_loader, self.device, self.amp_dtype,
                                     recall_weight=self.cfg.recall_weight,
                                     max_samples=self.cfg.eval_max_samples, seed=self.cfg.seed)
            metrics["eval_time_s"] = round(time.perf_counter() - t0, 3)
            self.last_eval = metrics
            if metrics["score"] > self.best_score:
                self.best_score, self.best_step, self.evals_since_best = metrics["score"], self.step, 0
                improved = True
            else:
                self.evals_since_best += 1
            patience = self.cfg.early_stop_patience
            stop = bool(patience and self.evals_since_best >= patience)
            self.log.write({"kind": "eval", "step": self.step, "split": self.cfg.eval_split,
                            "best_score": self.best_score, **metrics})
        improved, stop = self.dist.all_gather_object((improved, stop))[0]
        self.save("last.pt")
        if improved:
            self.save("best.pt")
        return stop

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        from tqdm.auto import tqdm

        cfg = self.cfg
        start_step = self.step
        batches = self._batches()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step",
                   disable=not (self.main and cfg.progress), dynamic_ncols=True)
        stopped_early = False
        first_loss = last_loss = None
        step_times: list[float] = []
        try:
            while self.step < cfg.steps:
                t0 = time.perf_counter()
                # Log the first step, every log_every-th completed step, and the last one.
                log_now = (self.step == 0 or (self.step + 1) % cfg.log_every == 0
                           or self.step == cfg.steps - 1)
                result = self.train_step(batches, log_balance=log_now)
                if self.device.type == "cuda":
                    self.torch.cuda.synchronize(self.device)
                dt = time.perf_counter() - t0
                self.train_time += dt
                step_times.append(dt)
                total = result["terms"]["total"]
                first_loss = total if first_loss is None else first_loss
                last_loss = total
                if log_now:
                    record = {"kind": "train", "step": self.step, "epoch": round(self.samples_seen / self.n_train, 4),
                              "samples_seen": self.samples_seen, "loss": total,
                              **{f"loss/{k}": v for k, v in result["terms"].items() if k != "total"},
                              **{f"grad_norm/{k}": v for k, v in result["balance"].items()},
                              "grad_norm": result["grad_norm"], "lr": result["lr"],
                              "logit_scale": result["logit_scale"], "keep_ratio": result["keep_ratio"],
                              "stage": result["stage"], "step_time_ms": round(dt * 1000, 3),
                              "data_time_ms": round(result["data_time"] * 1000, 3),
                              "teacher_time_ms": round(result["teacher_time"] * 1000, 3),
                              "samples_per_s": round(cfg.batch_size * cfg.accum_steps * self.world / dt, 2)}
                    self.log.write(record)
                bar.update(1)
                bar.set_postfix(loss=f"{total:.4f}", lr=f"{result['lr']:.2e}")
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    if self.evaluate():
                        stopped_early = True
                        break
                elif cfg.save_every and self.step % cfg.save_every == 0:
                    self.save("last.pt")
        finally:
            bar.close()
        if not stopped_early:
            self.evaluate()
        if self.main and not self.has_eval:
            import shutil

            shutil.copyfile(self.out / "last.pt", self.out / "best.pt")
        timed = step_times[1:] if len(step_times) > 1 else step_times  # step 1 pays start-up costs
        summary = {
            "run_dir": str(self.out), "model": cfg.model, "mode": cfg.mode,
            "online_teacher": cfg.online_teacher, "teachers": self.teacher_names,
            "steps": self.step, "start_step": start_step, "target_steps": cfg.steps,
            "stopped_early": stopped_early, "world_size": self.world, "device": str(self.device),
            "samples_seen": self.samples_seen, "epochs": round(self.samples_seen / self.n_train, 3),
            "first_loss": first_loss, "last_loss": last_loss,
            "mean_step_ms": round(1000 * sum(timed) / len(timed), 3) if timed else None,
            "train_time_s": round(self.train_time, 3),
            "best_score": None if self.best_score == -math.inf else self.best_score,
            "best_step": self.best_step, "final_eval": self.last_eval,
            "skipped_corrupt": count_skipped(self.out / SKIP_LOG),
        }
        if self.main:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=_json_default))
        return summary


def train(cfg: TrainConfig | dict) -> dict:
    """Train a student as ``cfg`` says; returns (and writes to RUN/summary.json) the summary."""
    if isinstance(cfg, dict):
        cfg = TrainConfig(**cfg)
    lock = lock_run_folder(cfg)
    try:
        trainer = Trainer(cfg)
        try:
            return trainer.run()
        finally:
            trainer.dist.barrier()
    finally:
        if lock is not None:
            lock.release()


# --------------------------------------------------------------------------- CLI


def cli_run(
    shards: Annotated[Optional[str], typer.Option("--shards", help="Shard folder written by `reinforce build`.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Student config: A..E, tiny-A..tiny-E, biomedclip-D, or a YAML path.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimiser steps to train to (a resumed run continues to the same number).")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Run folder: config.yaml, metrics.jsonl, last.pt, best.pt, summary.json.")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="Training YAML (TrainConfig fields; flags override it).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Per-rank micro-batch size.")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate.")] = None,
    lambda_distill: Annotated[Optional[float], typer.Option("--lambda-distill", help="MobileCLIP lambda: (1-l)*CLIP + l*distill.")] = None,
    teachers: Annotated[Optional[str], typer.Option("--teachers", help="Comma list: subset of the shards' teachers to distil from (default all).")] = None,
    mode: Annotated[Optional[str], typer.Option("--mode", help="reinforced (stored views + embeddings) or plain (fresh augmentation, no teacher).")] = None,
    online_teacher: Annotated[Optional[str], typer.Option("--online-teacher", help="Teacher spec run inside the loop on the same crops (replaces stored embeddings).")] = None,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", help="Validate every N steps (0: only at the end).")] = None,
    early_stop_patience: Annotated[Optional[int], typer.Option("--early-stop-patience", help="Stop after N validations without improvement (0: off).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from RUN/last.pt (settings must match the run's, except steps, eval/log/save intervals, workers, device).")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the run already in --out (its last.pt, best.pt, metrics.jsonl).")] = False,
    on_corrupt: Annotated[Optional[str], typer.Option("--on-corrupt", help="A damaged shard or sample: stop (default, naming shard and key) or skip (counted in RUN/skipped.jsonl and summary.json).")] = None,
    save_every: Annotated[Optional[int], typer.Option("--save-every", help="Steps between last.pt writes besides evaluations (0: only at evaluations and the end; default 100).")] = None,
    amp: Annotated[Optional[str], typer.Option("--amp", help="bf16, fp16 or none (CUDA only).")] = None,
    accum_steps: Annotated[Optional[int], typer.Option("--accum-steps", help="Micro-batches per optimiser step.")] = None,
    clip_grad: Annotated[Optional[float], typer.Option("--clip-grad", help="Max gradient norm (0: off).")] = None,
    grad_checkpointing: Annotated[bool, typer.Option("--grad-checkpointing", help="Activation checkpointing in both towers.")] = False,
    workers: Annotated[Optional[int], typer.Option("--workers", help="DataLoader workers per rank.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of model init, data order and view picks.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="auto, cpu or cuda.")] = None,
    freeze_steps: Annotated[Optional[int], typer.Option("--freeze-steps", help="Staged training: steps with frozen towers (heads at --head-lr-mult x LR).")] = None,
    freeze_epochs: Annotated[Optional[float], typer.Option("--freeze-epochs", help="The same in epochs of the train split.")] = None,
    head_lr_mult: Annotated[Optional[float], typer.Option("--head-lr-mult", help="Head LR factor while towers are frozen.")] = None,
    warmup_steps: Annotated[Optional[int], typer.Option("--warmup-steps", help="Linear LR warm-up steps before the cosine (default 5% of steps, at most 100).")] = None,
    llrd: Annotated[Optional[float], typer.Option("--llrd", help="Layer-wise LR decay (1.0: off; default 0.85).")] = None,
    pick: Annotated[Optional[str], typer.Option("--pick", help="random or sequential (stored view/caption = epoch % K).")] = None,
    log_every: Annotated[Optional[int], typer.Option("--log-every", help="Steps between metrics.jsonl records.")] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No tqdm bar.")] = False,
) -> None:
    """Train the Patch-IB student on reinforced shards (distillation from stored teacher embeddings).

    Writes RUN/config.yaml, RUN/metrics.jsonl (loss terms, their gradient norms on the shared trunk,
    lr, logit scale, step time, samples/s; validation retrieval R@K and probe AUC), RUN/last.pt (full
    resume state), RUN/best.pt (best early-stopping score w*mean Recall + (1-w)*mean AUC) and
    RUN/summary.json. Multi-GPU: `torchrun --nproc_per_node N -m cxrdr.train.cli run ...`.
    """
    from cxrdr.common.errors import UserError

    try:
        cfg = TrainConfig.load(
            config, shards=shards, model=model, steps=steps, out=out, batch_size=batch_size, lr=lr,
            lambda_distill=lambda_distill, teachers=teachers, mode=mode, online_teacher=online_teacher,
            eval_every=eval_every, early_stop_patience=early_stop_patience, resume=resume or None,
            overwrite=overwrite or None, save_every=save_every, on_corrupt=on_corrupt,
            amp=amp, accum_steps=accum_steps, clip_grad=clip_grad,
            grad_checkpointing=grad_checkpointing or None, workers=workers, seed=seed, device=device,
            freeze_steps=freeze_steps, freeze_epochs=freeze_epochs, head_lr_mult=head_lr_mult,
            warmup_steps=warmup_steps, llrd=llrd, pick=pick, log_every=log_every,
            progress=False if no_progress else None)
    except (TypeError, ValueError) as exc:
        raise UserError(str(exc)) from exc
    if not Path(cfg.shards).is_dir():
        raise UserError(f"--shards {cfg.shards}: no such folder")
    summary = train(cfg)
    from cxrdr.train import distributed as dist_utils

    if dist_utils.is_main():
        typer.echo(json.dumps({k: v for k, v in summary.items() if k != "final_eval"}, indent=1,
                              default=_json_default))
        final = summary.get("final_eval") or {}
        if final:
            keys = ("i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "probe_mean_auc", "score")
            typer.echo("validation: " + ", ".join(f"{k}={final[k]:.3f}" for k in keys
                                                  if isinstance(final.get(k), (int, float))))
    dist_utils.cleanup()
