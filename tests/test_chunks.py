"""A chunk's stopping rules (cxrdr/experiments/chunks.py): after its time, before a unit expected to outlast the
kill, never between a run's training and its evaluation; the first unit always runs."""
import os
import re

import pytest

from cxrdr.experiments import chunks


@pytest.fixture(autouse=True)
def no_chunk_after():
    yield
    chunks.start_chunk(None)


def test_a_chunk_stops_new_units_after_its_time_but_not_a_runs_evaluation_after_its_training(capsys):
    chunks.start_chunk(0)
    chunks.begin("train run")  # the first unit always runs
    with pytest.raises(chunks.ChunkTimeUp, match=r"after 1 unit\(s\), before: train next"):
        chunks.begin("train next")
    chunks.begin("evaluate run", follows_on=True)  # the run just trained is evaluated all the same
    # the timeline of the units that started, by process and seconds from the chunk's start (a lease's log)
    started = re.findall(r"^\[chunk (\d+) \+(\d+\.\d) s\] (.+)$", capsys.readouterr().err, re.M)
    assert [(int(pid), unit) for pid, _, unit in started] == [(os.getpid(), "train run"), (os.getpid(), "evaluate run")]
    assert all(0 <= float(t) < 60 for _, t, _ in started)


def test_a_run_expected_to_outlast_the_kill_does_not_start():
    chunks.start_chunk(1000, hard_seconds=90)
    assert chunks.expected_training_s(400, "student") is None  # nothing measured yet: the first run is not judged
    chunks.begin("train a", expected_s=None)
    chunks.measured_training(60.0, 400, "student")
    chunks.measured_training(30.0, 400, "student")  # the slowest per-step time counts
    chunks.measured_evaluation(20.0)
    assert chunks.expected_training_s(400, "student") == pytest.approx(chunks.EXPECTED_MARGIN * 60.0 + 20.0)
    assert chunks.expected_training_s(40, "student") == pytest.approx(chunks.EXPECTED_MARGIN * 6.0 + 20.0)
    # a teacher's 120 steps with their start-up (0.37 s a step in a lease) say nothing of a student's 400
    chunks.measured_training(44.4, 120, "teacher")
    assert chunks.expected_training_s(400, "student") == pytest.approx(chunks.EXPECTED_MARGIN * 60.0 + 20.0)
    assert chunks.expected_training_s(400, "online student") is None
    chunks.begin("resume b", expected_s=chunks.expected_training_s(40, "student"))  # 27.5 s fits the 90 s
    with pytest.raises(chunks.ChunkTimeUp, match=r"before: train c \(expected to take 95 s, (89|90) s left"):
        chunks.begin("train c", expected_s=chunks.expected_training_s(400, "student"))


def test_without_a_chunk_nothing_stops(capsys):
    chunks.start_chunk(None, hard_seconds=1)
    for unit in ("a", "b"):
        chunks.begin(unit, expected_s=10**6)
    assert "[chunk" not in capsys.readouterr().err  # and prints no timeline
    chunks.measured_training(1.0, 0, "student")  # a reused run trained no step: nothing to learn from it
    assert chunks.expected_training_s(10, "student") is None


def test_runs_of_one_model_and_batch_share_a_step_kind_whatever_their_mode_or_losses():
    import dataclasses

    from cxrdr.experiments.runs import step_kind
    from cxrdr.train.config import TrainConfig

    student = TrainConfig(model="tiny-D", batch_size=8, mode="plain")
    reinforced = dataclasses.replace(student, mode="reinforced", loss=dataclasses.replace(student.loss, w_feature=5.0))
    assert step_kind(reinforced) == step_kind(student)
    others = [dataclasses.replace(student, model="tiny-A"), dataclasses.replace(student, batch_size=16),
              dataclasses.replace(reinforced, online_teacher="random:tiny"),
              dataclasses.replace(student, model_overrides={"image_size": 64})]
    assert len({step_kind(c) for c in [student, *others]}) == 5
