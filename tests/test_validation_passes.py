"""Validation passes that cost what they compute: the split's batches are read from the shards once and
replayed from memory (``ReplayedBatches``), and a run that validates often need not write a checkpoint at each
pass (``save_at_eval: false``), nor fit a probe (``eval_probe``); the passes time their phases. Tiny data (the
session's phantom shards), the tiny-A student."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cxrdr.experiments.repro import is_measured
from cxrdr.train.data import ReplayedBatches

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingLoader:
    """A deterministic loader of batches of ``size`` samples that counts its passes."""

    def __init__(self, n_batches: int, size: int = 4):
        self.passes = 0
        self.data = [{"images": torch.full((size, 2), float(i)), "key": [f"{i}-{j}" for j in range(size)]}
                     for i in range(n_batches)]

    def __iter__(self):
        self.passes += 1
        yield from self.data


def _keys(batches) -> list[str]:
    return [k for b in batches for k in b["key"]]


def test_batches_are_read_once_and_replayed_the_same():
    loader = CountingLoader(3)
    replayed = ReplayedBatches(loader)
    first, second, third = list(replayed), list(replayed), list(replayed)
    assert loader.passes == 1
    assert _keys(first) == _keys(second) == _keys(third) == _keys(loader.data)
    assert all(torch.equal(a["images"], b["images"]) for a, b in zip(first, third))


def test_a_caller_that_stops_at_max_samples_still_leaves_the_batches_kept():
    loader = CountingLoader(5)
    replayed = ReplayedBatches(loader, max_samples=6)
    for _ in range(3):  # the caller's own cut-off (quick_eval.collect_embeddings breaks at max_samples)
        seen = 0
        for batch in replayed:
            seen += len(batch["key"])
            if seen >= 6:
                break
    assert loader.passes == 1
    assert _keys(replayed.batches) == _keys(loader.data[:2])  # two batches of 4 reach 6 samples
    assert _keys(replayed) == _keys(loader.data[:2])  # a caller that reads on gets no more than the cut-off


def test_a_split_over_the_memory_cap_is_streamed_every_pass():
    loader = CountingLoader(3)
    one_batch = 4 * 2 * 4  # bytes of a batch's images
    replayed = ReplayedBatches(loader, max_bytes=2 * one_batch)
    assert _keys(replayed) == _keys(loader.data)
    assert _keys(replayed) == _keys(loader.data)
    assert loader.passes == 2 and replayed.batches is None and replayed.streaming
    never = ReplayedBatches(CountingLoader(2), max_bytes=0)
    list(never), list(never)
    assert never.loader.passes == 2


def test_nested_tensors_count_against_the_cap_and_are_kept_unshared():
    """The stored teacher embeddings sit in a nested dict: their bytes count, and a worker's shared copy is
    cloned out of shared memory like the top-level tensors."""
    teacher = torch.zeros(4, 8).share_memory_()
    batch = {"images": torch.zeros(4, 2), "teacher": {"t0": {"image": teacher, "views": [teacher, teacher]}},
             "key": ["a", "b", "c", "d"]}
    top_level_bytes, all_bytes = 4 * 2 * 4, 4 * 2 * 4 + 3 * 4 * 8 * 4
    over = ReplayedBatches([batch], max_bytes=top_level_bytes + 1)  # the top level alone would fit
    list(over)
    assert over.streaming and over.batches is None
    kept = ReplayedBatches([batch], max_bytes=all_bytes)
    list(kept)
    nested = kept.batches[0]["teacher"]["t0"]
    assert not nested["image"].is_shared() and not any(v.is_shared() for v in nested["views"])
    assert isinstance(nested["views"], list) and torch.equal(nested["image"], teacher)


def test_a_pass_broken_off_early_keeps_nothing_and_the_next_pass_reads_again():
    loader = CountingLoader(3)
    replayed = ReplayedBatches(loader)
    next(iter(replayed))  # abandoned after one batch
    assert replayed.batches is None
    assert _keys(replayed) == _keys(loader.data) and loader.passes == 2
    assert _keys(replayed) == _keys(loader.data) and loader.passes == 2


def test_replayed_validation_equals_the_pass_read_from_the_shards(phantom_shards):
    from cxrdr.train.data import make_eval_loader
    from cxrdr.train.models import build_student
    from cxrdr.train.quick_eval import quick_evaluate

    torch.manual_seed(0)
    student = build_student("tiny-A")
    device = torch.device("cpu")
    streamed = quick_evaluate(student, make_eval_loader(phantom_shards, "train", student, batch_size=4), device,
                              max_samples=10)
    replayed = ReplayedBatches(make_eval_loader(phantom_shards, "train", student, batch_size=4), max_samples=10)
    first = quick_evaluate(student, replayed, device, max_samples=10)
    again = quick_evaluate(student, replayed, device, max_samples=10)
    assert replayed.batches is not None
    as_text = [json.dumps({k: v for k, v in m.items() if not is_measured(k)}, sort_keys=True)
               for m in (streamed, first, again)]  # NaN (no probe) equals itself
    assert as_text[0] == as_text[1] == as_text[2] and streamed["n_eval"] == 12  # 3 batches of 4 reach 10
    assert set(first["eval_phase_s"]) == {"embed", "retrieval", "probe"}
    assert all(s >= 0 for s in first["eval_phase_s"].values())


def test_a_pass_without_the_probe_ranks_by_retrieval_alone(phantom_shards):
    """eval_probe false (the recipes' curve passes read mean R only): no probe fitted, its phase not timed, and the
    score is retrieval's with the AUC half at chance."""
    from cxrdr.train.data import make_eval_loader
    from cxrdr.train.models import build_student
    from cxrdr.train.quick_eval import quick_evaluate

    torch.manual_seed(0)
    student = build_student("tiny-A")
    loader = ReplayedBatches(make_eval_loader(phantom_shards, "train", student, batch_size=4))
    with_probe = quick_evaluate(student, loader, torch.device("cpu"), recall_weight=0.6)
    without = quick_evaluate(student, loader, torch.device("cpu"), recall_weight=0.6, probe=False)
    assert with_probe["probe_n_labels"] >= 1 and "probe_mean_auc" not in without
    assert set(without["eval_phase_s"]) == {"embed", "retrieval"}
    assert without["mean_recall"] == with_probe["mean_recall"]
    assert without["score"] == pytest.approx(0.6 * without["mean_recall"] + 0.4 * 0.5)


def _train_recording_saves(phantom_shards, out, monkeypatch, **settings) -> tuple[dict, list]:
    from cxrdr.train import loop

    saves = []
    real_save = loop.Trainer.save

    def recording_save(self, name):
        saves.append((self.step, name))
        real_save(self, name)

    monkeypatch.setattr(loop.Trainer, "save", recording_save)
    run = dict(shards=str(phantom_shards), out=str(out), model="tiny-A", batch_size=4, device="cpu", workers=0,
               shuffle_buffer=8, log_every=1, progress=False, eval_every=2, eval_max_samples=8)
    return loop.train(dict(run, **settings)), saves


def test_validation_passes_without_checkpoints_save_every_save_every_steps_and_at_the_end(
        phantom_shards, tmp_path, monkeypatch):
    summary, saves = _train_recording_saves(phantom_shards, tmp_path / "run", monkeypatch, steps=7, save_every=4,
                                            save_at_eval=False)
    assert saves == [(4, "last.pt"), (7, "last.pt")]
    assert not (tmp_path / "run" / "best.pt").exists() and (tmp_path / "run" / "last.pt").is_file()
    passes = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "eval"]
    assert [p["step"] for p in passes] == [2, 4, 6, 7]  # every pass still validates and is logged
    assert summary["best_step"] in (2, 4, 6, 7)

    default, saves = _train_recording_saves(phantom_shards, tmp_path / "default", monkeypatch, steps=8,
                                            save_every=4)
    # the default: every pass saves; the last step's save-every is the end's one write
    assert [s for s, name in saves if name == "last.pt"] == [2, 4, 6, 8]
    assert (tmp_path / "default" / "best.pt").is_file()


def test_an_early_stop_writes_last_pt_even_where_passes_do_not_save(phantom_shards, tmp_path, monkeypatch):
    from cxrdr.train import loop

    scores = iter([0.5, 0.4, 0.3, 0.2])  # worse at every pass after the first: patience 2 stops at step 6
    monkeypatch.setattr(loop, "quick_evaluate", lambda *a, **k: {"score": next(scores)})
    summary, saves = _train_recording_saves(phantom_shards, tmp_path / "run", monkeypatch, steps=20,
                                            save_every=0, save_at_eval=False, early_stop_patience=2)
    assert summary["stopped_early"] and summary["steps"] == 6
    assert saves == [(6, "last.pt")]


def test_an_early_stop_killed_before_its_summary_resumes_to_the_same_stop(phantom_shards, tmp_path, monkeypatch):
    """The stop's last.pt holds the evaluations since the best; a resume from it stops again at once instead of
    training on past the stop (to the next pass, which stopped it again some steps later)."""
    from cxrdr.train import loop

    scores = iter([0.5, 0.4, 0.3])  # patience 2 stops at step 6
    monkeypatch.setattr(loop, "quick_evaluate", lambda *a, **k: {"score": next(scores)})
    real_summary = loop.Trainer._summary
    with monkeypatch.context() as patch:
        patch.setattr(loop.Trainer, "_summary", lambda *a: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            _train_recording_saves(phantom_shards, tmp_path / "run", monkeypatch, steps=20, save_every=0,
                                   early_stop_patience=2)
    monkeypatch.setattr(loop.Trainer, "_summary", real_summary)
    assert not (tmp_path / "run" / "summary.json").exists()
    summary, saves = _train_recording_saves(phantom_shards, tmp_path / "run", monkeypatch, steps=20, save_every=0,
                                            early_stop_patience=2, resume=True)
    assert summary["stopped_early"] and summary["steps"] == 6 and saves == []
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 6 and [r["step"] for r in records if r["kind"] == "eval"] == [2, 4, 6]


def test_on_the_cpu_the_loop_limits_only_the_probe_and_only_beside_loader_workers(phantom_shards, tmp_path,
                                                                                  monkeypatch):
    """On the CPU the pass's threads do the model's work: the loop asks for no limit on the pass, and one thread
    for its probe where loader workers are busy beside it (on a GPU one thread for all: test_host_threads.py)."""
    from cxrdr.train import loop

    asked = []

    def recording(*args, **kwargs):
        asked.append((kwargs["threads"], kwargs["probe_threads"], kwargs["probe"]))
        return {"score": 0.5}

    monkeypatch.setattr(loop, "quick_evaluate", recording)
    _train_recording_saves(phantom_shards, tmp_path / "here", monkeypatch, steps=2, workers=0)
    _train_recording_saves(phantom_shards, tmp_path / "workers", monkeypatch, steps=2, workers=1, eval_probe=False)
    assert asked == [(None, None, True), (None, 1, False)]  # one pass each (eval_every 2): the loop's settings


class Killed(Exception):
    """Stands for a process killed between two saves."""


def test_a_run_killed_between_saves_resumes_to_the_uninterrupted_run_where_passes_do_not_save(
        phantom_shards, tmp_path, monkeypatch):
    """save_at_eval false: a kill after the step-4 save and two validation passes (steps 5, 6) loses those steps
    and passes; the resumed run redoes them (its validation batches read afresh) and ends as the run never
    interrupted: the same weights, and each pass logged once with the same numbers."""
    from cxrdr.train import loop
    from cxrdr.train.checkpoint import read_checkpoint

    settings = dict(shards=str(phantom_shards), model="tiny-A", batch_size=4, device="cpu", workers=0,
                    shuffle_buffer=8, log_every=1, progress=False, steps=7, eval_every=1, eval_max_samples=8,
                    save_every=4, save_at_eval=False)
    loop.train(dict(settings, out=str(tmp_path / "ref")))
    real_step = loop.Trainer.train_step

    def killed_at_step_6(self, batches, log_balance):
        if self.step == 6:
            raise Killed()
        return real_step(self, batches, log_balance)

    monkeypatch.setattr(loop.Trainer, "train_step", killed_at_step_6)
    with pytest.raises(Killed):
        loop.train(dict(settings, out=str(tmp_path / "run")))
    monkeypatch.setattr(loop.Trainer, "train_step", real_step)
    summary = loop.train(dict(settings, out=str(tmp_path / "run"), resume=True))
    assert summary["start_step"] == 4
    ref, run = (read_checkpoint(tmp_path / name / "last.pt") for name in ("ref", "run"))
    assert all(torch.equal(ref["model"][k], run["model"][k]) for k in ref["model"])

    def passes(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        records = map(json.loads, lines)
        return [{k: v for k, v in r.items() if not is_measured(k)} for r in records if r["kind"] == "eval"]

    assert [p["step"] for p in passes("run")] == list(range(1, 8))
    assert json.dumps(passes("run"), sort_keys=True) == json.dumps(passes("ref"), sort_keys=True)


def test_kept_batches_from_a_loader_worker_hold_no_shared_memory(phantom_shards):
    """A worker's tensors arrive in shared memory (an open file each); the kept copies are the process's own."""
    from cxrdr.train.data import make_eval_loader
    from cxrdr.train.models import build_student

    student = build_student("tiny-A")
    replayed = ReplayedBatches(make_eval_loader(phantom_shards, "train", student, batch_size=4, workers=1))
    shared = [torch.is_tensor(v) and v.is_shared() for batch in replayed for v in batch.values()]
    assert any(shared)  # as the worker handed them over
    assert replayed.batches and not any(torch.is_tensor(v) and v.is_shared()
                                        for batch in replayed.batches for v in batch.values())
    again = list(replayed)
    assert [b["key"] for b in again] == [b["key"] for b in replayed.batches]


def test_an_inference_pass_casts_the_weights_once_not_per_batch():
    """collect_embeddings runs its batches in one autocast region, where the weights' casts are cached: three
    batches cast no more than one batch does plus the activations of two more (counted by
    benchmarks/dispatch_count.py --inference-casts)."""
    import sys
    from pathlib import Path

    from cxrdr.train.models import StudentConfig, build_student

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import dispatch_count

    torch.manual_seed(0)
    model = build_student(StudentConfig.from_yaml("tiny-A"))
    one, three = (dispatch_count.inference_casts(model, 2, n) for n in (1, 3))
    weights = sum(1 for p in model.parameters() if p.ndim == 2)  # at least the linear layers' weights
    assert three <= 3 * one - 2 * weights  # per-batch regions would cast every weight again: 3 * one


def test_a_pass_or_its_probe_asked_for_one_thread_runs_on_one_and_gives_the_threads_back(monkeypatch):
    """A validation pass on a GPU host runs its host work on one torch and one BLAS thread; a CPU run's probe beside
    busy workers runs on one alone, with the same figures; the process's settings are back after either."""
    from threadpoolctl import threadpool_info

    import cxrdr.train.quick_eval as quick_eval

    before = (torch.get_num_threads(), [pool["num_threads"] for pool in threadpool_info()])
    seen = []

    def threads_seen(*args, **kwargs):
        seen.append((torch.get_num_threads(), {pool["num_threads"] for pool in threadpool_info()}))

    real_probe = quick_eval.linear_probe
    monkeypatch.setattr(quick_eval, "linear_probe", lambda *a, **k: threads_seen() or real_probe(*a, **k))
    rng = np.random.default_rng(0)
    emb, labels = rng.normal(size=(40, 8)).astype(np.float32), (rng.random((40, 14)) < 0.3).astype(np.float32)
    subjects = [f"s{i}" for i in range(40)]
    one, every = quick_eval.quick_probe(emb, labels, subjects, threads=1), quick_eval.quick_probe(emb, labels, subjects)
    assert one["n_labels"] >= 5 and one["mean_auc"] == pytest.approx(every["mean_auc"], abs=1e-9)
    assert seen == [(1, {1}), (before[0], set(before[1]))]

    seen.clear()
    monkeypatch.setattr(quick_eval, "_quick_evaluate", lambda *a: threads_seen() or {"score": 0.5})
    assert quick_eval.quick_evaluate(None, None, "cpu", threads=1) == {"score": 0.5}
    assert quick_eval.quick_evaluate(None, None, "cpu") == {"score": 0.5}
    assert seen == [(1, {1}), (before[0], set(before[1]))]
    assert (torch.get_num_threads(), [pool["num_threads"] for pool in threadpool_info()]) == before
