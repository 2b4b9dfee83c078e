"""`reinforce build --engine ray`: the same build, its shards spread over a Ray cluster.

Modelled on MobileCLIP's reinforcement tool (ml-mobileclip-dr): a pool of actors, each holding
the teachers, fed with units of work by Ray.

What runs where
- The driver (the ``reinforce build`` process) does what the local engine does before any image
  work: opens the source, cuts the shards, writes ``stats/plan.json``, skips complete shards
  (``--resume``). It loads the teachers on CPU only to describe them in the plan.
- Ray Data actors (``ActorPoolStrategy``, ``--ray-actors N``) each load the teachers once, on
  one GPU per actor (``num_gpus=1``) when the cluster has GPUs, else on CPU. An actor builds
  whole shards with the local engine's own ``cxrdr.reinforce.pipeline.run_shards`` (DataLoader workers
  or, for a CPU teacher where that is faster, the actor itself prepare; the actor embeds, a thread
  writes the tar), so tars and stats are the same bytes.
- One shard = one Ray Data block = one task: the unit of scheduling, retry and resume. Ray's
  streaming executor hands the next shard to whichever actor is free (no fixed i % world).
- When every shard is complete the driver writes its timing as rank 0 and merges, as the local
  engine does; a shard folder built by either engine is the same shard folder.

Failures
- An actor that dies (OOM kill, lost node) is restarted by Ray and its shard re-run
  (``max_restarts``/``max_task_retries`` = ``--ray-retries``).
- An exception while building a shard is retried as often (``actor_task_retry_on_errors``);
  a half-written shard is only ever a ``.tmp`` file. Each failed attempt leaves
  ``stats/shard-NNNNNN.error.json`` (id of the shard, attempt, reason), removed on success.
- A shard that still fails does not stop the others (``max_errored_blocks``); the build then
  ends with a one-line error naming it, and ``--resume`` builds only what is missing.
- Bad records never fail a task: ``prepare_record`` skips them into the shard's stats and the
  build's skip log, with id and reason, exactly as in the local engine.

The output folder, the source's files and ``--model-cache`` must be reachable at the same paths
from every node (a shared filesystem), as for a multi-rank torchrun build.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import socket
import time
import warnings
from pathlib import Path

import numpy as np
import typer
from tqdm import tqdm

from cxrdr.common.atomic import write_json_atomic
from cxrdr.common.errors import UserError
from cxrdr.reinforce.options import load_build_teachers
from cxrdr.reinforce.pipeline import TIMING_KEYS, run_shards
from cxrdr.reinforce.prepare import json_safe
from cxrdr.reinforce.records import SkipLog
from cxrdr.reinforce.writer import is_shard_complete, stats_path

INSTALL_HINT = 'pip install "cxrdr[ray]" (or pip install "ray[data]")'
# Test hook: "INDEX:N[,INDEX:N]" makes the first N attempts at shard INDEX raise (retry tests).
FAULTS_ENV = "CXRDR_RAY_FAULTS"


def import_ray():
    """Ray and Ray Data, imported on use: an optional dependency (the ``ray`` extra)."""
    try:
        import ray
        import ray.data  # noqa: F401 - the engine needs Ray Data, not only Ray core
    except ImportError as exc:
        raise UserError(f"--engine ray needs Ray Data, which is not installed ({exc}): {INSTALL_HINT}") from None
    return ray


def error_path(out_dir: Path, index: int) -> Path:
    path = stats_path(out_dir, index)
    return path.with_name(path.stem + ".error.json")


def _parse_faults(text: str | None) -> dict[int, int]:
    faults = {}
    for part in (text or "").split(","):
        if part.strip():
            index, count = part.split(":")
            faults[int(index)] = int(count)
    return faults


class ShardBuilder:
    """A Ray Data actor: teachers loaded once, then whole shards built by the local engine's code."""

    def __init__(self, opts, spec, device: str, expected_teachers: list, cwd: str, faults: dict):
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative source paths mean what they meant on the driver
        self.opts, self.spec, self.device, self.faults = opts, spec, device, faults
        self.teachers = load_build_teachers(opts, device)
        got = [json_safe(t.describe()) for t in self.teachers]
        if json.loads(json.dumps(got)) != expected_teachers:
            # Another model cache or package version on this node would silently mix teachers.
            raise UserError(f"--teachers {opts.teachers}: the teachers loaded on {socket.gethostname()} differ "
                            "from the driver's (weights fingerprint or settings); give every node the same "
                            "--model-cache and packages")

    def __call__(self, batch: dict) -> dict:
        results = [self.build_shard(pickle.loads(payload)) for payload in batch["plan"]]
        return {"index": np.array([r["index"] for r in results]),
                "result": np.array([json.dumps(r) for r in results], dtype=object)}

    def build_shard(self, shard) -> dict:
        out_dir = Path(self.opts.out)
        err = error_path(out_dir, shard.index)
        attempt = 1 + (json.loads(err.read_text())["attempt"] if err.is_file() else 0)
        skiplog = SkipLog()
        started = time.perf_counter()
        try:
            if attempt <= self.faults.get(shard.index, 0):
                raise RuntimeError(f"injected fault ({FAULTS_ENV}) in attempt {attempt}")
            result = run_shards([shard], self.teachers, self.spec, self.opts, out_dir, skiplog, None, 0,
                                announce=False)
        except Exception as exc:
            write_json_atomic(err, {"shard": shard.name, "attempt": attempt, "host": socket.gethostname(),
                                    "error": f"{type(exc).__name__}: {exc}"})
            raise
        err.unlink(missing_ok=True)
        return {**result, "index": shard.index, "host": socket.gethostname(), "device": self.device,
                "attempts": attempt, "shard_seconds": round(time.perf_counter() - started, 3),
                "skipped": skiplog.to_json()["records"]}


def init_ray(ray, **init_kwargs) -> None:
    """``ray.init``: the cluster at RAY_ADDRESS when set, as every Ray program; else a local instance whose
    workers run at the build's own priority. Ray starts its workers niced (15) so that its own processes stay
    responsive; on a local build the workers are the build, and beside other work they got a few per cent of a
    core (CFS weights 36 against 1024): a 2-core box running three trainings took the Ray build tests 669 s
    instead of ~30 s. A cluster's own settings are its operator's, so nothing is set there."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**init_kwargs)
    else:
        ray.init(_system_config={"worker_niceness": 0}, **init_kwargs)


def _placement(ray, opts) -> tuple[bool, int, int]:
    """(one GPU per actor?, CPUs per actor, actors) from --device, --workers and --ray-actors."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    if opts.device.startswith("cuda") and gpus == 0:
        raise UserError(f"--device {opts.device} --engine ray: the Ray cluster has no GPUs "
                        "(use --device auto or cpu)")
    use_gpu = gpus > 0 and opts.device != "cpu"
    cpus_per_actor = max(1, opts.workers)  # the DataLoader workers; the actor's own thread shares them
    actors = opts.ray_actors or (gpus if use_gpu else max(1, cpus // cpus_per_actor))
    return use_gpu, cpus_per_actor, actors


def run_shards_ray(todo: list, teachers: list, spec, opts, out_dir: Path, skiplog) -> dict:
    """Build ``todo`` (ShardPlans) on a Ray actor pool; returns the rank-stats dict of ``run_shards``."""
    ray = import_ray()
    if not todo:
        return {"samples_built": 0, "pipeline_seconds": 0.0, "engine": "ray",
                "time_split_seconds": dict.fromkeys(TIMING_KEYS, 0.0)}
    started_here = not ray.is_initialized()
    if started_here:
        init_ray(ray, include_dashboard=False, log_to_driver=opts.progress)
    ctx = ray.data.DataContext.get_current()
    saved = {k: getattr(ctx, k) for k in ("actor_task_retry_on_errors", "max_errored_blocks",
                                          "enable_progress_bars")}
    try:
        use_gpu, cpus_per_actor, actors = _placement(ray, opts)
        actors = min(actors, len(todo))
        out_dir = Path(out_dir).resolve()
        actor_opts = dataclasses.replace(opts, out=out_dir, progress=False)
        for s in todo:  # attempts are counted per run: a new run starts every shard afresh
            error_path(out_dir, s.index).unlink(missing_ok=True)
        ctx.actor_task_retry_on_errors = True
        ctx.max_errored_blocks = len(todo)  # one shard that keeps failing must not stop the others
        ctx.enable_progress_bars = False  # our own bar counts shards
        rows = [{"index": s.index, "plan": pickle.dumps(s)} for s in todo]
        with warnings.catch_warnings():
            # max_restarts/max_task_retries have no named parameter yet (pyproject pins ray < 2.64).
            warnings.simplefilter("ignore", DeprecationWarning)
            ds = _actor_pool_map(ray, rows, actors, use_gpu, cpus_per_actor, opts.ray_retries, dict(
                opts=actor_opts, spec=spec, device="cuda" if use_gpu else "cpu",
                expected_teachers=json.loads(json.dumps([json_safe(t.describe()) for t in teachers])),
                cwd=os.getcwd(), faults=_parse_faults(os.environ.get(FAULTS_ENV))))
        if opts.progress:
            typer.echo(f"ray: {len(todo)} shards on {actors} actor(s), {'1 GPU' if use_gpu else 'CPU'} and "
                       f"{cpus_per_actor} CPU(s) each", err=True)
        start = time.perf_counter()
        results = []
        rows_out = iter(ds.iter_rows())  # a generator: close() shuts its executor down
        with tqdm(total=len(todo), unit="shard", desc="build[ray]", disable=not opts.progress) as bar:
            try:
                for row in rows_out:
                    results.append(json.loads(row["result"]))
                    bar.update(1)
            except Exception as exc:  # noqa: BLE001 - Ray wraps the actor's error; say it in one line
                raise UserError(_ray_failure(exc, out_dir)) from exc
            finally:
                # Ray Data frees a finished actor pool by reference counting: drop our references to
                # its executor now rather than whenever the garbage collector reaches them.
                rows_out.close()
                del rows_out, ds
                gc.collect()
        pipeline = time.perf_counter() - start
        _raise_for_failed_shards(out_dir, todo, opts.ray_retries)
    finally:
        for k, v in saved.items():
            setattr(ctx, k, v)
        if started_here:
            ray.shutdown()
    results.sort(key=lambda r: r["index"])
    for r in results:
        for entry in r["skipped"]:
            skiplog.skip(entry["id"], entry["reason"])
    return {"samples_built": sum(r["samples_built"] for r in results), "pipeline_seconds": round(pipeline, 3),
            "time_split_seconds": _sum_dicts(r["time_split_seconds"] for r in results),
            "assemble_seconds": round(sum(r.get("assemble_seconds", 0.0) for r in results), 3),
            "prepare_cpu_seconds": _sum_dicts(r.get("prepare_cpu_seconds", {}) for r in results),
            "main_cpu_seconds": _sum_dicts(r.get("main_cpu_seconds", {}) for r in results),
            "engine": "ray", "actors": actors, "device": "cuda" if use_gpu else "cpu",
            # each actor resolves --replay for its own teachers' device
            "replay": ", ".join(sorted({r["replay"] for r in results if r.get("replay")})) or None,
            "hosts": sorted({r["host"] for r in results}),
            "shards": [{k: r[k] for k in ("index", "host", "attempts", "shard_seconds")} for r in results]}


def _actor_pool_map(ray, rows: list, actors: int, use_gpu: bool, cpus: int, retries: int, init: dict):
    """One block per shard (the unit Ray schedules and retries), mapped by a fixed actor pool."""
    return ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
        ShardBuilder, batch_size=1, compute=ray.data.ActorPoolStrategy(size=actors),
        num_gpus=1 if use_gpu else 0, num_cpus=cpus, fn_constructor_kwargs=init,
        max_restarts=retries, max_task_retries=retries)


def _raise_for_failed_shards(out_dir: Path, todo: list, retries: int) -> None:
    failed = [s for s in todo if not is_shard_complete(out_dir, s.index)]
    if not failed:
        return
    reasons = []
    for s in failed[:5]:
        err = error_path(out_dir, s.index)
        why = json.loads(err.read_text())["error"] if err.is_file() else "no error recorded (actor lost?)"
        reasons.append(f"{s.name}: {why}")
    more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
    raise UserError(f"{len(failed)} shard(s) of {out_dir} failed after {retries + 1} attempt(s) "
                    f"({'; '.join(reasons)}{more}); the others are complete: rerun with --resume")


def _ray_failure(exc: BaseException, out_dir: Path) -> str:
    """One line for a failed Ray execution: the actor's own UserError when there is one."""
    seen = exc
    while seen is not None:
        if isinstance(seen, UserError):
            return str(seen).strip().splitlines()[-1]
        seen = seen.__cause__ or seen.__context__
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return (f"--engine ray: the build of {out_dir} failed: {type(exc).__name__}: "
            f"{lines[-1] if lines else ''}; complete shards are kept: rerun with --resume")


def _sum_dicts(dicts) -> dict:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return {k: round(v, 3) for k, v in out.items()}
