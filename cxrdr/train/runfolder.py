"""The run folder of `train run`: who may write it (lock, --resume/--overwrite), which settings a
resumed run may change, and RUN/metrics.jsonl."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from cxrdr.common.atomic import write_text_atomic
from cxrdr.common.locking import lock_folder, remove_stale_temp_files
from cxrdr.common.shards import dataset_identity, read_dataset_info
from cxrdr.train.config import TrainConfig

# Settings a resumed run may change: they decide how long, where and how visibly it runs, not
# what one training step computes (everything else must equal the checkpoint's train_config).
# grad_checkpointing trades memory for recomputation (the same forward, run again with the RNG
# state restored): `train run` names it when a batch did not fit, for a --resume.
RESUME_OVERRIDABLE = frozenset({"steps", "eval_every", "eval_batch_size", "eval_max_samples",
                                "early_stop_patience", "workers", "device", "progress", "log_every", "balance_every",
                                "save_every", "resume", "overwrite", "out", "on_corrupt", "verify_checksums",
                                "grad_checkpointing", "compile", "compile_backend", "compile_scope", "eval_cache_mb",
                                "save_at_eval", "pack_text", "eval_probe", "shard_memory_mb", "frozen_memo_mb"})
# Compared by what they name, not as typed (see data_conflicts).
COMPARED_APART = frozenset({"shards"})
RUN_OUTPUTS = ("last.pt", "best.pt", "metrics.jsonl", "summary.json", "config.yaml", "skipped.jsonl")


def _flat(d: dict, prefix: str = "") -> dict:
    """{'optim': {'lr': 1}} -> {'optim.lr': 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in ("optim", "loss"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """'name saved -> current' for every setting that differs and may not change on resume. The
    saved config is read like a YAML file (a checkpoint of the old flat layout compares alike; a
    field the checkpoint predates is compared with its current default)."""
    try:
        saved = TrainConfig.from_dict(saved, warn=False).to_dict()
    except (TypeError, ValueError):  # fields that no longer exist: compare what is there
        saved = {**TrainConfig().to_dict(), **saved}
    saved, current = _flat(saved), _flat(current)
    return [f"{name} {saved.get(name)!r} -> {current[name]!r}"
            for name in sorted(set(current) - RESUME_OVERRIDABLE - COMPARED_APART)
            if saved.get(name) != current[name]]


def data_source(shards: str | os.PathLike) -> dict:
    """What a checkpoint records of its shard folder: the resolved path and the content identity."""
    return {"shards": str(Path(shards).resolve()), "identity": dataset_identity(read_dataset_info(shards))}


def data_conflicts(saved: dict | None, saved_shards: str, shards: str | os.PathLike) -> list[str]:
    """'shards ...' when ``shards`` holds other data than the checkpoint's folder: by content identity
    (dataset.json without build timings; a moved, copied or otherwise spelled folder is the same data),
    or for a checkpoint that predates it, by resolved path."""
    now = data_source(shards)
    if saved and saved.get("identity"):
        if saved["identity"] == now["identity"]:
            return []
        return [f"shards {saved.get('shards')} (content {saved['identity']}) -> {now['shards']} "
                f"(content {now['identity']})"]
    if Path(saved_shards).resolve() == Path(now["shards"]):
        return []
    return [f"shards {saved_shards!r} -> {str(shards)!r}"]


def check_run_folder(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to replace another run's outputs unless --overwrite (then delete them first)."""
    existing = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if not existing or resume:
        return
    if not overwrite:
        raise ValueError(f"--out {out} already holds a run ({', '.join(existing)}); pass --resume to "
                         f"continue it, --overwrite to replace it, or choose another --out")
    for name in sorted(existing, key=lambda name: name != "summary.json"):  # the "done" mark first: killed
        (out / name).unlink()  # midway, what is left is an unfinished run, never a finished one without last.pt


def lock_run_folder(cfg: TrainConfig):
    """Rank 0 holds an exclusive lock on the run folder while it trains (None on other ranks)."""
    if int(os.environ.get("RANK", 0)) != 0:
        return None
    lock = lock_folder(cfg.out, "train run")
    remove_stale_temp_files(cfg.out)  # checkpoint temp files of a killed run
    return lock


def json_default(obj):
    """json.dumps fallback: tensors/numpy scalars as numbers, NaN as null, anything else as text."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


class MetricsLog:
    """RUN/metrics.jsonl, one JSON object per line (rank 0 only); on resume, lines after the
    resumed step are dropped so the file reads as one consistent run, and so is a last line that a
    process killed while writing it left unfinished. ``redo_final_eval``: the run resumes at its last step, whose
    evaluation it makes again (a run killed after its last save, before its summary), so that step's evaluation
    records go too."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None = None, redo_final_eval: bool = False):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if resume_step is not None and path.is_file():
            records = [(line, json.loads(line)) for line in complete_lines(path.read_text())]
            kept = [line for line, record in records if record.get("step", 0) <= resume_step
                    and not (redo_final_eval and record.get("kind") == "eval" and record.get("step") == resume_step)]
            write_text_atomic(path, "".join(line + "\n" for line in kept))  # killed here: the run's log stays
        elif path.exists():
            path.unlink()

    def write(self, record: dict) -> None:
        """Append one record in a single write: a buffered file writes a record over 8 KiB (a step's every
        loss term and gradient norm) in pieces, which a reader, or a kill between them, catches half done."""
        if self.enabled:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps(record, default=json_default) + "\n").encode())
            finally:
                os.close(fd)


def numbered_complete_lines(text: str) -> list[tuple[int, str]]:
    """(line number from 1, line) of the non-blank lines of a JSON-lines file's ``text`` that its writer finished
    (newline-terminated): the numbers a reader names a damaged line by."""
    return [(number, line) for number, line in enumerate(text.split("\n")[:-1], 1) if line.strip()]


def complete_lines(text: str) -> list[str]:
    """The non-blank lines of a JSON-lines file's ``text`` that its writer finished (newline-terminated)."""
    return [line for _, line in numbered_complete_lines(text)]
