"""By hand: a `train run` killed with SIGKILL at seeded random steps, resumed after each kill, ends
bit-identical to the same run never interrupted (issue 27; docs/resume.md).

    OMP_NUM_THREADS=1 python benchmarks/kill_resume.py --out /tmp/kr --kills 3 --seed 27 -- \\
        --shards demo/shards --model cpu-D --steps 300 --batch-size 32 --eval-every 150 --workers 2

Runs `train run` with the flags after ``--`` into OUT/reference, then into OUT/killed, killing the
whole process group (main process and loader workers, as a preemption does) once it has logged
each of ``--kills`` steps drawn with ``--seed``, and resuming it with ``--resume`` each time.
With ``--main-only`` it kills the main process alone (``kill -9 PID``: its loader workers live on,
orphaned, for seconds) and starts the resume at once, which must be accepted (issue 38).
Prints one JSON object: the kill steps, the step each resume started from, the wall time of each
run and ``max_abs_diff`` over every parameter and every optimiser-state tensor of the two
``last.pt`` (0.0: bit-identical), plus whether the two are ``torch.equal`` throughout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cxrdr.train.checkpoint import read_checkpoint  # noqa: E402
from cxrdr.train.runfolder import complete_lines  # noqa: E402


def run_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "GLOO_SOCKET_IFNAME": "lo"}


def last_step(run: Path) -> int:
    """The highest step RUN/metrics.jsonl holds (-1: none yet)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return -1
    # only finished lines: the run may be writing one as we read
    steps = [json.loads(line).get("step", -1) for line in complete_lines(metrics.read_text())]
    return max(steps, default=-1)


def start_in_new_group(cmd: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (a run's loader workers), from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # ended meanwhile
            continue
        if int(fields[1]) == pid and fields[0] not in "ZX":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def wait_for_step(proc, run: Path, step: int, deadline: float) -> int:
    """Wait until RUN/metrics.jsonl shows ``step`` (``proc`` must live meanwhile); the step it shows."""
    while (reached := last_step(run)) < step:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before step {step}: {proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run never reached step {step}")
        time.sleep(0.01)
    return reached


def kill_main_at(proc, run: Path, step: int, timeout: float = 600.0) -> tuple[int, list[int]]:
    """SIGKILL the main process ``proc`` alone (not its group) once the run has logged ``step`` and
    wait until it is gone. Returns the step it had logged and its loader workers, which it leaves
    behind orphaned (they notice within seconds and exit)."""
    reached = wait_for_step(proc, run, step, time.monotonic() + timeout)
    workers = children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return reached, workers


def kill_group_at(cmd: list[str], run: Path, step: int, timeout: float = 600.0, start=start_in_new_group) -> int:
    """Start ``cmd`` in a new process group (``start(cmd, env, cwd)``: a Popen-like process that leads
    it); SIGKILL the group once the run has logged ``step``; wait until every process of the group is
    gone (so the next run does not share the CPU with dying workers). Returns the step the run had logged."""
    proc = start(cmd, run_env(), REPO)
    deadline = time.monotonic() + timeout
    reached = wait_for_step(proc, run, step, deadline)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    return reached


def _stderr_until_resumed(proc: subprocess.Popen) -> str:
    """Read the run's stderr up to its 'resumed from ...' line (or its end: a refusal)."""
    lines = []
    for line in proc.stderr:
        line = line.decode(errors="replace") if isinstance(line, bytes) else line
        lines.append(line)
        if line.startswith("resumed from") or "starting from scratch" in line:
            break
    else:
        raise RuntimeError(f"the resume was refused: {''.join(lines)[-3000:]}")
    return "".join(lines)


def state_tensors(ckpt: dict) -> dict[str, torch.Tensor]:
    """Every parameter/buffer and every optimiser-state tensor of a checkpoint, by a dotted name."""
    out = {f"model.{k}": v for k, v in ckpt["model"].items()}
    for index, state in ckpt["optimizer"]["state"].items():
        out.update({f"optimizer.{index}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return out


def compare(a: dict, b: dict) -> dict:
    """max |a - b| over the tensors of two checkpoints, and whether all are torch.equal."""
    ta, tb = state_tensors(a), state_tensors(b)
    if set(ta) != set(tb):
        raise ValueError(f"the checkpoints hold other tensors: {sorted(set(ta) ^ set(tb))[:5]}")
    diff = max((ta[k].double() - tb[k].double()).abs().max().item() for k in ta if ta[k].numel())
    return {"tensors": len(ta), "max_abs_diff": diff, "all_equal": all(torch.equal(ta[k], tb[k]) for k in ta)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--main-only", action="store_true",
                        help="kill the main process alone and resume at once (its workers orphaned)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="`train run` flags, after --")
    args = parser.parse_args()
    flags = [a for a in args.train_args if a != "--"]
    steps = int(flags[flags.index("--steps") + 1])
    base = [sys.executable, "-m", "cxrdr.train.cli", "run", *flags, "--no-progress"]

    t0 = time.perf_counter()
    reference = args.out / "reference"
    subprocess.run([*base, "--out", str(reference), "--overwrite"], env=run_env(), cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    t_ref = time.perf_counter() - t0
    killed = args.out / "killed"
    kills = sorted(random.Random(args.seed).sample(range(1, steps), args.kills))
    report: dict = {"train_args": flags, "kill_at": kills, "killed_at": [], "resumed_from": []}
    t0 = time.perf_counter()
    cmd = [*base, "--out", str(killed), "--overwrite"]
    resume = [*base, "--out", str(killed), "--resume"]
    if args.main_only:
        report["orphaned_workers_alive_at_resume"] = []
        proc = start_in_new_group(cmd, run_env(), REPO)
        for at in kills:
            reached, workers = kill_main_at(proc, killed, at)
            report["killed_at"].append(reached)
            proc = start_in_new_group(resume, run_env(), REPO)  # at once: the orphans must not block it
            report["orphaned_workers_alive_at_resume"].append(sum(alive(w) for w in workers))
            report["resumed_from"] += [int(m) for m in re.findall(r"at step (\d+)", _stderr_until_resumed(proc))]
        if proc.wait() != 0:
            raise RuntimeError(f"the last resume failed: {proc.communicate()[1][-3000:]}")
    else:
        for at in kills:
            report["killed_at"].append(kill_group_at(cmd, killed, at))
            cmd = resume
        done = subprocess.run(cmd, env=run_env(), cwd=REPO, check=True, capture_output=True, text=True)
        report["resumed_from"] = [int(m) for m in re.findall(r"at step (\d+)", done.stderr)]
    report.update(seconds_reference=round(t_ref, 1), seconds_killed=round(time.perf_counter() - t0, 1),
                  **compare(read_checkpoint(reference / "last.pt"), read_checkpoint(killed / "last.pt")))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
