"""TrainConfig: every knob of `train run`, from defaults < a YAML file < command-line flags.

The YAML may hold any subset of the fields below (unknown keys are an error naming the file);
``loss``, ``optim`` and ``model_overrides`` are passed through to the losses helper's
LossConfig, the optimiser config and StudentConfig respectively. The resolved config is
written to ``RUN/config.yaml`` and stored in every checkpoint.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AMP_CHOICES = ("bf16", "fp16", "none")
# Allowed values of numeric fields (reinforce.yamlio.validate_fields checks types and these).
RANGES = {
    "steps": "[1, inf)", "batch_size": "[1, inf)", "lr": "(0, inf)", "weight_decay": "[0, inf)",
    "lambda_distill": "[0, 1]", "eval_every": "[0, inf)", "eval_batch_size": "[1, inf)",
    "eval_max_samples": "[1, inf)", "recall_weight": "[0, 1]", "early_stop_patience": "[0, inf)",
    "accum_steps": "[1, inf)", "aug_limit": "[1, inf)", "clip_grad": "[0, inf)", "workers": "[0, inf)", "freeze_steps": "[0, inf)",
    "freeze_epochs": "[0, inf)", "head_lr_mult": "(0, inf)", "warmup_steps": "[0, inf)", "llrd": "(0, 1]",
    "shuffle_buffer": "[0, inf)", "log_every": "[1, inf)", "save_every": "[0, inf)",
}
DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    shards: str = "shards"
    model: str = "tiny-D"  # StudentConfig name ('D', 'tiny-D') or YAML path
    out: str = "runs/run"
    steps: int = 1000  # optimiser steps (each = accum_steps micro-batches)
    batch_size: int = 32  # per rank, per micro-batch
    lr: float = 5e-4
    weight_decay: float | None = None  # None: optim helper's default (0.1)
    lambda_distill: float = 0.7  # MobileCLIP's lambda; forced to 0 in plain mode
    teachers: str | None = None  # comma-separated subset of the shards' teachers (None: all)
    mode: str = "reinforced"  # reinforced | plain
    online_teacher: str | None = None  # teacher spec run inside the loop (replaces stored embeddings)
    eval_every: int = 0  # steps between validation passes (0: only at the end)
    eval_split: str = "val"
    eval_batch_size: int = 64
    eval_max_samples: int | None = None
    recall_weight: float = 0.5  # early-stop score = w*mean Recall + (1-w)*mean AUC
    early_stop_patience: int = 0  # evaluations without improvement before stopping (0: off)
    resume: bool = False
    overwrite: bool = False  # replace the run already in `out` (refused otherwise, unless resume)
    amp: str = "bf16"  # used on CUDA only
    accum_steps: int = 1
    clip_grad: float = 1.0  # max grad norm (0: off)
    grad_checkpointing: bool = False
    workers: int = 2
    seed: int = 0
    device: str = "auto"
    freeze_steps: int = 0  # staged training: towers frozen, heads at head_lr_mult x lr
    freeze_epochs: float = 0.0  # the same in epochs of the train split (converted to steps)
    head_lr_mult: float = 10.0
    warmup_steps: int | None = None  # linear LR warm-up (None: 5% of steps, at most 100)
    llrd: float | None = None  # layer-wise LR decay (None: optim default 0.85; 1.0: off)
    pick: str = "random"  # random | sequential (stored aug/caption = epoch % K)
    aug_limit: int | None = None  # use only the first k of the K stored augmentations (None: all)
    caption_sources: list | None = None  # synthetic captions of these sources only (rdf, normal, report)
    shuffle_buffer: int = 256
    log_every: int = 10
    on_corrupt: str = "stop"  # a damaged shard/sample: stop naming it, or skip and count it
    save_every: int = 100  # steps between last.pt writes besides evaluations (0: only those and the end)
    progress: bool = True
    loss: dict = field(default_factory=dict)  # LossConfig overrides
    optim: dict = field(default_factory=dict)  # OptimConfig overrides
    model_overrides: dict = field(default_factory=dict)  # StudentConfig overrides

    def __post_init__(self) -> None:
        from cxrdr.common.yamlio import validate_fields

        validate_fields(self, "training config field", RANGES)
        if self.mode not in ("reinforced", "plain"):
            raise ValueError(f"mode must be 'reinforced' or 'plain', got {self.mode!r}")
        if self.amp not in AMP_CHOICES:
            raise ValueError(f"amp must be one of {AMP_CHOICES}, got {self.amp!r}")
        if self.device not in DEVICE_CHOICES:
            raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {self.device!r}")
        if self.pick not in ("random", "sequential"):
            raise ValueError(f"pick must be 'random' or 'sequential', got {self.pick!r}")
        for name in ("steps", "batch_size", "accum_steps", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.lambda_distill <= 1.0:
            raise ValueError(f"lambda_distill must be in [0, 1], got {self.lambda_distill}")
        if self.on_corrupt not in ("stop", "skip"):
            raise ValueError(f"on_corrupt must be 'stop' or 'skip', got {self.on_corrupt!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: continue the run or replace it")
        if self.online_teacher and self.mode == "plain":
            raise ValueError("--online-teacher distils from a teacher: use it with --mode reinforced")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "TrainConfig":
        """Defaults < YAML file (when given) < overrides whose value is not None."""
        data: dict = {}
        if path is not None:
            from cxrdr.common.yamlio import read_yaml_mapping

            data = read_yaml_mapping(path, "training config fields")
            data = data.get("train", data)  # an experiment recipe may nest it under 'train'
        from cxrdr.common.yamlio import check_known_fields

        check_known_fields(cls, data, "training config field", where=str(path))
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}" if path is not None else str(exc)) from None

    def save_yaml(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
