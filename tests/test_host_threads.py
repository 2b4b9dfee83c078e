"""The host's CPU threads beside a GPU model: the cores the loader workers leave, one for evaluations."""
from types import SimpleNamespace

import pytest
import torch
from threadpoolctl import threadpool_info

from cxrdr.common import host_threads as ht


def _blas_threads() -> set:
    return {pool["num_threads"] for pool in threadpool_info()}


def test_threads_beside_workers_leave_each_worker_a_core(monkeypatch):
    monkeypatch.setattr(ht, "available_cores", lambda: 16)
    assert ht.threads_beside(8, cap=16) == 8
    assert ht.threads_beside(12, cap=16) == 4
    assert ht.threads_beside(8, cap=4) == 4  # never more than torch had (OMP_NUM_THREADS)
    assert ht.threads_beside(20, cap=16) == 1 and ht.threads_beside(16, cap=16) == 1
    assert ht.threads_beside(0, cap=16) == 16
    assert ht.threads_beside(4, cap=16, processes=2) == 4  # two ranks: 8 workers, 8 cores left, 4 each
    assert ht.threads_beside(8, cap=16, processes=2) == 1


def test_host_threads_sets_torch_and_blas_and_restores_them_even_on_error():
    before = (torch.get_num_threads(), _blas_threads())
    with pytest.raises(RuntimeError, match="inside"):
        with ht.host_threads(1):
            assert torch.get_num_threads() == 1 and _blas_threads() == {1}
            raise RuntimeError("inside")
    assert (torch.get_num_threads(), _blas_threads()) == before
    with ht.host_threads(None):
        assert (torch.get_num_threads(), _blas_threads()) == before


def test_a_gpu_run_keeps_its_threads_to_the_cores_its_workers_leave(monkeypatch):
    from cxrdr.train.loop import Trainer

    monkeypatch.setattr(ht, "available_cores", lambda: 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)

    def run(device, workers, world=1):
        return SimpleNamespace(device=torch.device(device), cfg=SimpleNamespace(workers=workers), world=world)

    assert Trainer.host_threads(run("cuda", 8)) == 8
    assert Trainer.host_threads(run("cuda", 4, world=2)) == 4
    assert Trainer.host_threads(run("cuda", 0)) is None  # the process loads its own batches: its threads
    assert Trainer.host_threads(run("cpu", 8)) is None  # the CPU's threads train the model
    # a validation pass: on a GPU one thread for all its host work; on the CPU the probe alone, beside workers
    assert Trainer._pass_threads(run("cuda", 8)) == {"threads": 1, "probe_threads": None}
    assert Trainer._pass_threads(run("cpu", 8)) == {"threads": None, "probe_threads": 1}
    assert Trainer._pass_threads(run("cpu", 0)) == {"threads": None, "probe_threads": None}


@pytest.mark.parametrize("device, expected", [("cuda", 1), ("cpu", None)])
def test_an_evaluation_of_a_gpu_model_runs_its_host_work_on_one_thread(monkeypatch, device, expected):
    from cxrdr.train.evaluation import runner

    seen = []

    def no_samples(*args):
        seen.append(torch.get_num_threads())
        return []

    before = torch.get_num_threads()
    monkeypatch.setattr(runner, "as_eval_model", lambda model, device_: SimpleNamespace(device=torch.device(device)))
    monkeypatch.setattr(runner, "load_split", no_samples)
    with pytest.raises(ValueError, match="has no samples"):
        runner.evaluate("model", "shards", "test")
    assert seen == [expected or before] and torch.get_num_threads() == before


def test_a_sigterm_prints_where_the_main_process_was_when_asked(tmp_path):
    """A chunk killed by its timeout says which unit and call it was in (CXRDR_STACKS_ON_TERM, set by
    scripts/gpu-experiment.sh); without the variable a SIGTERM stays silent."""
    import os
    import signal
    import subprocess
    import sys

    code = ("import os, signal\nfrom cxrdr.common.errors import stacks_on_sigterm\nstacks_on_sigterm()\n"
            "def evaluating_the_run():\n    os.kill(os.getpid(), signal.SIGTERM)\nevaluating_the_run()\n")
    for asked in (True, False):
        env = {**os.environ, "CXRDR_STACKS_ON_TERM": "1"} if asked else \
            {k: v for k, v in os.environ.items() if k != "CXRDR_STACKS_ON_TERM"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == -signal.SIGTERM
        assert ("in evaluating_the_run" in done.stderr) is asked, done.stderr
