"""benchmarks/child_deadline.py: a call in a spawned child, its value returned, its failure named, and the child
killed at the deadline (the GPU suite's compiled configurations run this way)."""
from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from child_deadline import DeadlineExceeded, _proc_stat, call_with_deadline, process_tree  # noqa: E402


def test_the_child_returns_the_value_and_sees_the_variables_set_for_it():
    assert call_with_deadline(math.factorial, 60, 10) == 3_628_800
    assert call_with_deadline(sorted, 60, [3, 1, 2], reverse=True) == [3, 2, 1]
    assert call_with_deadline(os.getenv, 60, "CXRDR_CHILD_ONLY", env={"CXRDR_CHILD_ONLY": "yes"}) == "yes"
    assert "CXRDR_CHILD_ONLY" not in os.environ  # set for the child alone


def test_the_child_starts_its_own_processes_as_the_parent_does():
    # a spawned child defaults to "spawn": its loader workers would each import torch before the next one started
    parent = multiprocessing.get_start_method()
    assert call_with_deadline(eval, 60, "__import__('multiprocessing').get_start_method()") == parent


def test_a_failure_in_the_child_is_raised_with_its_type_and_message():
    with pytest.raises(RuntimeError, match=r"sqrt failed in its child process: ValueError: .*math domain error"):
        call_with_deadline(math.sqrt, 60, -1.0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_call_past_its_deadline_writes_its_stacks_lists_its_processes_and_is_killed_with_them(capfd):
    start = time.perf_counter()
    with pytest.raises(DeadlineExceeded, match="run did not return within 3 s; its child process was killed") as raised:
        call_with_deadline(subprocess.run, 3, ["sh", "-c", "sleep 120 & sleep 120; wait"])  # a shell, two sleeps
    assert time.perf_counter() - start < 30  # not the 120 s the call would take
    processes = raised.value.processes
    sleeps = [p for p in processes if p["cmd"] == "sleep 120"]
    assert len(sleeps) == 2 and all(p["state"] in "SR" and p["busy"] is not None and p["busy"] < 0.5 for p in sleeps)
    assert any(p["cmd"].startswith("sh -c") for p in processes) and len(processes) == 4  # the child, sh, 2 sleeps
    time.sleep(0.5)
    for p in processes:  # none lives on (a zombie waits for its reaper, it runs nothing)
        left = _proc_stat(p["pid"])
        assert left is None or left["state"] == "Z", left
    err = capfd.readouterr().err
    assert "run's processes at its deadline of 3 s" in err and err.count("sleep 120") >= 2
    # before the kill, the child wrote where it was: waiting in subprocess.run, called from the child's wrapper
    assert "Timeout (" in err and "(most recent call first)" in err and "in _child" in err and "in run" in err


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_the_process_tree_gives_a_busy_process_about_a_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        tree = process_tree(os.getpid(), interval=0.5)
    finally:
        spinner.kill()
        spinner.wait()
    mine = {p["pid"]: p for p in tree}
    assert os.getpid() in mine and spinner.pid in mine and mine[spinner.pid]["ppid"] == os.getpid()
    assert mine[spinner.pid]["busy"] > 0.1 and mine[spinner.pid]["state"] == "R"  # a share of a loaded box
