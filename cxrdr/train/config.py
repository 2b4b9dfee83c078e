"""TrainConfig: every knob of `train run`, from defaults < a YAML file < command-line flags.

Layers: the run's own fields at the top level, the optimiser and schedule under ``optim:``
(`cxrdr.train.optim.OptimConfig`), the objective under ``loss:`` (`cxrdr.train.losses.LossConfig`),
the student as ``model`` (a StudentConfig name or YAML path) plus ``model_overrides``. Each setting
is defined once; unknown keys are an error naming the file. Settings whose default depends on the
run (the warm-up length, freeze epochs, lambda in plain mode, the teachers' logit scales) stay as
written here and are filled in by `TrainConfig.resolve`, the one place that computes them.

The config as written (not resolved) goes to ``RUN/config.yaml`` and into every checkpoint.
Flags of `train run` are derived from the fields (`cli_fields`): top-level scalars by name, the
optim/loss settings in `PROMOTED_FLAGS` under their short names.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cxrdr.common.atomic import write_text_atomic
from cxrdr.common.configs import find_config
from cxrdr.common.yamlio import check_known_fields, read_yaml_mapping, validate_fields
from cxrdr.train.compiling import SCOPES as COMPILE_SCOPES
from cxrdr.train.losses.config import LossConfig, teacher_scales_from_info
from cxrdr.train.optim import OptimConfig

AMP_CHOICES = ("bf16", "fp16", "none")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
CUDA_GRAPHS_CHOICES = ("auto", "on", "off")
CHOICES = {"mode": ("reinforced", "plain"), "amp": AMP_CHOICES, "device": DEVICE_CHOICES,
           "pick": ("random", "sequential"), "on_corrupt": ("stop", "skip"), "compile_scope": COMPILE_SCOPES,
           "cuda_graphs": CUDA_GRAPHS_CHOICES, "cuda_graphs_text": CUDA_GRAPHS_CHOICES,
           "cuda_graphs_heads": CUDA_GRAPHS_CHOICES, "cuda_graphs_losses": CUDA_GRAPHS_CHOICES}
# Allowed values of numeric fields (cxrdr.common.yamlio.validate_fields checks types and these).
RANGES = {
    "steps": "[1, inf)", "batch_size": "[1, inf)", "eval_every": "[0, inf)", "eval_batch_size": "[1, inf)",
    "eval_max_samples": "[1, inf)", "recall_weight": "[0, 1]", "early_stop_patience": "[0, inf)",
    "accum_steps": "[1, inf)", "aug_limit": "[1, inf)", "clip_grad": "[0, inf)", "workers": "[0, inf)",
    "freeze_epochs": "[0, inf)", "shuffle_buffer": "[0, inf)", "log_every": "[1, inf)", "save_every": "[0, inf)",
    "eval_cache_mb": "[0, inf)", "shard_memory_mb": "[0, inf)", "balance_every": "[0, inf)",
    "frozen_memo_mb": "[0, inf)",
}
# Settings of the nested configs that `train run` takes as flags: path -> (flag, help). Old aliases
# of a flag follow it in the tuple.
PROMOTED_FLAGS = {
    "optim.lr": (("--lr",), "Peak learning rate."),
    "optim.weight_decay": (("--weight-decay",), "AdamW weight decay (default 0.1)."),
    "optim.llrd": (("--llrd",), "Layer-wise LR decay (1.0: off; default 0.85)."),
    "optim.warmup_steps": (("--warmup-steps",), "Linear LR warm-up steps before the cosine "
                                                "(default 5% of steps, at most 100)."),
    "optim.freeze_steps": (("--freeze-steps",), "Staged training: steps with frozen towers "
                                                "(heads at --frozen-head-lr-mult x LR)."),
    "optim.frozen_head_lr_mult": (("--frozen-head-lr-mult", "--head-lr-mult"),
                                  "Head LR factor while the towers are frozen (default 10)."),
    "loss.lambda_distill": (("--lambda-distill",), "MobileCLIP lambda: (1-l)*CLIP + l*distill."),
}
# Keys that used to sit at the top level of the training config: mapped, with a warning, here only.
MOVED_KEYS = {"lr": "optim.lr", "weight_decay": "optim.weight_decay", "llrd": "optim.llrd",
              "warmup_steps": "optim.warmup_steps", "freeze_steps": "optim.freeze_steps",
              "head_lr_mult": "optim.frozen_head_lr_mult", "lambda_distill": "loss.lambda_distill"}
NESTED = {"optim": OptimConfig, "loss": LossConfig}


def _opt(default: Any, help: str, **kwargs) -> Any:
    """A field with its `train run --help` text."""
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class TrainConfig:
    shards: str = _opt("shards", "Shard folder written by `reinforce build`.")
    model: str = _opt("tiny-D", "Student config: A..E, tiny-A..tiny-E, biomedclip-D, or a YAML path.")
    out: str = _opt("runs/run", "Run folder: config.yaml, metrics.jsonl, last.pt, best.pt, summary.json.")
    steps: int = _opt(1000, "Optimiser steps to train to (a resumed run continues to the same number).")
    batch_size: int = _opt(32, "Per-rank micro-batch size.")
    teachers: str | None = _opt(None, "Comma list: subset of the shards' teachers to distil from (default all).")
    mode: str = _opt("reinforced", "reinforced (stored views + embeddings) or plain (fresh augmentation, no teacher).")
    online_teacher: str | None = _opt(None, "Teacher spec run inside the loop on the same crops "
                                            "(replaces stored embeddings).")
    eval_every: int = _opt(0, "Validate every N steps (0: only at the end).")
    eval_split: str = _opt("val", "Split of the validation passes.")
    eval_shards: str | None = _opt(None, "Shard folder of the validation passes (default --shards), e.g. an "
                                         "evaluation set built apart with its own source seed.")
    eval_batch_size: int = _opt(64, "Batch size of the validation passes.")
    eval_max_samples: int | None = _opt(None, "Validate on at most this many samples (default all).")
    eval_cache_mb: int = _opt(2048, "Keep the validation batches in memory after the first pass, up to this many "
                                    "MB (0: read the shards at every pass).")
    eval_probe: bool = _opt(True, "Fit the quick linear probe at each validation pass (its AUC is the early-stop "
                                  "score's other half); off: retrieval alone ranks checkpoints.")
    recall_weight: float = _opt(0.5, "Early-stop score = w*mean Recall + (1-w)*mean AUC.")
    early_stop_patience: int = _opt(0, "Stop after N validations without improvement (0: off).")
    resume: bool = _opt(False, "Continue from RUN/last.pt (settings must match the run's, except steps, "
                               "eval/log/save intervals, workers, device).")
    overwrite: bool = _opt(False, "Replace the run already in --out (its last.pt, best.pt, metrics.jsonl).")
    amp: str = _opt("bf16", "bf16, fp16 or none (CUDA only).")
    accum_steps: int = _opt(1, "Micro-batches per optimiser step.")
    clip_grad: float = _opt(1.0, "Max gradient norm (0: off).")
    grad_checkpointing: bool = _opt(False, "Activation checkpointing in both towers.")
    compile: bool = _opt(False, "torch.compile the student (what: --compile-scope; cxrdr/train/compiling.py).")
    compile_backend: str = _opt("inductor", "torch.compile backend of --compile (e.g. inductor, aot_eager).")
    compile_scope: str = _opt("model", "What --compile compiles: model (the whole forward, one graph: the most "
                                       "fusion, minutes to compile; texts padded to the context length, eager while "
                                       "the k-ratio / keep-rate schedules change) or blocks (each tower block, one "
                                       "compiled block per tower shared by all: about a block's compile time).")
    cuda_graphs: str = _opt("auto", "Replay the ViT image tower's transformer blocks as CUDA graphs, forward and "
                                    "backward, once E's keep-rate warm-up is over: the host stops issuing their "
                                    "operators one by one (cxrdr/train/models/block_graphs.py; +22-47 % img/s for "
                                    "A, D and E on an H200). auto: where they apply (CUDA, one process, no "
                                    "--compile-scope model, --grad-checkpointing or --accum-steps > 1), around blocks "
                                    "compiled by --compile-scope blocks too (1.09-1.30x the graphs alone on an H200; "
                                    "compiled blocks without them ran 0.82-0.96x eager); on: asked for (refused "
                                    "where auto leaves them off, a warning off CUDA); off: eager.")
    cuda_graphs_text: str = _opt("auto", "Replay the packed text tower's layers as CUDA graphs too (BERT-family "
                                         "towers on FlashAttention): the packed tokens padded to a bucket, a graph per "
                                         "bucket (cxrdr/train/models/packed_text.py; on an H200 +11 % img/s for A, "
                                         "+7 % D, +37 % E over the blocks' graphs alone). auto: wherever the blocks' "
                                         "graphs run and the text runs packed, not with --compile-scope model (with "
                                         "--compile-scope blocks the text layers stay eager, graphed, the image "
                                         "blocks compiled); on: asked for (refused with --cuda-graphs off, "
                                         "--no-pack-text or --compile-scope model); off: eager.")
    cuda_graphs_heads: str = _opt("off", "Replay the heads that read the whole patch grid (the head convs and the "
                                         "Patch-IB mask, B-E) as one CUDA graph too, once the mask's Top-K anneal is "
                                         "over (cxrdr/train/models/heads.py: grid_heads; on the CPU their ~170 "
                                         "operators a step, forward and backward). Not yet timed on a GPU, so off by "
                                         "default; auto: wherever the blocks' graphs run; on: asked for (refused "
                                         "with --cuda-graphs off).")
    cuda_graphs_losses: str = _opt("off", "Replay the step's terms on its global embeddings (CLIP and distillation "
                                          "of B_real and B_syn, Patch-IB's) as one CUDA graph too: fixed shapes at a "
                                          "fixed batch (losses/objective.py: GlobalTerms; on the CPU 328 operators a "
                                          "step of A, ~440 of D and E, forward and backward). Not with a text queue, "
                                          "feature distillation, a hard-negative beta schedule or DDP (eager there). "
                                          "Not yet timed on a GPU, so off by default; auto: wherever the blocks' "
                                          "graphs run; on: asked for (refused with --cuda-graphs off).")
    pack_text: bool = _opt(True, "Run the text tower on the texts' real tokens only, skipping their padding "
                                 "(cxrdr/train/models/packed_text.py; BERT-family towers). --no-pack-text: padded.")
    workers: int | None = _opt(None, "DataLoader workers per rank (default: 2 on the CPU; on CUDA the host's cores but "
                                     "two, shared by its ranks, at most 16 a rank). A resumed run keeps its own.")
    seed: int = _opt(0, "Seed of model init, data order and view picks.")
    device: str = _opt("auto", "auto, cpu or cuda.")
    freeze_epochs: float = _opt(0.0, "--freeze-steps in epochs of the train split (used when that is 0).")
    pick: str = _opt("random", "random or sequential (stored view/caption = epoch % K).")
    aug_limit: int | None = _opt(None, "Use only the first k of the K stored augmentations (default all).")
    caption_sources: list | None = _opt(None, "Synthetic captions of these sources only (rdf, normal, report).")
    shuffle_buffer: int = _opt(256, "Samples in the streaming shuffle buffer.")
    shard_memory_mb: int = _opt(256, "Each loader process keeps the raw samples of the shards it read whole for "
                                     "later rounds, up to this many MB (a small split is not parsed again each "
                                     "epoch); 0: off. The batches are the same either way.")
    log_every: int = _opt(10, "Steps between metrics.jsonl records.")
    frozen_memo_mb: int = _opt(256, "On the CPU, a frozen stem (cpu-*, tiny-cnn-* students) remembers its output for "
                                    "each view it was fed, up to this many MB, and runs only on views not seen: a "
                                    "reinforced run replays K stored views per image (a plain run's views are fresh: "
                                    "no memo). Here the same numbers either way at batches of 16 or more "
                                    "(cxrdr/train/models/frozen_memo.py); 0: off.")
    balance_every: int = _opt(100, "Steps between measurements of each loss term's gradient norm on the shared "
                                   "trunk (grad_norm/* in metrics.jsonl; also at the first and the last step): one "
                                   "extra backward pass per term, and on CUDA an eager step; 0: never.")
    on_corrupt: str = _opt("stop", "A damaged shard or sample: stop (default, naming shard and key) or skip "
                                   "(counted in RUN/skipped.jsonl and summary.json).")
    save_every: int = _opt(100, "Steps between last.pt writes besides evaluations (0: only at evaluations "
                                "and the end).")
    save_at_eval: bool = _opt(True, "Write last.pt (and best.pt on a better score) at every validation pass; "
                                    "false: last.pt only every --save-every steps, at an early stop and at the "
                                    "end, and no best.pt (runs that validate often: a ViT-S student with its "
                                    "optimiser is ~0.5 GB a write).")
    progress: bool = _opt(True, "tqdm progress bar.")
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    model_overrides: dict = field(default_factory=dict)  # StudentConfig overrides
    verify_checksums: bool = _opt(True, "Check every training sample's members against the CRC-32s the build "
                                        "recorded before use (damage: as --on-corrupt says).")
    init_ckpt: str | None = _opt(None, "Start from this checkpoint's weights (a `train run` last.pt/best.pt, read "
                                       "weights_only): transfer, fine-tuning. The distillation heads stay fresh.")
    eval_prompts: str | None = _opt(None, "Zero-shot prompt YAML (configs/prompts.yaml layout): the validation passes "
                                          "also score the zero-shot mean AUC of its labels (zeroshot_mean_auc).")

    def __post_init__(self) -> None:
        for name in ("cuda_graphs", "cuda_graphs_text", "cuda_graphs_heads", "cuda_graphs_losses"):  # YAML: on / off
            if isinstance(getattr(self, name), bool):  # are booleans; config.yaml files before "auto" hold them
                setattr(self, name, "on" if getattr(self, name) else "off")
        for name, cls in NESTED.items():  # a mapping (YAML, keyword) becomes the typed config
            value = getattr(self, name)
            if isinstance(value, cls):
                continue
            if not isinstance(value, dict):
                raise ValueError(f"training config field '{name}': expected a mapping, got {value!r}")
            try:
                setattr(self, name, cls.from_dict(value))
            except ValueError as exc:
                raise ValueError(f"training config field '{name}': {exc}") from None
        validate_fields(self, "training config field", RANGES)
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: continue the run or replace it")
        if self.online_teacher and self.mode == "plain":
            raise ValueError("--online-teacher distils from a teacher: use it with --mode reinforced")
        if self.cuda_graphs_text == "on" and (self.cuda_graphs == "off" or not self.pack_text):
            raise ValueError("--cuda-graphs-text on replays the packed text tower with the image tower's graphs: it "
                             "needs --cuda-graphs auto or on, and --pack-text")
        if self.cuda_graphs_text == "on" and self.compiles_whole_model():
            raise ValueError("--cuda-graphs-text on does not go with --compile-scope model: the compiled model's text "
                             "layers attend on the padded grid, not on FlashAttention's packed tokens that the text "
                             "graphs replay (--compile-scope blocks leaves them eager for the graphs)")
        for flag, what in (("heads", "the heads"), ("losses", "the loss terms")):
            if getattr(self, f"cuda_graphs_{flag}") == "on" and self.cuda_graphs == "off":
                raise ValueError(f"--cuda-graphs-{flag} on replays {what} with the image tower's graphs: it needs "
                                 "--cuda-graphs auto or on")
        if self.cuda_graphs == "on":
            conflicts = self.cuda_graph_conflicts()
            if conflicts:
                raise ValueError(f"--cuda-graphs on does not go with {' or '.join(conflicts)} (a graph's gradients "
                                 "come back in its own buffers, and capture covers neither a model compiled whole nor "
                                 "recomputed blocks; auto leaves them off there)")

    def cuda_graph_conflicts(self) -> list[str]:
        """The settings CUDA graphs of the blocks cannot go with (``--cuda-graphs on`` refuses them, auto leaves the
        graphs off with them). Blocks compiled one by one (``--compile-scope blocks``) can be captured: a graph replays
        their compiled kernels, fused and without the host (the combination ``torch.compile``'s "reduce-overhead" mode
        makes); auto takes it (timed on an H200 at 7067ab4: docs/gpu.md, "Ninth GPU session")."""
        return [flag for flag, on in (("--compile with --compile-scope model (blocks can be graphed)",
                                       self.compiles_whole_model()),
                                      ("--grad-checkpointing", self.grad_checkpointing),
                                      ("--accum-steps > 1", self.accum_steps > 1)) if on]

    def compiles_whole_model(self) -> bool:
        """--compile with --compile-scope model: one compiled graph, which neither tower's CUDA graphs can capture."""
        return self.compile and self.compile_scope == "model"

    def text_graphs(self) -> bool:
        """Whether the text tower's layers join the image tower's CUDA graphs (``cuda_graphs_text``): asked for, or
        auto where they apply (the blocks' graphs not off, the text packed, not compiled as one model: with
        ``--compile-scope blocks`` the image blocks are compiled and the text layers stay eager for the graphs)."""
        if self.cuda_graphs_text == "auto":
            return self.cuda_graphs != "off" and self.pack_text and not self.compiles_whole_model()
        return self.cuda_graphs_text == "on"

    def heads_graphs(self) -> bool:
        """Whether the heads on the patch grid join the image tower's CUDA graphs (``cuda_graphs_heads``): asked for,
        or auto wherever the blocks' graphs are not off."""
        return self._joins_graphs(self.cuda_graphs_heads)

    def losses_graphs(self) -> bool:
        """Whether the loss terms on the global embeddings join the image tower's CUDA graphs
        (``cuda_graphs_losses``)."""
        return self._joins_graphs(self.cuda_graphs_losses)

    def _joins_graphs(self, setting: str) -> bool:
        return self.cuda_graphs != "off" if setting == "auto" else setting == "on"

    def to_dict(self) -> dict:
        """Plain nested dict (lists, no tuples): what RUN/config.yaml and checkpoints hold."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict, where: str = "", warn: bool = True) -> "TrainConfig":
        """From a nested mapping; keys of `MOVED_KEYS` (the old flat layout) are moved to their
        nested place with a warning (a moved key overrides the nested one; None means the default)."""
        data = {k: (dict(v) if k in NESTED and isinstance(v, dict) else v) for k, v in data.items()}
        for old, new in MOVED_KEYS.items():
            if old not in data:
                continue
            value = data.pop(old)
            if warn:
                print(f"warning: {where + ': ' if where else ''}training config key '{old}' is now "
                      f"'{new}'; the flat key will be refused in a later version", file=sys.stderr)
            if value is not None:
                group, name = new.split(".")
                data.setdefault(group, {})[name] = value
        check_known_fields(cls, data, "training config field", where=where)
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}" if where else str(exc)) from None

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "TrainConfig":
        """Defaults < YAML file (when given) < overrides whose value is not None. Overrides take
        field names or dotted paths into the nested configs (``optim.lr``)."""
        data: dict = {}
        if path is not None:
            path = find_config(path, "studies")  # a file, or a shipped overlay ('localisation/aligned')
            data = read_yaml_mapping(path, "training config fields")
            data = data.get("train", data)  # an experiment recipe may nest it under 'train'
        for key, value in overrides.items():
            if value is None:
                continue
            group, dot, name = key.partition(".")
            if dot:
                data.setdefault(group, {})[name] = value
            else:
                data[key] = value
        return cls.from_dict(data, where=str(path) if path is not None else "")

    def save_yaml(self, path: str | Path) -> None:
        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    def resolve(self, dataset_info: dict, steps_per_epoch: int,
                online_teacher_scales: dict[str, float] | None = None) -> tuple[OptimConfig, LossConfig]:
        """The run's OptimConfig and LossConfig with the defaults that depend on the run filled in:

        - optim.warmup_steps None: 5% of ``steps``, at least 1, at most 100;
        - optim.freeze_steps 0 and freeze_epochs > 0: ceil(freeze_epochs * steps_per_epoch);
        - loss.lambda_distill: 0 in plain mode (no teacher, CLIP only);
        - loss.teacher_scales: the logit scale each teacher recorded in the shards' dataset.json
          (or the online teacher's), under the scales given in the config.
        """
        optim = dataclasses.replace(self.optim)
        if optim.warmup_steps is None:
            optim.warmup_steps = min(100, max(1, self.steps // 20))
        if not optim.freeze_steps and self.freeze_epochs:
            optim.freeze_steps = int(math.ceil(self.freeze_epochs * steps_per_epoch))
        scales = (online_teacher_scales if online_teacher_scales is not None
                  else teacher_scales_from_info(dataset_info))
        loss = dataclasses.replace(self.loss, teacher_scales={**scales, **self.loss.teacher_scales})
        if self.mode == "plain":
            loss.lambda_distill = 0.0
        return optim, loss


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def cli_fields() -> list[tuple[str, tuple[str, ...], Any, str]]:
    """(config path, flag spellings, type, help) of every `train run` flag: the scalar top-level
    fields by name (bools as switches: --resume, or --no-progress for those on by default), then
    `PROMOTED_FLAGS`. Lists, mappings and nested configs are YAML-only."""
    out = []
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        base = _non_optional(hints[f.name])
        if base not in (str, int, float, bool):
            continue
        flag = f.name.replace("_", "-")
        if base is bool and f.default:
            flag = "no-" + flag
        out.append((f.name, ("--" + flag,), base, f.metadata.get("help", "")))
    for path, (flags, help_text) in PROMOTED_FLAGS.items():
        group, name = path.split(".")
        out.append((path, flags, _non_optional(typing.get_type_hints(NESTED[group])[name]), help_text))
    return out


def _non_optional(tp):
    """``int | None`` -> ``int``; other types unchanged."""
    return next((a for a in typing.get_args(tp) if a is not type(None)), tp)
