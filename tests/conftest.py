"""Shared test fixtures: small, generated data; the real shared data only where present."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Up to 2 threads in all: under pytest-xdist (`make test` runs 2 workers) one each, as two OpenMP
# threads per process on a 2-core box spin-wait against the other worker.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

# The longest files first (`pytest --durations=0` on a 2-core box): `make test` deals whole files to its 2 workers in
# collection order (--dist loadfile --no-loadscope-reorder; xdist's own order, files with the most tests first, left
# the workers 216 and 194 s of tests, and the shorter one idle at the end; in this order 211 and 205 s). Files not
# named keep their order after these.
LONGEST_FIRST = ("test_ray_engine.py", "test_step_syncs.py", "test_build.py", "test_experiments.py", "test_resume.py",
                 "test_device_carry.py", "test_gpu_experiment.py", "test_chaos.py", "test_train.py",
                 "test_gpu_suite.py", "test_packaging.py", "test_reproducible.py", "test_faults.py", "test_openclip.py",
                 "test_block_graphs.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("CXRDR_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data (real CXR data); tests using it skip when it is absent, as outside users lack it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not present at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def phantom_shards(tmp_path_factory) -> Path:
    """Small phantom shards built once per session (tests.test_data.build_phantom_shards)."""
    from tests.test_data import build_phantom_shards

    return build_phantom_shards(str(tmp_path_factory.getbasetemp()))


@pytest.fixture()
def one_thread():
    """Training tests: the test machine's 2 cores are shared, one thread is faster than two contending."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
