"""cxrdr.common.heap.frozen_heap: what the training loop and the build keep out of the garbage collector's walks."""
from __future__ import annotations

import gc

import pytest

from cxrdr.common.heap import frozen_heap
from tests.script_loader import load_script

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def baseline() -> int:
    """``gc.get_freeze_count()`` after a collection with nothing frozen: 0, but 375 on Python 3.12.1, which counts
    that many objects as frozen after every collection (so a count of 0 cannot tell that nothing is frozen). Read
    once: a full collection of a test worker's heap takes ~0.7 s."""
    gc.collect()
    return gc.get_freeze_count()


def given_back(unfrozen: int) -> bool:
    gc.collect()
    return gc.get_freeze_count() <= unfrozen


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_heap_keeps_what_lived_before_out_of_collections_and_collects_what_comes_after(baseline):
    kept = [Node() for _ in range(1000)]
    with frozen_heap():
        assert gc.get_freeze_count() >= baseline + 1000
        in_oldest = {id(o) for o in gc.get_objects(generation=2)}
        assert not any(id(n) in in_oldest for n in kept)  # no collection walks them
        dead = Node()
        ref = id(dead)
        del dead
        assert gc.collect() >= 1 and ref not in {id(o) for o in gc.get_objects()}  # new cycles still freed
        with frozen_heap():  # nested: the inner block leaves the freeze to the outer one
            pass
        assert gc.get_freeze_count() >= baseline + 1000
    assert given_back(baseline) and all(n.me is n for n in kept)


def test_the_heap_is_given_back_where_the_interpreter_starts_with_objects_counted_as_frozen(baseline):
    """Python 3.12.1 counts 375 objects as frozen after every collection (the ``baseline`` fixture), as a process that
    froze some before would show: the block still gives the heap back at its end (it read a count of 0 as "no block
    open" before, and on the GPU host's Python 3.12 a loop's heap stayed frozen for the rest of the process)."""
    gc.freeze()  # stands for objects counted as frozen before the block
    try:
        assert gc.get_freeze_count() > 0
        with frozen_heap():
            with frozen_heap():
                pass
            assert gc.get_freeze_count() > baseline  # the inner block left it frozen
        assert given_back(baseline)
    finally:
        gc.unfreeze()  # should the block not give it back, the worker's later tests do not inherit a frozen heap


def test_a_training_run_steps_with_its_heap_frozen_and_gives_it_back(phantom_shards, tmp_path, monkeypatch, baseline):
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer, train

    frozen = []
    real = Trainer.train_step

    def spy(self, batches, log_balance):
        frozen.append(gc.get_freeze_count())
        return real(self, batches, log_balance)

    monkeypatch.setattr(Trainer, "train_step", spy)
    train(TrainConfig(shards=str(phantom_shards), model="tiny-A", out=str(tmp_path / "run"), steps=3, batch_size=4,
                      workers=0, device="cpu", progress=False, eval_every=0))
    assert len(frozen) == 3 and min(frozen) > 10_000  # the imports, the model, the optimiser
    assert given_back(baseline)


def test_the_gc_pauses_benchmark_times_each_collection_by_generation():

    bench = load_script("benchmarks/gc_pauses.py")
    timer = bench.CollectionTimer()
    enabled = gc.isenabled()
    gc.disable()  # only the two collections asked for (not the oldest generation: the worker's whole heap)
    gc.callbacks.append(timer)
    try:
        gc.collect(1)
        gc.collect(0)
    finally:
        gc.callbacks.remove(timer)
        if enabled:
            gc.enable()
    assert [g for g, _ in timer.pauses] == [1, 0] and all(ms >= 0 for _, ms in timer.pauses)
    summary = timer.summary()
    assert summary.startswith("gen0 1 x, ") and "; gen1 1 x, " in summary
    assert summary.endswith("; gen2 0 x, 0.0 ms, longest 0.0 ms")
