"""By hand: a `train run` killed with SIGKILL at seeded random steps, resumed after each kill, ends
bit-identical to the same run never interrupted (issue 27; docs/resume.md).

    OMP_NUM_THREADS=1 python benchmarks/kill_resume.py --out /tmp/kr --kills 3 --seed 27 -- \\
        --shards demo/shards --model cpu-D --steps 300 --batch-size 32 --eval-every 150 --workers 2

Runs `train run` with the flags after ``--`` into OUT/reference, then into OUT/killed, killing the
whole process group (main process and loader workers, as a preemption does) once it has logged
each of ``--kills`` steps drawn with ``--seed``, and resuming it with ``--resume`` each time.
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


def run_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "GLOO_SOCKET_IFNAME": "lo"}


def last_step(run: Path) -> int:
    """The highest step RUN/metrics.jsonl holds (-1: none yet)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return -1
    steps = [json.loads(line).get("step", -1) for line in metrics.read_text().splitlines() if line.strip()]
    return max(steps, default=-1)


def start_in_new_group(cmd: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def kill_group_at(cmd: list[str], run: Path, step: int, timeout: float = 600.0, start=start_in_new_group) -> int:
    """Start ``cmd`` in a new process group (``start(cmd, env, cwd)``: a Popen-like process that leads
    it); SIGKILL the group once the run has logged ``step``; wait until every process of the group is
    gone (its loader workers hold the run folder's lock). Returns the step the run had logged."""
    proc = start(cmd, run_env(), REPO)
    deadline = time.monotonic() + timeout
    while (reached := last_step(run)) < step:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before step {step}: {proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run never reached step {step}")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    return reached


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
    for at in kills:
        report["killed_at"].append(kill_group_at(cmd, killed, at))
        cmd = [*base, "--out", str(killed), "--resume"]
    done = subprocess.run(cmd, env=run_env(), cwd=REPO, check=True, capture_output=True, text=True)
    report["resumed_from"] = [int(m) for m in re.findall(r"at step (\d+)", done.stderr)]
    report.update(seconds_reference=round(t_ref, 1), seconds_killed=round(time.perf_counter() - t0, 1),
                  **compare(read_checkpoint(reference / "last.pt"), read_checkpoint(killed / "last.pt")))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
