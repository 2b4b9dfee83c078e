"""Image-text teachers for the phantom experiments, trained once and cached (recipe key ``teachers``).

MobileCLIP distils from an image-text ensemble; on phantom data no pretrained CXR CLIP exists, so the
experiment makes its own: each teacher is a ``train run --mode plain`` CLIP model (e.g. EfficientNet-Lite2
+ MiniLM, configs/models/teacher-lite2-A.yaml) trained on its *own* phantom set drawn with another source
seed (the students never see its training images; on real data, its own build of the students' train split:
``train_images_shared`` in its record says which), evaluated on its own test split and on the students'
test split, copied to ``<dir>/<name>.pt`` and added to the students' shards with
``reinforce add-teacher ckpt:<dir>/<name>.pt`` (shard teacher name ``ckpt-<name>``).

Recipe::

    teachers:
      dir: runs/experiments/cpu-demo/teachers
      build: {...}          # reinforce BuildOptions of every teacher's own shards (source seed per teacher)
      train: {...}          # TrainConfig fields of every teacher run (mode is forced to plain)
      models:               # name -> {source_seed, train overrides}
        lite2-s1: {source_seed: 1}
      evaluate: [own, students, report]   # which test sets judge it (default: own, students)

Everything is reused when present: a finished run, the copied checkpoint, a teacher already in the shards
(change a teacher: delete its folder and rebuild the students' shards). add-teacher runs on the recipe's
``device`` (cpu when unset).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import typer

from cxrdr.common.atomic import copy_atomic
from cxrdr.common.checksums import recorded_checksums
from cxrdr.common.shards.info import read_dataset_info
from cxrdr.common.shards.members import DATASET_JSON, IMAGE_EXTS
from cxrdr.experiments.chunks import begin
from cxrdr.experiments.recipe import make_train_config
from cxrdr.experiments.runs import claim_run, ensure_shards, evaluation_device, report_set, run_training
from cxrdr.reinforce.add_teacher import add_teachers, addition_summary
from cxrdr.teachers.base import file_safe_name
from cxrdr.train.config import TrainConfig
from cxrdr.train.evaluation.runner import evaluate

TEACHER_KEYS = {"dir", "build", "train", "models", "add_teacher_batch_size", "evaluate"}
# the test sets a teacher can be judged on: its own shards' test split, the students' test split, the
# recipe's report set (an evaluation phantom no choice reads)
TEACHER_EVALS = ("own", "students", "report")
DEFAULT_TEACHER_EVALS = ("own", "students")
QUALITY_KEYS = {"own": "own_test", "students": "student_test", "report": "report"}  # keys of a teacher's record


def teacher_shard_name(name: str) -> str:
    """The name ``ckpt:<dir>/<name>.pt`` gets inside the shards (cxrdr/teachers/ckpt.py)."""
    return "ckpt-" + file_safe_name(name)


def teacher_plans(recipe: dict, experiment: str | None = None) -> dict:
    """name -> what preparing that teacher means (no side effects): its build spec, TrainConfig,
    checkpoint path and shard name. A teacher whose entry lists ``experiments`` is planned only for those
    (e.g. the ensemble's second teacher)."""
    spec = recipe.get("teachers") or {}
    if not spec:
        return {}
    unknown = sorted(set(spec) - TEACHER_KEYS)
    if unknown:
        raise ValueError(f"teachers: unknown key(s) {unknown}; known: {sorted(TEACHER_KEYS)}")
    # an empty list evaluates nothing (a probe: the teacher's figures are its recipe's); only a missing key
    # means the defaults
    evals = list(DEFAULT_TEACHER_EVALS if spec.get("evaluate") is None else spec["evaluate"])
    if set(evals) - set(TEACHER_EVALS):
        raise ValueError(f"teachers.evaluate: {evals}; known: {list(TEACHER_EVALS)}")
    root = Path(spec["dir"])
    plans = {}
    for name, model in (spec.get("models") or {}).items():
        model = dict(model or {})
        wanted = model.pop("experiments", None)
        if wanted is not None and experiment not in wanted:
            continue
        build = dict(spec.get("build") or {})
        build["source_options"] = {**(build.get("source_options") or {}), "seed": int(model.pop("source_seed", 1))}
        shards = root / name / "shards"
        plans[name] = {"shards": {"dir": str(shards), "build": build}, "ckpt": root / f"{name}.pt",
                       "cfg": _teacher_config(recipe, spec, model, shards, root / name / "run"),
                       "shard_name": teacher_shard_name(name), "evaluate": evals}
    return plans


def planned_train_samples(recipe: dict, experiment: str | None = None, shard_names: list[str] | None = None) -> int:
    """Samples the recipe's teachers (those stored as ``shard_names``, default all) are trained on: steps x
    batch x accumulation of each teacher's config, known before any is trained."""
    return sum(p["cfg"].steps * p["cfg"].batch_size * p["cfg"].accum_steps
               for p in teacher_plans(recipe, experiment).values()
               if shard_names is None or p["shard_name"] in shard_names)


def students_and_teachers(recipe: dict, progress: bool = True, experiment: str | None = None) -> tuple[Path, dict]:
    """The students' shard folder (``recipe['shards']``) and the teachers added to it (``prepare_teachers``).

    Two copies of an experiment (scripts/gpu-experiment.sh COPIES=2) split this set-up: while one builds the
    students' shards, the other makes the teachers' own part (their shards, training and evaluation), then waits
    for the students' shards to add them. Before, the second copy waited through the whole set-up (141 s of a
    15-minute GPU lease, of which the teacher's own part was ~54 s). The folder is made (or waited for) once: a
    recipe's ``shards.rebuild`` rebuilds it once, not again at each need."""
    built = ensure_shards(recipe["shards"], progress, wait=False)  # None: another copy is building them
    students = functools.cache(lambda: built or ensure_shards(recipe["shards"], progress))
    teachers = prepare_teachers(recipe, students, progress, experiment)
    return students(), teachers


def prepare_teachers(recipe: dict, student_shards: Callable[[], Path], progress: bool = True,
                     experiment: str | None = None) -> dict:
    """Train (or reuse) every teacher of ``recipe['teachers']`` and add it to the students' shards
    (``student_shards()``, their folder, asked for only once a teacher needs it: a caller whose folder another
    process is building makes the teachers' own part meanwhile); a teacher whose entry lists ``experiments`` is made
    only for those (e.g. the ensemble's second teacher).

    Returns name -> record (shard name, checkpoint, train summary, quality on its test sets,
    add-teacher seconds)."""
    plans = teacher_plans(recipe, experiment)
    if not (recipe.get("teachers") or {}):
        return {}
    root = Path(recipe["teachers"]["dir"])
    # one process prepares the teachers; a second copy of the experiment waits, then reuses them (else
    # it would train the same teacher alongside, or find the shards locked by the first one's add-teacher)
    lock = claim_run(root, wait=False)
    if lock is None:
        typer.echo(f"[teachers] another process is preparing the teachers in {root}; waiting", err=True)
        lock = claim_run(root)
    try:
        return {name: _prepare_one(recipe, name, plan, student_shards, progress) for name, plan in plans.items()}
    finally:
        lock.release()


def _prepare_one(recipe: dict, name: str, plan: dict, students: Callable[[], Path], progress: bool) -> dict:
    spec = recipe["teachers"]
    build = plan["shards"]["build"]
    shards = ensure_shards(plan["shards"], progress)
    cfg = plan["cfg"]
    typer.echo(f"[teachers] {name}: {cfg.model}, {cfg.steps} steps on its own shards "
               f"(source seed {build['source_options']['seed']})", err=True)
    summary = run_training(cfg, recipe.get("reuse_runs", True), resume=recipe.get("resume_runs", False))
    ckpt = plan["ckpt"]
    last = Path(cfg.out) / "last.pt"
    if not ckpt.is_file() or ckpt.stat().st_mtime < last.stat().st_mtime:
        _refuse_stale(Path(recipe["shards"]["dir"]), name)
        # through a temporary name: a command killed while copying must not leave a truncated checkpoint
        # newer than last.pt, which the next command would take for the finished copy
        copy_atomic(last, ckpt)
    sets = {"own": lambda: (shards, "test"), "students": lambda: (students(), "test"),
            "report": lambda: report_set(recipe, progress)}
    quality = {QUALITY_KEYS[tag]: _quality(recipe, Path(cfg.out), *sets[tag](), tag) for tag in plan["evaluate"]}
    seconds = add_teacher_once(students(), name, ckpt, int(spec.get("add_teacher_batch_size", 64)),
                               progress, device=recipe.get("device") or "cpu")
    return {"shard_name": plan["shard_name"], "checkpoint": str(ckpt), "model": cfg.model,
            "source_seed": build["source_options"]["seed"], "steps": cfg.steps,
            "train_samples": summary.get("samples_seen") or cfg.steps * cfg.batch_size * cfg.accum_steps,
            "train_wall_s": summary.get("wall_s"), "train_time_s": summary.get("train_time_s"),
            "train_step_ms": summary.get("mean_step_ms"),
            "add_teacher_seconds": seconds, "train_images_shared": shared_train_images(shards, students()),
            "code": summary.get("code"),  # the code that trained it (None: trained before it was recorded)
            **quality}


def teacher_eval_dir(run_dir: Path, tag: str) -> Path:
    """Where ``_quality`` writes the teacher's evaluation on one test set."""
    return run_dir / f"eval-{tag}-test"


def shared_train_images(teacher_shards: Path, student_shards: Path) -> float | None:
    """Fraction of the teacher's train-split images that are also the students' train images: 0 for a
    phantom teacher drawn with its own source seed, 1 for a real-data teacher trained on the students' own
    train split. The accounting says which, instead of assuming one. An image is the same when its key and
    its stored bytes are (the CRC-32 the build recorded: phantom draws of another seed reuse keys);
    None when the two builds stored images differently (nothing to compare) or recorded no checksums."""
    if not all((f / DATASET_JSON).is_file() for f in (teacher_shards, student_shards)):
        return None
    infos = [read_dataset_info(f) for f in (teacher_shards, student_shards)]
    if len({(i.get("store_size"), i.get("image_format"), i.get("jpeg_quality")) for i in infos}) != 1:
        return None
    own, students = (_train_images(f, i) for f, i in zip((teacher_shards, student_shards), infos))
    return len(own & students) / len(own) if own else None


def _train_images(folder: Path, info: dict) -> set[tuple[str, str]]:
    """(key, CRC-32 of the stored image) of every train-split sample, from the build's recorded checksums."""
    out = set()
    for shard in info.get("shards") or []:
        if shard.get("split") != "train":
            continue
        recorded = recorded_checksums(folder / shard["name"]) or {}
        for key, members in (recorded.get("samples") or {}).items():
            image = next((crc for member, crc in members.items() if member in IMAGE_EXTS), None)
            if image is not None:
                out.add((key, image))
    return out


def _teacher_config(recipe: dict, spec: dict, model: dict, shards: Path, out: Path) -> TrainConfig:
    data = {**(spec.get("train") or {}), **model, "shards": str(shards), "out": str(out), "mode": "plain"}
    data.setdefault("progress", False)  # not part of what is trained: --quiet or not, the cached teacher is reused
    return make_train_config(recipe, data)


def _quality(recipe: dict, run_dir: Path, shards: Path, split: str, tag: str) -> dict:
    """Retrieval/AUC/pointing-game summary of the teacher on one test set (no cost measurement)."""
    opts = {k: v for k, v in (recipe.get("eval") or {}).items()
            if k not in ("split", "efficiency", "efficiency_batch", "benchmark")}
    out_dir = teacher_eval_dir(run_dir, tag)
    done = out_dir / "eval.json"
    if teacher_eval_done(run_dir, tag):
        return json.loads(done.read_text())["summary"]
    begin(f"evaluate teacher {run_dir} on {tag}")
    results = evaluate(str(run_dir / "last.pt"), shards, split, out_dir, progress=False, quiet=True,
                       efficiency=False, device=evaluation_device(recipe, opts), **opts)
    return results["summary"]


def teacher_eval_done(run_dir: Path, tag: str) -> bool:
    done = teacher_eval_dir(run_dir, tag) / "eval.json"
    if not (done.is_file() and done.stat().st_mtime >= (run_dir / "last.pt").stat().st_mtime):
        return False
    try:  # a command killed while writing it leaves a file that does not parse: evaluate again
        json.loads(done.read_text())
    except json.JSONDecodeError:
        return False
    return True


def _refuse_stale(student_shards: Path, name: str) -> None:
    """A (re)trained teacher whose older embeddings are already in the shards would silently disagree
    with its checkpoint (online arm, evaluation): refuse, the shards must be rebuilt. Shards not built yet
    (another copy of the experiment is building them) hold no teacher."""
    if not (Path(student_shards) / "dataset.json").is_file():
        return
    info = json.loads((Path(student_shards) / "dataset.json").read_text())
    if teacher_shard_name(name) in {t["name"] for t in info.get("teachers", [])}:
        raise ValueError(f"teacher {name} was retrained but {student_shards} holds embeddings of its earlier "
                         f"checkpoint; rebuild the students' shards (shards.rebuild: true)")


def add_teacher_once(student_shards: Path, name: str, ckpt: Path, batch_size: int, progress: bool,
                     device: str = "cpu") -> float | None:
    """``reinforce add-teacher ckpt:CKPT`` unless the shards already hold it (an interrupted addition
    resumes: shards that hold it are skipped); the one-off seconds it took (from dataset.json's
    teacher_additions, also for an earlier addition), None if unrecorded."""
    info = json.loads((Path(student_shards) / "dataset.json").read_text())
    shard_name = teacher_shard_name(name)
    if shard_name not in {t["name"] for t in info.get("teachers", [])}:
        begin(f"add-teacher {name} to {student_shards}")
        typer.echo(f"[teachers] add-teacher ckpt:{ckpt} -> {student_shards}", err=True)
        info = add_teachers(Path(student_shards), f"ckpt:{ckpt}", device=device, batch_size=batch_size,
                            progress=progress)
        typer.echo(f"[teachers] add-teacher {name}: {addition_summary(info['teacher_additions'][-1])}", err=True)
    return teacher_seconds(info, [shard_name])


def teacher_seconds(info: dict, names: list[str]) -> float | None:
    """One-off seconds spent embedding with ``names`` (dataset.json's teacher_additions; the build's own
    teacher time is shared by all its teachers and counted once by the caller)."""
    total, found = 0.0, False
    for addition in info.get("teacher_additions") or []:
        if set(addition.get("teachers", [])) & set(names):
            total += float(addition.get("seconds") or 0.0)
            found = True
    return total if found else None
