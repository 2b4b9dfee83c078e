"""Issue 38: kill -9 of the main process alone, then an immediate --resume, again and again.

A folder lock must be held by the writing process only: its forked loader workers, orphaned by
the kill and alive for seconds more, must not keep the next run out (cxrdr/common/locking.py).
Tiny data (the session's phantom:40 shards; phantom:N builds with the random:tiny teacher), the
tiny-A student, a few steps of 4 samples; the processes are forked (tests/forked_cli.py).
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.forked_cli import python_m
from tests.test_faults import tiny_build_options
from tests.test_resume import RUN, _assert_same_run, _flags, kill_resume

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _reap(pids: list[int]) -> None:
    """SIGKILL the orphaned workers this test left behind (by pid) instead of waiting for them."""
    for pid in pids:
        if kill_resume.alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_for(proc, ready, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"ended before {what}: " + proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"never reached {what}"
        time.sleep(0.005)


def _resume_at_once(cmd: list[str], env: dict, killed: float, workers: list[int], *locks):
    """After the main process was SIGKILLed at ``killed``: each of ``locks`` (callables taking a lock)
    is free although its orphaned ``workers`` live on, and ``cmd --resume`` starts within 1 s. Returns the
    resumed process and how many orphans were still alive when the locks were taken: orphans can end soon
    after their parent (a fresh-clone CI run on a busy box once found none in a build round), so the caller
    asks that some round found some, else the kills tested nothing."""
    for take in locks:
        with take():
            pass
    alive = sum(kill_resume.alive(w) for w in workers)
    proc = python_m(cmd + ["--resume"], env, REPO)
    assert time.monotonic() - killed < 1.0
    _reap(workers)
    return proc, alive


def test_lock_is_not_inherited_by_forked_children(tmp_path):
    """The mechanism alone: a holder forks a child and is SIGKILLed; the lock is free at once although
    the child lives; a child's release never unlocks its parent."""
    import multiprocessing

    from cxrdr.common.locking import FolderBusyError, lock_folder

    # The parent names its child only once the child runs (and so has passed the at-fork hook): until a
    # forked child is first scheduled it still holds its copy of the lock, whatever the hook does.
    script = ("import os, sys, time\n"
              "from cxrdr.common.locking import lock_folder\n"
              "lock = lock_folder(sys.argv[1], 'holder')\n"
              "ready_r, ready_w = os.pipe()\n"
              "child = os.fork()\n"
              "if child == 0:\n"
              "    lock.release()  # a child's release must not unlock the parent's lock\n"
              "    os.write(ready_w, b'x')\n"
              "    time.sleep(30); os._exit(0)\n"
              "os.read(ready_r, 1)\n"
              "print(child, flush=True)\n"
              "time.sleep(30)\n")
    import subprocess

    holder = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
            lock_folder(tmp_path, "test")  # the child's release left the parent's lock in place
        holder.kill()
        holder.wait()
        assert kill_resume.alive(child)
        with lock_folder(tmp_path, "test"):  # free at once: the orphaned child holds nothing
            ctx = multiprocessing.get_context("fork")
            probe = ctx.Process(target=time.sleep, args=(0,))
            probe.start()  # forked while this process holds the lock: released here it stays held
            probe.join()
            with pytest.raises(FolderBusyError):
                lock_folder(tmp_path, "test")
    finally:
        _reap([child])


TRAIN_STEPS, TRAIN_ROUNDS = 26, 10  # kills 1-2 steps apart: the last at step 20 or before


def test_train_run_main_process_killed_and_resumed_at_once_ten_times(phantom_shards, tmp_path):
    """SIGKILL of `train run`'s main process (2 loader workers left orphaned) at a random step, `--resume`
    started within 1 s, 10 rounds: every resume is accepted and the end equals the run never killed."""
    from cxrdr.common.locking import lock_folder
    from cxrdr.train.loop import train

    settings = dict(shards=str(phantom_shards), steps=TRAIN_STEPS, workers=2, **dict(RUN, save_every=2))
    ref = tmp_path / "ref"
    train(dict(settings, out=str(ref), progress=False))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "cxrdr.train.cli", "run", *_flags(dict(settings, out=str(run)))]
    env = kill_resume.run_env()
    rng = random.Random(38)
    proc, logged, orphans, orphans_alive = python_m(cmd, env, REPO), 0, [], []
    try:
        for round_ in range(TRAIN_ROUNDS):
            if round_:  # accepted: it says where it resumed (a refusal ends it with one error line)
                _wait_for(proc, lambda: any(said in proc.stderr_so_far() for said in
                                            ("resumed from", "starting from scratch")),  # killed before a save
                          f"round {round_}'s resume")
            # Past every step the killed runs logged: only this process can have logged it.
            target = min(logged + rng.randint(1, 2), TRAIN_STEPS - 1)
            reached, workers = kill_resume.kill_main_at(proc, run, target, timeout=120)
            killed = time.monotonic()
            assert len(workers) == 2, workers  # the loader workers were up when it was killed
            orphans += workers
            logged = kill_resume.last_step(run)
            proc, alive = _resume_at_once(cmd, env, killed, workers, lambda: lock_folder(run, "test"))
            orphans_alive.append(alive)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "resumed from" in err, err[-3000:]
        assert any(orphans_alive), "every round's orphaned workers were gone already: the kills tested nothing"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _reap(orphans)
    _assert_same_run(ref, run)
    from cxrdr.train.checkpoint import read_checkpoint

    assert kill_resume.compare(read_checkpoint(ref / "last.pt"), read_checkpoint(run / "last.pt"))["max_abs_diff"] == 0


BUILD_N, BUILD_ROUNDS = 90, 4  # each round builds ~4 of the ~31 shards


def test_build_main_process_killed_and_resumed_at_once_equals_uninterrupted(tmp_path):
    """SIGKILL of `reinforce build`'s main process while its 2 preparation workers run, `--resume` started
    within 1 s, a few rounds: every resume is accepted; the shards equal an uninterrupted build's bytes."""
    from cxrdr.common.locking import lock_build_rank, lock_folder
    from cxrdr.reinforce.build import build
    from cxrdr.teachers import load_teachers

    reference = tmp_path / "reference"
    build(tiny_build_options(reference, source=f"phantom:{BUILD_N}"), teachers=load_teachers("random:tiny", device="cpu"))
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "cxrdr.reinforce.cli", "build", "--source", f"phantom:{BUILD_N}", "--source-seed", "4",
           "--phantom-size", "96", "--teachers", "random:tiny", "--out", str(out), "--n-aug", "2", "--n-captions", "2",
           "--store-size", "48", "--shard-size", "3", "--batch-size", "4", "--workers", "2", "--device", "cpu",
           "--quiet"]
    env = kill_resume.run_env()

    def built() -> int:
        return len(list((out / "stats").glob("shard-*.json")))

    proc, orphans, kills, orphans_alive = python_m(cmd, env, REPO), [], 0, []
    try:
        for round_ in range(BUILD_ROUNDS):
            # Once its workers prepare (after the in-process probe batches), and a shard later:
            _wait_for(proc, lambda: len(kill_resume.children(proc.pid)) == 2, f"round {round_}'s workers")
            done = built()
            _wait_for(proc, lambda: built() > done, f"round {round_}'s next shard")
            workers = kill_resume.children(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed, kills = time.monotonic(), kills + 1
            orphans += workers
            proc, alive = _resume_at_once(cmd, env, killed, workers, lambda: lock_folder(out, "test"),
                                          lambda: lock_build_rank(out, 0, 1))  # the folder's lock, and the rank's
            orphans_alive.append(alive)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert any(orphans_alive), "every round's orphaned workers were gone already: the kills tested nothing"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _reap(orphans)
    assert kills == BUILD_ROUNDS
    tars = sorted(p.name for p in reference.glob("*.tar.gz"))
    assert tars == sorted(p.name for p in out.glob("*.tar.gz")) and len(tars) >= BUILD_N // 3
    for name in tars:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert (out / "manifest.parquet").read_bytes() == (reference / "manifest.parquet").read_bytes()
