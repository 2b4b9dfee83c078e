"""`train run`: the step-based training loop of the Patch-IB student on reinforced shards.

Per optimiser step: ``accum_steps`` micro-batches through the Task (`cxrdr.train.task`: student,
online teacher, objective), then clip, step (AdamW + warm-up/cosine per group), and on logging
steps each term's gradient norm on the shared trunk (``loss_balance``). Staged training freezes
the towers for the first ``optim.freeze_steps`` (heads at a higher LR). Every ``eval_every`` steps,
and at the end, rank 0 runs the quick validation (retrieval + linear-probe AUC,
``cxrdr.train.quick_eval``) and keeps ``best.pt`` on the early-stopping score; ``last.pt`` holds the
full resume state.

DDP (``torchrun``): ``cxrdr.train.distributed`` initialises the group; the student's forward is
wrapped once per training stage (DDP only syncs parameters that require grad when it is built);
the objective gathers features across ranks, so the loss is multiplied by the world size before
``backward`` (see train/distributed.py); each rank streams its own shards; only rank 0
evaluates and writes.

Exact resume (docs/resume.md): ``last.pt`` holds, besides weights, optimiser, schedulers, GradScaler,
text queue and every rank's RNG states, the data stream's position (``cxrdr.train.stream``), so a
run resumed after a kill at any step ends bit-identical to the run never interrupted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from tqdm.auto import tqdm

from cxrdr.common.atomic import copy_atomic, write_json_atomic
from cxrdr.common.augment import stable_seed
from cxrdr.common.heap import frozen_heap
from cxrdr.common.host_threads import host_threads, threads_beside
from cxrdr.common.shards import read_dataset_info
from cxrdr.teachers import load_teacher
from cxrdr.train import distributed as dist_utils
from cxrdr.train.checkpoint import init_from_checkpoint, load_training_state, save_checkpoint
from cxrdr.train.compiling import compile_blocks, compile_model
from cxrdr.train.config import TrainConfig
from cxrdr.train.data import (ReplayedBatches, make_eval_loader, select_teachers, split_shards, teacher_dims,
                              training_parts)
from cxrdr.train.device import amp_dtype_for, autocast, cuda_math_settings, loader_workers, resolve_device
from cxrdr.train.evaluation.zeroshot import load_prompts
from cxrdr.train.health import FiniteWatch, read_scalars
from cxrdr.train.integrity import SKIP_LOG, CorruptPolicy, count_skipped
from cxrdr.train.losses import loss_balance
from cxrdr.train.models import StudentConfig, build_student
from cxrdr.train.models.block_graphs import BlockGraphs, enable_block_graphs, shapes_settled
from cxrdr.train.models.frozen_memo import enable_memos
from cxrdr.train.optim import apply_stage, build_optimizer, build_scheduler
from cxrdr.train.quick_eval import quick_evaluate
from cxrdr.train.rng import preserved_rng, rng_state, seed_everything, set_rng_state
from cxrdr.train.runfolder import (RESUME_OVERRIDABLE, MetricsLog, check_run_folder, data_conflicts, data_source,
                                   json_default, lock_run_folder, resume_conflicts)
from cxrdr.train.stream import StreamState, make_stream_loader
from cxrdr.train.task import Task

# The step's phases as profiler ranges (torch.profiler.record_function: next to nothing while no profiler
# runs): benchmarks/profile_step.py reads which phase the host was in while the GPU waited.
PHASES = {name: f"cxrdr.{name}" for name in ("data", "forward", "backward", "optimizer")}


class StepTimer:
    """Wall seconds per training step, measured between points where the loop waits for the device
    anyway (logging, saving, evaluating), so that timing adds no sync of its own. ``mean_step_ms``
    leaves out each process's first lap (its first step pays start-up costs: workers, allocator,
    compilation, graph capture), unless nothing else was timed, and counts the laps of the processes a
    resumed run continues (``before``: their counted seconds and steps up to the save it resumed from), so
    a run resumed near its end is not timed by its start-up lap alone."""

    def __init__(self, device: torch.device, step: int, before: tuple[float, int] = (0.0, 0)):
        self.device = device
        self.before = (float(before[0]), int(before[1]))
        self.laps: list[tuple[float, int]] = []  # (seconds, steps)
        self.restart(step)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def restart(self, step: int) -> None:
        """Start a lap at ``step`` (after an evaluation or a save, which are not step time)."""
        self.start_step, self.t0 = step, self._now()

    def pending(self, step: int) -> bool:
        return step > self.start_step

    def lap(self, step: int) -> tuple[float, int]:
        """(seconds, steps) since the lap started; the next lap starts here."""
        now = self._now()
        lap = (now - self.t0, max(1, step - self.start_step))
        self.laps.append(lap)
        self.start_step, self.t0 = step, now
        return lap

    def counted(self) -> tuple[float, int]:
        """Seconds and steps of every lap ``mean_step_ms`` counts: the earlier processes' and this one's
        after its first."""
        laps = self.laps[1:]
        return self.before[0] + sum(s for s, _ in laps), self.before[1] + sum(n for _, n in laps)

    def mean_step_ms(self) -> float | None:
        seconds, steps = self.counted()
        if not steps:  # only the start-up lap was timed
            seconds, steps = sum(s for s, _ in self.laps), sum(n for _, n in self.laps)
        return round(1000 * seconds / steps, 3) if steps else None


class Trainer:
    """Holds the run's state; ``run()`` trains to ``cfg.steps`` (or early stop) and returns the summary."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.ddp = dist_utils.init_distributed()
        self.rank, self.world = dist_utils.rank(), dist_utils.world_size()
        self.main = dist_utils.is_main()
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda":
            cuda_math_settings()
        # the loader workers this host gives a run that names none (a resumed one keeps its own: _maybe_resume)
        self.workers_chosen = cfg.workers is None
        cfg = self.cfg = dataclasses.replace(cfg, workers=loader_workers(cfg.workers, self.device))
        self.amp_dtype = amp_dtype_for(cfg.amp, self.device)
        self.out = Path(cfg.out)
        seed_everything(stable_seed("train", cfg.seed, self.rank) % (2**31))
        self._read_data_description()
        self.data_source = data_source(cfg.shards)
        self._build_task()
        # a frozen stem's outputs for the views it has seen: on the CPU (a CUDA row would be read back to hash it),
        # where views repeat (the K stored views replayed; a plain run's are fresh: no hit, only hashing, 5-8 % a step)
        self.memos = enable_memos(self.student, cfg.frozen_memo_mb) \
            if self.device.type == "cpu" and cfg.frozen_memo_mb and cfg.mode != "plain" else []
        self.optimizer = build_optimizer(self.student, self.optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, self.optim_cfg, cfg.steps)
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        self.step = self.data_epoch = self.samples_seen = 0
        self.stream = StreamState(cfg.workers)  # the data stream's position (cxrdr.train.stream)
        self.best_score, self.best_step, self.evals_since_best = -math.inf, -1, 0
        self.last_eval: dict = {}
        self.train_time = 0.0
        # a resumed run's earlier processes, up to the save it resumed from: their timed laps (StepTimer) and wall
        self.timed_before, self.wall_before = (0.0, 0), 0.0
        self.timer: StepTimer | None = None
        self.started = time.perf_counter()
        if self.main:
            check_run_folder(self.out, cfg.resume, cfg.overwrite)
        resumed = self._maybe_resume()
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.cfg.save_yaml(self.out / "config.yaml")
        self.log = MetricsLog(self.out / "metrics.jsonl", self.main, self.step if resumed else None,
                              redo_final_eval=resumed and self.step >= cfg.steps)
        self._setup_eval()
        self._stage = None  # 'frozen' or 'full': the stage self.task.model was wrapped for
        self._compiled = None  # torch.compile of self.task.model for this stage (--compile-scope model)
        text_tower = getattr(self.student, "text_tower", None)
        if text_tower is not None and not cfg.pack_text:
            text_tower.pack = False
        self.block_graphs = self._block_graphs()  # --cuda-graphs (captured at a later step, compiled blocks too)
        if cfg.losses_graphs():  # --cuda-graphs-losses: the loss terms replay through the same graphs
            self.task.objective.graphs = self.block_graphs
        if cfg.compile and cfg.compile_scope == "blocks":  # in place, once: dynamo guards see stage changes
            # the text layers stay eager where the text graphs took them (a graph replays the packed layers as they
            # run on FlashAttention)
            compile_blocks(self.student, cfg.compile_backend,
                           text=getattr(text_tower, "block_graphs", None) is None)
        self.finite = FiniteWatch()  # non-finite losses, read at log and save steps only

    # ---- set-up -------------------------------------------------------------------------------
    def _block_graphs(self) -> BlockGraphs | None:
        """The image tower's CUDA graphs (TrainConfig.cuda_graphs): "on" where asked (the config refuses what they
        cannot go with), "auto" wherever they apply, silently eager elsewhere."""
        cfg = self.cfg
        if cfg.cuda_graphs == "off":
            return None
        if self.device.type != "cuda" or self.ddp:
            if cfg.cuda_graphs == "on":
                warnings.warn(f"--cuda-graphs needs one CUDA process (here: {self.device}, {self.world} "
                              "process(es)); the blocks run eagerly", RuntimeWarning, stacklevel=2)
            return None
        if cfg.cuda_graph_conflicts():  # only auto gets here with any ("on" is refused by the config)
            return None
        return enable_block_graphs(self.student, text=cfg.text_graphs(), heads=cfg.heads_graphs(),
                                   warn=cfg.cuda_graphs == "on", warn_text=cfg.cuda_graphs_text == "on")

    def _read_data_description(self) -> None:
        cfg = self.cfg
        self.info = read_dataset_info(cfg.shards)
        _, self.n_train = split_shards(cfg.shards, "train", self.info)
        if self.n_train == 0:
            raise ValueError(f"{cfg.shards}: the train split is empty")
        self.steps_per_epoch = max(1, self.n_train // (cfg.batch_size * cfg.accum_steps * self.world))

    def _build_task(self) -> None:
        cfg = self.cfg
        overrides = dict(cfg.model_overrides)
        if cfg.grad_checkpointing:
            overrides["grad_checkpointing"] = True
        teacher = load_teacher(cfg.online_teacher, device=str(self.device)) if cfg.online_teacher else None
        if cfg.loss.w_feature and cfg.mode == "reinforced":  # one head into each teacher's space
            overrides["teacher_dims"] = ({teacher.name: int(teacher.embed_dim)} if teacher is not None else
                                         teacher_dims(self.info, select_teachers(self.info, cfg.teachers)))
        self.student = build_student(StudentConfig.from_yaml(cfg.model, **overrides)).to(self.device)
        if cfg.init_ckpt:  # transfer / fine-tuning: a resumed run's own state replaces these weights later
            init = init_from_checkpoint(self.student, cfg.init_ckpt)
            if self.main:
                print(f"note: started from {cfg.init_ckpt} ({init['tensors']} tensors; fresh: "
                      f"{len(init['fresh'])})", file=sys.stderr)
        online_scales = None if teacher is None else {teacher.name: float(teacher.logit_scale)}
        self.optim_cfg, self.loss_cfg = cfg.resolve(self.info, self.steps_per_epoch, online_scales)
        self.task = Task(self.student, self.loss_cfg, cfg.steps, teacher=teacher, device=self.device)
        self.teacher = teacher

    def _setup_eval(self) -> None:
        """Evaluation data (rank 0 evaluates; every rank knows whether there is an eval split)."""
        cfg = self.cfg
        self.teacher_names = ([self.teacher.name] if self.teacher is not None else
                              select_teachers(self.info, cfg.teachers) if cfg.mode == "reinforced" else [])
        self.eval_loader = None
        self.eval_prompts = load_prompts(cfg.eval_prompts) if cfg.eval_prompts else None
        eval_shards = cfg.eval_shards or cfg.shards
        eval_info = self.info if eval_shards == cfg.shards else read_dataset_info(eval_shards)
        eval_urls, n_eval = split_shards(eval_shards, cfg.eval_split, eval_info)
        self.has_eval = bool(eval_urls and n_eval)
        if not self.main:
            return
        if self.has_eval:
            loader = make_eval_loader(eval_shards, cfg.eval_split, self.student,
                                      batch_size=cfg.eval_batch_size, workers=min(cfg.workers, 1),
                                      on_corrupt=cfg.on_corrupt, corrupt_log=str(self.out / SKIP_LOG))
            self.eval_loader = ReplayedBatches(loader, cfg.eval_max_samples, max_bytes=cfg.eval_cache_mb << 20)
        else:
            print(f"note: no {cfg.eval_split!r} split in {eval_shards}: no validation, best.pt = last.pt",
                  file=sys.stderr)

    # ---- state ------------------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        last = self.out / "last.pt"
        if not self.cfg.resume:
            return False
        if not last.is_file():
            if self.main:
                print(f"note: --resume but no {last}: starting from scratch", file=sys.stderr)
            return False
        state = load_training_state(last, map_location="cpu")
        saved_cfg = state.get("train_config") or {}
        if self.workers_chosen and saved_cfg.get("workers") is not None:  # no --workers: the run's own
            self.cfg = dataclasses.replace(self.cfg, workers=int(saved_cfg["workers"]))
            self.stream = StreamState(self.cfg.workers)
        changed = resume_conflicts(saved_cfg, self.cfg.to_dict())
        changed += data_conflicts(state.get("data"), str(saved_cfg.get("shards", "")), self.cfg.shards)
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
        self._load_loop_state(state)
        self._load_stream_state(state.get("data") or {}, last)
        if self.main:
            print(f"resumed from {last} at step {self.step}", file=sys.stderr)
        return True

    def _load_stream_state(self, saved: dict, last: Path) -> None:
        """The data stream's position; a different world size or worker count is refused (each
        slot's shard partition would change, so would every batch from here on)."""
        streams = saved.get("streams")
        if not streams:
            if self.main:
                print(f"note: {last} predates stream positions: the data stream restarts at this step, "
                      f"so the run is not the one that was interrupted", file=sys.stderr)
            return
        saved_workers, saved_world = int(next(iter(streams.values()))["workers"]), int(saved["world"])
        if (saved_world, saved_workers) != (self.world, self.stream.workers):
            raise ValueError(f"--resume: {last} streamed its data as {saved_world} rank(s) x {saved_workers} "
                             f"worker(s) (--workers 0 and 1 are alike); resume with the same --workers and "
                             f"ranks (now {self.world} x {self.stream.workers}), or --overwrite to start afresh")
        self.stream = StreamState(**streams[str(self.rank)])

    def _load_loop_state(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.task.queue is not None and state.get("queue"):
            self.task.queue.load_state_dict(state["queue"])
        self.step = int(state["step"])
        loop_state = state.get("loop", {})
        self.data_epoch = int(loop_state.get("data_epoch", 0))
        self.samples_seen = int(loop_state.get("samples_seen", 0))
        self.best_step = int(loop_state.get("best_step", -1))
        self.evals_since_best = int(loop_state.get("evals_since_best", 0))
        self.train_time = float(loop_state.get("train_time", 0.0))
        seconds, steps = loop_state.get("step_timing", (0.0, 0))
        self.timed_before, self.wall_before = (float(seconds), int(steps)), float(loop_state.get("wall_time", 0.0))
        self.best_score = float(state.get("best_score", -math.inf))
        self.last_eval = state.get("metrics") or {}
        rng = state.get("rng") or {}
        if rng:
            set_rng_state(rng.get(str(self.rank), next(iter(rng.values()))))

    def _state(self) -> dict:
        rngs = dist_utils.all_gather_object(rng_state())
        streams = dist_utils.all_gather_object(self.stream.to_dict())
        return {
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "queue": self.task.queue.state_dict() if self.task.queue is not None else None,
            "step": self.step, "rng": {str(r): s for r, s in enumerate(rngs)},
            "train_config": self.cfg.to_dict(), "metrics": self.last_eval, "best_score": self.best_score,
            "loop": {"data_epoch": self.data_epoch, "samples_seen": self.samples_seen,
                     "best_step": self.best_step, "evals_since_best": self.evals_since_best,
                     "train_time": self.train_time,
                     "step_timing": list(self.timer.counted() if self.timer is not None else self.timed_before),
                     "wall_time": self.wall_before + time.perf_counter() - self.started},
            "data": {**self.data_source, "world": self.world,
                     "streams": {str(r): s for r, s in enumerate(streams)}},
        }

    def save(self, name: str) -> None:
        state = self._state()  # collective (RNG gather): every rank calls it
        if self.main:
            save_checkpoint(self.out / name, self.student, **state)

    # ---- data -------------------------------------------------------------------------------
    def _batches(self):
        """Endless batches from the stream's position (``self.stream``), which each batch advances."""
        cfg = self.cfg
        teacher_size = None
        if self.teacher is not None and self.teacher.kind == "clip":
            teacher_size = int(self.teacher.image_size)
        # a whole-model graph sees one text shape: every batch padded to the context length
        tokenize = self.student.tokenizer.fixed_length() if self._compiles_model else None
        parts = training_parts(cfg.shards, "train", self.student, mode=cfg.mode, seed=cfg.seed, pick=cfg.pick,
                               teachers=cfg.teachers, teacher_image_size=teacher_size,
                               stored_embeddings=self.teacher is None, aug_limit=cfg.aug_limit,
                               caption_sources=cfg.caption_sources, tokenize=tokenize)
        loader = make_stream_loader(parts, cfg.batch_size, self.stream, workers=cfg.workers, seed=cfg.seed,
                                    shuffle_buffer=cfg.shuffle_buffer, rank=self.rank, world=self.world,
                                    policy=CorruptPolicy(cfg.on_corrupt, str(self.out / SKIP_LOG)),
                                    verify_checksums=cfg.verify_checksums, shard_memory_mb=cfg.shard_memory_mb)
        for batch in loader:
            self.stream.consumed(batch.pop("stream"))
            self.data_epoch = self.stream.epoch
            yield batch

    # ---- one optimiser step -------------------------------------------------------------------
    def _wrap(self) -> None:
        """Freeze/unfreeze for this step's stage; (re)wrap the Task's forward in DDP on a change."""
        stage = apply_stage(self.student, self.step, self.optim_cfg)
        if stage == self._stage:
            return
        self._stage = stage
        if self.ddp:
            module = getattr(self.task.model, "module", self.task.model)
            kwargs = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
            # Unused parameters occur (e.g. the E score head's dropped branch, caption pass off).
            self.task.model = DistributedDataParallel(module, find_unused_parameters=True, **kwargs)
        if self._compiles_model:  # a stage change alters which parameters need gradients: compile anew
            self._compiled = compile_model(self.task.model, self.cfg.compile_backend)
        if self.block_graphs is not None:  # the same for the graphs' captured gradients
            self.block_graphs.clear()

    @property
    def _compiles_model(self) -> bool:
        return self.cfg.compiles_whole_model()

    def _compiled_now(self) -> torch.nn.Module | None:
        """The compiled forward once the student's step schedules (k-ratio annealing, keep-rate warm-up)
        are over: no step number reaches the compiled graph (each would be a recompile). Before that,
        and without --compile, None: the eager module runs."""
        if self._compiled is not None and self.step >= self.student.config.warmup_steps_to_target:
            return self._compiled
        return None

    def _micro_step(self, batch: dict, sync: bool, log_balance: bool) -> tuple[dict, dict]:
        """Forward and backward of one micro-batch; (detached loss terms on the device, trunk gradient
        norms on logging steps)."""
        no_sync = self.task.model.no_sync() if self.ddp and not sync else None
        with no_sync if no_sync is not None else contextlib.nullcontext():
            if self.block_graphs is not None:  # eager on a logging step: its loss balance backpropagates each
                # term, and a graph's replay takes one backward (block_graphs)
                self.block_graphs.active = shapes_settled(self.student, self.step) and not log_balance
            with record_function(PHASES["forward"]), autocast(self.device, self.amp_dtype,
                                                              cache=self.block_graphs is None):
                terms = self.task.forward(batch, self.step, compiled=self._compiled_now())
            balance = loss_balance(terms, self.student.trunk_parameters()) if log_balance else {}
            self.finite.observe(terms, self.step)
            loss = terms["total"] * (dist_utils.loss_scale_for_ddp() / self.cfg.accum_steps)
            with record_function(PHASES["backward"]):
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return {k: v.detach() for k, v in terms.items()}, balance

    def _optimizer_step(self) -> torch.Tensor:
        """Unscale, clip, step, zero; the gradient norm before clipping (a device scalar)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.student.parameters() if p.grad is not None]
        if self.cfg.clip_grad and self.cfg.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.clip_grad)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.detach().float().norm() for p in params])) if params else torch.zeros(())
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def train_step(self, batches, log_balance: bool) -> dict:
        """One optimiser step. Loss terms, gradient norm and logit scale stay device tensors (reading
        them is a host sync): ``_train_record`` reads them in one transfer on logging steps."""
        cfg = self.cfg
        self._wrap()
        self.task.model.train()
        sums: dict[str, torch.Tensor] = {}
        balance: dict[str, float] = {}
        data_time = teacher_time = 0.0
        for micro in range(cfg.accum_steps):
            t0 = time.perf_counter()
            with record_function(PHASES["data"]):
                batch = next(batches)
            data_time += time.perf_counter() - t0
            if self.teacher is not None:
                t0 = time.perf_counter()
                batch = self.task.add_online_teacher(batch)
                teacher_time += time.perf_counter() - t0
            terms, micro_balance = self._micro_step(batch, sync=micro == cfg.accum_steps - 1,
                                                    log_balance=log_balance and micro == 0)
            balance = micro_balance or balance
            for k, v in terms.items():
                sums[k] = sums[k] + v / cfg.accum_steps if k in sums else v / cfg.accum_steps
            self.samples_seen += batch["images"].shape[0] * self.world
        with record_function(PHASES["optimizer"]):
            grad_norm = self._optimizer_step()
        lr = max(g["lr"] for g in self.optimizer.param_groups)
        self.scheduler.step()
        self.step += 1
        return {"terms": sums, "balance": balance, "grad_norm": grad_norm, "lr": lr,
                "logit_scale": self.student.current_logit_scale().detach(), "data_time": data_time,
                "teacher_time": teacher_time, "keep_ratio": self.task.keep_ratio, "stage": self._stage}

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, save: bool = True) -> bool:
        """Quick validation on rank 0; every rank learns whether to stop (early stopping). ``save``: write
        last.pt (it is written at an early stop whatever ``save`` says); best.pt follows a better score
        where validation passes save (``save_at_eval``)."""
        improved, stop = False, False
        if not self.has_eval:
            if save:
                self.save("last.pt")
            return False
        if self.main:
            t0 = time.perf_counter()
            with preserved_rng():
                metrics = quick_evaluate(self.student, self.eval_loader, self.device, self.amp_dtype,
                                         recall_weight=self.cfg.recall_weight,
                                         max_samples=self.cfg.eval_max_samples, seed=self.cfg.seed,
                                         prompts=self.eval_prompts, probe=self.cfg.eval_probe,
                                         **self._pass_threads())
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
        improved, stop = dist_utils.all_gather_object((improved, stop))[0]
        # best.pt first: last.pt records the best score, so a run killed between the two saves resumes from the
        # last.pt before, evaluates this step again and saves its best.pt (the other order lost it for good)
        if improved and self.cfg.save_at_eval:
            self.save("best.pt")
        if save or stop:
            self.save("last.pt")
        return stop

    # ---- the run ------------------------------------------------------------------------------
    def _train_record(self, result: dict, step_s: float) -> dict:
        """The metrics.jsonl record of a logging step; ``step_s``: mean seconds per step since the
        previous logging step. Reads every device number of the step in one transfer."""
        cfg = self.cfg
        scalars = read_scalars({**{f"loss/{k}": v for k, v in result["terms"].items()},
                                "grad_norm": result["grad_norm"], "logit_scale": result["logit_scale"]})
        total = scalars.pop("loss/total")
        return {"kind": "train", "step": self.step, "epoch": round(self.samples_seen / self.n_train, 4),
                "samples_seen": self.samples_seen, "loss": total,
                **{k: v for k, v in scalars.items() if k.startswith("loss/")},
                **{f"grad_norm/{k}": v for k, v in result["balance"].items()},
                "grad_norm": scalars["grad_norm"], "lr": result["lr"],
                "logit_scale": scalars["logit_scale"], "keep_ratio": result["keep_ratio"],
                "stage": result["stage"], "step_time_ms": round(step_s * 1000, 3),
                "data_time_ms": round(result["data_time"] * 1000, 3),
                "teacher_time_ms": round(result["teacher_time"] * 1000, 3),
                "samples_per_s": round(cfg.batch_size * cfg.accum_steps * self.world / step_s, 2)}

    def _summary(self, start_step: int, stopped_early: bool, losses: list[float], timing: "StepTimer") -> dict:
        cfg = self.cfg
        return {
            "run_dir": str(self.out), "model": cfg.model, "mode": cfg.mode,
            "online_teacher": cfg.online_teacher, "teachers": self.teacher_names,
            "steps": self.step, "start_step": start_step, "target_steps": cfg.steps,
            "stopped_early": stopped_early, "world_size": self.world, "device": str(self.device),
            "samples_seen": self.samples_seen, "epochs": round(self.samples_seen / self.n_train, 3),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "mean_step_ms": timing.mean_step_ms(), "train_time_s": round(self.train_time, 3),
            # the wall of the commands a resumed run continues, up to the save it resumed from (runs.run_training)
            "earlier_wall_s": round(self.wall_before, 2),
            "best_score": None if self.best_score == -math.inf else self.best_score,
            "best_step": self.best_step, "final_eval": self.last_eval,
            "skipped_corrupt": count_skipped(self.out / SKIP_LOG),
            # None: the blocks ran eagerly (off, not CUDA, ...); else what --cuda-graphs captured
            "cuda_graphs": self.block_graphs.describe() if self.block_graphs is not None else None,
            # views the frozen stem had seen before (their outputs remembered, not computed again), in this process
            "frozen_memo": [memo.describe() for memo in self.memos] or None,
        }

    def _train_until_done(self, bar) -> tuple[bool, list[float], "StepTimer"]:
        """Steps to cfg.steps; (stopped early, total loss of each logging step, the step timer).

        Only logging steps (the first, every log_every-th, the last) and saving steps wait for the
        device: they read the step's numbers, check that every loss so far was finite, and time the
        steps since the previous such point. Other steps queue work and go on. A step that measures the loss
        balance (``balance_now``) logs too."""
        cfg, batches = self.cfg, self._batches()
        losses: list[float] = []
        timing = self.timer = StepTimer(self.device, self.step, self.timed_before)
        if cfg.early_stop_patience and self.evals_since_best >= cfg.early_stop_patience:
            return True, losses, timing  # resumed from an early stop's save (killed before its summary): stopped
        while self.step < cfg.steps:
            balance_now = self._balance_now()
            log_now = (balance_now or self.step == 0 or (self.step + 1) % cfg.log_every == 0
                       or self.step == cfg.steps - 1)
            result = self.train_step(batches, log_balance=balance_now)
            bar.update(1)
            if log_now:
                self.finite.check()
                seconds, steps = timing.lap(self.step)
                self.train_time += seconds
                record = self._train_record(result, seconds / steps)
                self.log.write(record)
                losses.append(record["loss"])
                bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{result['lr']:.2e}")
            evaluate_now = bool(cfg.eval_every) and self.step % cfg.eval_every == 0 and self.step < cfg.steps
            # the last step's save is the end's (run: evaluate, then last.pt)
            save_now = bool(cfg.save_every) and self.step % cfg.save_every == 0 and self.step < cfg.steps
            if evaluate_now or save_now:
                self._close_lap(timing)
                if evaluate_now and self.evaluate(save=save_now or cfg.save_at_eval):
                    return True, losses, timing
                if save_now and not evaluate_now:
                    self.save("last.pt")
                timing.restart(self.step)
        self._close_lap(timing)
        return False, losses, timing

    def _balance_now(self) -> bool:
        """Whether this step measures each loss term's gradient norm (``loss_balance``): the first and last step and
        every balance_every-th. Not every logging step: it costs a backward pass per term (on the CPU demo's
        student ~0.2 s, half a step, at each of 41 logging steps until stop 67) and, on CUDA, an eager step."""
        cfg = self.cfg
        if not cfg.balance_every:
            return False
        return self.step == 0 or (self.step + 1) % cfg.balance_every == 0 or self.step == cfg.steps - 1

    def _close_lap(self, timing: "StepTimer") -> None:
        """Before an evaluation or a save: every loss so far finite, and the steps since the last
        timing point counted as training time (not the evaluation's)."""
        self.finite.check()
        if timing.pending(self.step):
            self.train_time += timing.lap(self.step)[0]

    def _pass_threads(self) -> dict:
        """A validation pass's CPU threads: on a GPU one for all its host work (``cxrdr.common.host_threads``); on the
        CPU the model needs every thread, and beside busy loader workers the probe alone gets one."""
        if self.device.type == "cuda":
            return {"threads": 1, "probe_threads": None}
        return {"threads": None, "probe_threads": 1 if self.cfg.workers else None}

    def host_threads(self) -> int | None:
        """The run's own CPU threads: on a GPU, its share of the cores every rank's loader workers leave
        (``cxrdr.common.host_threads``); on the CPU, the process's (the model's work is theirs)."""
        if self.device.type == "cuda" and self.cfg.workers > 0:
            return threads_beside(self.cfg.workers, processes=self.world)
        return None

    def run(self) -> dict:
        start_step = self.step
        with tqdm(total=self.cfg.steps, initial=self.step, desc="train", unit="step",
                  disable=not (self.main and self.cfg.progress), dynamic_ncols=True) as bar:
            with frozen_heap():  # no collection walks the model, the optimiser and the imports mid-run
                stopped_early, losses, timing = self._train_until_done(bar)
        if not stopped_early:
            self.evaluate()
        if self.main and not self.has_eval:
            copy_atomic(self.out / "last.pt", self.out / "best.pt")
        summary = self._summary(start_step, stopped_early, losses, timing)
        if self.main:
            write_json_atomic(self.out / "summary.json", summary, default=json_default)  # the run's "done" mark
        return summary


def train(cfg: TrainConfig | dict, lock=None) -> dict:
    """Train a student as ``cfg`` says; returns (and writes to RUN/summary.json) the summary.

    ``lock``: the run folder's lock when the caller already holds it (an experiment claims a run for its
    training and evaluation); otherwise the run takes it itself, for the run's duration."""
    if isinstance(cfg, dict):
        cfg = TrainConfig.from_dict(cfg)
    own = lock_run_folder(cfg) if lock is None else None
    try:
        trainer = Trainer(cfg)
        try:
            with host_threads(trainer.host_threads()):
                return trainer.run()
        finally:
            dist_utils.barrier()
    finally:
        if own is not None:
            own.release()
