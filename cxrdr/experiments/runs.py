"""The units of work of every study, each reused when already done: shards, training runs, evaluations.

Finished runs (RUN/summary.json + RUN/last.pt with the same config) and evaluations (same request on the
same checkpoint) are reused, so an interrupted experiment continues where it stopped; an unfinished run
continues from its last.pt when the caller asks (``run_training(resume=True)``, recipe key ``resume_runs``),
else it restarts. A run carried from an earlier GPU lease (``carry.py``: its text files and ``carried.json``, no
checkpoint) counts as finished when its config is the same, and its evaluation is reused as it is. Where a
unit's real work starts, ``chunks.begin`` may stop a chunked command (cxrdr/experiments/chunks.py). A run folder is
claimed (its folder lock) for its training and evaluation, so two copies of an experiment never work on
one run: the other copy waits for it, or does another run first (``claim_run(wait=False)``).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
import typer

from cxrdr.common.atomic import write_json_atomic
from cxrdr.common.augment import AugConfig
from cxrdr.common.errors import UserError
from cxrdr.common.locking import FOLDER_LOCK, FolderBusyError, FolderLock, lock_folder
from cxrdr.common.yamlio import safe_load, yaml_round_trip
from cxrdr.experiments.carry import carried_from, is_carried
from cxrdr.experiments.chunks import begin, expected_training_s, measured_evaluation, measured_training
from cxrdr.experiments.repro import code_version, note_other_code
from cxrdr.reinforce.build import BuildOptions, build
from cxrdr.reinforce.summary import throughput_text
from cxrdr.train.config import TrainConfig
from cxrdr.train.device import loader_workers
from cxrdr.train.evaluation.efficiency import measure_in_subprocess
from cxrdr.train.evaluation.benchmark import run_benchmark
from cxrdr.train.evaluation.report import jsonable, write_json
from cxrdr.train.evaluation.runner import evaluate, summary_row
from cxrdr.train.loop import train
from cxrdr.train.runfolder import complete_lines

T = TypeVar("T")
CURVE_METRICS = ("mean_recall", "i2t_R@1", "t2i_R@1", "probe_mean_auc", "zeroshot_mean_auc")


def ensure_shards(spec: dict, progress: bool = True, wait: bool = True) -> Path | None:
    """The recipe's shard folder: reused when complete, else built (or resumed) with its options. While another
    process builds it: wait for that build (``wait``), or return None so the caller can do other work first."""
    out = Path(spec["dir"])
    if (out / "dataset.json").is_file() and not spec.get("rebuild", False):
        return out
    # Two copies of one experiment reach a missing folder together (e.g. a run's own shards): one builds,
    # the other waits for it and reuses the folder (the build itself refuses a second writer).
    building = out.parent / f".{out.name}.building"
    lock = claim_run(building, wait=False)
    waited = lock is None
    if waited:
        if not wait:
            return None
        typer.echo(f"another process is building {out}; waiting", err=True)
        lock = claim_run(building)
    try:
        if waited and (out / "dataset.json").is_file():
            return out  # the other process built it (a rebuild it did counts)
        begin(f"build {out}")
        return _build_shards(out, spec, progress)
    finally:
        lock.release()


def _build_shards(out: Path, spec: dict, progress: bool) -> Path:
    options = dict(spec.get("build") or {})
    if not options:
        raise ValueError(f"shards {out} do not exist and the recipe gives no 'shards.build' options")
    if isinstance(options.get("aug"), dict):
        options["aug"] = AugConfig.from_json(options["aug"])
    known = set(BuildOptions.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"shards.build: unknown build option(s) {unknown}; known: {sorted(known)}")
    resume = (out / "stats").is_dir()
    if spec.get("rebuild") and out.exists():
        shutil.rmtree(out)
        resume = False
    typer.echo(f"building shards in {out} ({options.get('source', 'phantom')}, "
               f"teachers {options.get('teachers', 'random:tiny')})", err=True)
    info = build(BuildOptions(out=out, resume=resume, progress=progress, **options))
    # its throughput and time split in the command's log (a GPU lease's log comes back where its files may not)
    typer.echo(f"[shards] {out}: {throughput_text(info)}", err=True)
    return out


# How often a waiting copy tries a held lock again: a non-blocking flock costs microseconds, and a copy that waits
# for another's build or run should start within a second of its end.
CLAIM_POLL_S = 0.5


def claim_run(run_dir: Path, wait: bool = True, poll_s: float = CLAIM_POLL_S) -> FolderLock | None:
    """The run folder's lock, for training and evaluating it. While another process holds it: wait for it
    (``wait``) or return None, so the caller can do other runs first."""
    while True:
        try:
            return lock_folder(run_dir, "train experiment")
        except FolderBusyError:
            if not wait:
                return None
            time.sleep(poll_s)


def claim_results(out_dir: Path, poll_s: float = CLAIM_POLL_S) -> tuple[FolderLock | None, dict | None]:
    """The experiment's last stage (its step benchmark, results.json, tables, plots) for this copy: (its lock,
    None). Two copies of one experiment split the runs (``claimed_in_turn``), and both reach this stage; timing
    the steps together, each would measure the other's load. So one does it, and the other waits and returns
    its results.json: (None, results). A copy that finds no results written while it waited (the other failed)
    takes the stage itself."""
    claim = out_dir / ".results.claim"
    lock = claim_run(claim, wait=False)
    if lock is not None:
        return lock, None
    typer.echo(f"another process is timing the step benchmark and writing {out_dir}/results.json; waiting", err=True)
    waited_from = time.time()
    lock = claim_run(claim, poll_s=poll_s)
    results = out_dir / "results.json"
    if results.is_file() and results.stat().st_mtime >= waited_from:
        lock.release()
        return None, json.loads(results.read_text())
    return lock, None


def claimed_in_turn(run_dirs: Sequence[Path], work: Callable[[Path, FolderLock], T],
                    on_busy: Callable[[Path], None] | None = None) -> dict[Path, T]:
    """``work(run_dir, lock)`` for every run folder, each while holding its lock: first the folders no other
    copy of the experiment holds, then, waiting, the rest (by then usually finished there: reused). So two
    copies of one experiment split its runs instead of training them twice or queueing on the same one."""
    done: dict[Path, T] = {}
    for wait in (False, True):
        for run_dir in run_dirs:
            if run_dir in done:
                continue
            lock = claim_run(run_dir, wait=wait)
            if lock is None:
                if on_busy is not None:
                    on_busy(run_dir)
                continue
            try:
                done[run_dir] = work(run_dir, lock)
            finally:
                lock.release()
    return done


def _clear_run_folder(run_dir: Path) -> None:
    """Everything in RUN but its lock file, which the caller holds (deleting it would let a second
    process lock a new file of the same name and write into the same folder)."""
    for entry in run_dir.iterdir():
        if entry.name == FOLDER_LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def run_training(cfg: TrainConfig, reuse: bool = True, lock: FolderLock | None = None,
                 resume: bool = False) -> dict:
    """Train (or reuse a finished identical run); returns the loop summary plus wall seconds. ``lock``:
    the run folder's lock if the caller holds it (``claim_run``); else it is claimed here, waiting.
    ``resume``: an unfinished run of this config continues from its last.pt (the loop's exact resume:
    the same run as one never interrupted; its ``wall_s`` then adds the earlier commands' wall up to the save
    it resumed from, their work lost after it left out) instead of restarting."""
    run_dir = Path(cfg.out)
    own = claim_run(run_dir) if lock is None else None
    try:
        summary_path = run_dir / "summary.json"
        if reuse and _finished_alike(run_dir, cfg):
            summary = json.loads(summary_path.read_text())
            summary.setdefault("wall_s", None)
            summary["reused"] = True
            # reused whatever code trained it: a run of another code version has other numbers (repro.py)
            note_other_code(f"run {run_dir}", summary.get("code"))
            return summary
        go_on = resume and reuse and unfinished_alike(run_dir, cfg)
        from_step = logged_step(metrics_records(run_dir)) if go_on else 0
        begin(f"{'resume' if go_on else 'train'} {run_dir}",
              expected_s=expected_training_s(cfg.steps - from_step, step_kind(cfg)))
        if not go_on:
            _clear_run_folder(run_dir)  # a different or unfinished run: start it afresh
        code = code_version()  # asked before training: a commit made meanwhile is not the code that trains
        started = time.perf_counter()
        summary = train(dataclasses.replace(cfg, resume=True) if go_on else cfg, lock=own or lock)
        this_command = time.perf_counter() - started
        summary["wall_s"] = round(summary.get("earlier_wall_s", 0.0) + this_command, 2)
        measured_training(this_command, summary["steps"] - summary.get("start_step", 0), step_kind(cfg))
        summary["code"] = code  # which code trained it: reuse does not check it, results show it
        # CPU intra-op threads change reductions' rounding (recipe `threads`; reuse does not check it either)
        summary["torch_threads"] = torch.get_num_threads()
        write_json_atomic(summary_path, summary, default=str)
        return summary
    finally:
        if own is not None:
            own.release()


def step_kind(cfg: TrainConfig) -> str:
    """What a run's time per step depends on, for a chunk's estimate of a run's length (``chunks``): its model,
    batch and online teacher. Not its mode or loss weights: a plain and a reinforced step of one model differ by a
    few per cent (1-8 % on the H200), which the estimate's margin covers."""
    overrides = json.dumps(cfg.model_overrides, sort_keys=True, default=str)
    return f"{cfg.model} {overrides} x{cfg.batch_size}x{cfg.accum_steps} online={cfg.online_teacher}"


def _finished_alike(run_dir: Path, cfg: TrainConfig) -> bool:
    """RUN holds a finished run (summary, last checkpoint) trained with this very config. The saved config
    is read through TrainConfig, so a field added since (at its default, the old behaviour) still matches."""
    if not (run_dir / "summary.json").is_file():
        return False
    return _saved_alike(run_dir, cfg)


def run_state(run_dir: Path, cfg: TrainConfig) -> str:
    """'done' (a finished run of this config), 'partial' (an interrupted one: ``resume=True`` continues it)
    or 'todo'."""
    if _finished_alike(run_dir, cfg):
        return "done"
    return "partial" if unfinished_alike(run_dir, cfg) else "todo"


def unfinished_alike(run_dir: Path, cfg: TrainConfig) -> bool:
    """RUN holds an interrupted run of this very config (config.yaml and a last.pt, no summary.json)."""
    return (not (run_dir / "summary.json").is_file() and (run_dir / "last.pt").is_file()
            and _saved_alike(run_dir, cfg))


def metrics_records(run_dir: Path) -> list[dict]:
    """RUN/metrics.jsonl's records ([] without one), less a last line a killed command left half-written."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in complete_lines(path.read_text())] if path.is_file() else []


def logged_step(records: list[dict]) -> int:
    """The last step a run's metrics records (``metrics_records``) logged; 0: none."""
    return max((int(r.get("step", 0)) for r in records), default=0)


def has_weights(run_dir: Path) -> bool:
    """RUN's last checkpoint is here, or the run was carried from a machine that kept it (``carry.py``)."""
    return (Path(run_dir) / "last.pt").is_file() or is_carried(run_dir)


def _saved_alike(run_dir: Path, cfg: TrainConfig) -> bool:
    if not ((run_dir / "config.yaml").is_file() and has_weights(run_dir)):
        return False
    try:
        previous = TrainConfig.from_dict(safe_load((run_dir / "config.yaml").read_text()), warn=False)
    except (TypeError, ValueError):  # a field since removed or renamed: not the same run
        return False
    return _as_saved(previous) == _as_saved(cfg)


def _as_saved(cfg: TrainConfig) -> dict:
    # none changes what is trained: a resumed run saves its config with resume: true, `--quiet` (progress off)
    # must not make a status listing or a later command take a finished run for another, and the CUDA graphs replay
    # the eager step (tested equal: models/block_graphs.py), so a run trained with or without them is the same run;
    # nor does how often last.pt is written (a run resumed from any save is the run never interrupted:
    # tests/test_resume.py), so a recipe may change save_every without its finished runs trained again; a run's
    # config.yaml holds the loader workers it ran with, which a recipe naming none gets by default on this host;
    # nor how often the loss balance is measured (gradients taken beside the step's own: the same step), nor the
    # frozen stem's memo (the outputs it would compute: tests/test_frozen_memo.py)
    same = dataclasses.replace(cfg, resume=False, progress=True, cuda_graphs="auto", cuda_graphs_text="auto",
                               cuda_graphs_heads="off", cuda_graphs_losses="off",
                               save_every=0, workers=loader_workers(cfg.workers, cfg.device), balance_every=0,
                               frozen_memo_mb=0)
    return yaml_round_trip(same.to_dict())


def eval_curve(run_dir: Path, samples_per_step: int) -> list[dict]:
    """The loop's validation records as points of metric vs samples seen."""
    return [{"step": rec["step"], "samples_seen": rec["step"] * samples_per_step,
             **{k: rec.get(k) for k in CURVE_METRICS}}
            for rec in metrics_records(run_dir) if rec.get("kind") == "eval"]


def report_set(recipe: dict, progress: bool = True, build: bool = True) -> tuple[Path, str]:
    """(shard folder, split) of the recipe's report set: the set no choice reads (``report:``).

    ``report.shards`` is a shard folder of its own (reused, or built from ``report.shards.build``: for
    the phantom an evaluation phantom drawn with its own source seed; ``build=False``: only its path);
    without it the report set is ``report.split`` (default ``eval.split``, else ``test``) of the training
    shards (real data: the test split). Settings are chosen on ``selection.split`` (val) of the training
    shards, never here."""
    spec = recipe.get("report") or {}
    split = spec.get("split") or (recipe.get("eval") or {}).get("split") or "test"
    if spec.get("shards"):
        return (ensure_shards(spec["shards"], progress) if build else Path(spec["shards"]["dir"])), split
    return Path(recipe["shards"]["dir"]), split


def evaluation_request(recipe: dict, run_dir: Path, shards: Path, isolated: bool, efficiency: bool = True,
                       build: bool = True) -> tuple[Path, dict, dict]:
    """(evaluation folder, request as recorded in its eval_request.json, the remaining ``evaluate`` options)
    of ``evaluate_run``; ``build=False`` builds no missing report set (a status listing)."""
    opts = dict(recipe.get("eval") or {})
    opts.pop("split", None)
    report_shards, split = report_set(recipe, progress=False, build=build)
    eff_batch = int(opts.pop("efficiency_batch", 32))
    measure = bool(opts.pop("efficiency", True)) and efficiency
    benchmark = opts.pop("benchmark", None)  # e.g. nih-bbox:PATH: its summary joins the run's row
    separate = report_shards.resolve() != Path(shards).resolve()
    eval_dir = run_dir / ("eval-report" if separate else f"eval-{split}")
    request = {"split": split, "efficiency_batch": eff_batch, "efficiency": measure, "isolated": isolated, **opts}
    if separate:
        request["report_shards"] = str(report_shards)
    if benchmark:
        request["benchmark"] = benchmark
    return eval_dir, request, opts


def evaluation_device(recipe: dict, opts: dict) -> str | None:
    """The device an evaluation runs on, taken out of ``opts``: the recipe's ``eval.device``, else the recipe's
    ``device`` (its runs', builds' and add-teacher's). Without it a GPU host evaluated every run on its CPU
    cores (``load_checkpoint`` defaults to CPU). Not part of the recorded request: figures do not depend on it
    beyond rounding."""
    return opts.pop("device", None) or recipe.get("device")


def evaluation_done(recipe: dict, run_dir: Path, shards: Path, isolated: bool, efficiency: bool = True) -> bool:
    """``evaluate_run`` would reuse an earlier evaluation (side-effect free: a status listing)."""
    eval_dir, request, _ = evaluation_request(recipe, run_dir, shards, isolated, efficiency, build=False)
    return _previous_evaluation(eval_dir, run_dir / "last.pt", request) is not None


def evaluate_run(recipe: dict, run_dir: Path, shards: Path, isolated: bool, efficiency: bool = True,
                 after_training: bool = False) -> dict:
    """Full evaluation of RUN/last.pt on the recipe's report set (``report_set``; the linear probe is
    fitted on the training shards' train split). Cost is measured in a fresh process on CPU, and only
    when ``efficiency`` and the recipe's eval options allow it. ``after_training``: this command just trained
    the run, so a chunk whose time is up evaluates it all the same (``chunks.begin``'s ``follows_on``)."""
    eval_dir, request, opts = evaluation_request(recipe, run_dir, shards, isolated, efficiency)
    report_shards = Path(request.get("report_shards") or shards)
    split, eff_batch, measure = request["split"], request["efficiency_batch"], request["efficiency"]
    benchmark = request.get("benchmark")
    ckpt = run_dir / "last.pt"
    previous = _previous_evaluation(eval_dir, ckpt, request)
    if previous is not None:
        return previous
    if not ckpt.is_file() and is_carried(run_dir):
        raise UserError(f"{run_dir} was carried from {(carried_from(run_dir) or {}).get('from')!r} without its "
                        f"weights, and its evaluation there ({eval_dir}) was not made for this recipe's request: "
                        "remove the folder to train the run again")
    begin(f"evaluate {run_dir}", follows_on=after_training)
    started = time.perf_counter()
    use_subprocess = measure and isolated and not torch.cuda.is_available()
    device = evaluation_device(recipe, opts)
    results = evaluate(str(ckpt), report_shards, split, eval_dir, progress=False, quiet=True,
                       efficiency=measure and not use_subprocess, efficiency_batch=eff_batch,
                       train_shards=shards, device=device, **opts)
    if use_subprocess:
        results["efficiency"] = measure_in_subprocess(str(ckpt), batch_size=eff_batch)
        results["summary"] = summary_row(results)
    if benchmark:
        bench = run_benchmark(str(ckpt), benchmark, split, eval_dir / "benchmark", progress=False, device=device)
        results["benchmark"] = {"summary": bench["summary"], "dir": str(eval_dir / "benchmark")}
        results["summary"].update(bench["summary"])
    if use_subprocess or benchmark:
        write_json(results, eval_dir / "eval.json")
    write_json(request, eval_dir / "eval_request.json")
    measured_evaluation(time.perf_counter() - started)
    return results


def _previous_evaluation(eval_dir: Path, ckpt: Path, request: dict) -> dict | None:
    """The eval.json of an identical earlier request on this very checkpoint (a reused run; a carried run's, made
    on the machine that kept the checkpoint), else None."""
    done, asked = eval_dir / "eval.json", eval_dir / "eval_request.json"
    carried = not ckpt.is_file() and is_carried(ckpt.parent)
    if not (done.is_file() and asked.is_file() and (ckpt.is_file() or carried)):
        return None
    try:  # a command killed while writing them leaves a file that does not parse: evaluate again
        if (not carried and done.stat().st_mtime < ckpt.stat().st_mtime) \
                or json.loads(asked.read_text()) != jsonable(request):
            return None
        return json.loads(done.read_text())
    except json.JSONDecodeError:
        return None


def result_row(name: str, summary: dict, results: dict, batch: int) -> dict:
    """One table row of a run: its evaluation summary plus the training loop's samples, time and speed."""
    row = {"run": name, **results["summary"]}
    row.update({"samples_seen": summary.get("samples_seen"), "wall_s": summary.get("wall_s"),
                "step_ms": summary.get("mean_step_ms"),
                "train_img_per_s": (1000.0 * batch / summary["mean_step_ms"]
                                    if summary.get("mean_step_ms") else None)})
    return row
