"""Finished runs carried from one GPU lease to the next (cxrdr/experiments/carry.py): what is packed, what is refused,
and that the experiment then takes a carried run as finished and its evaluation as made, training nothing."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from cxrdr.common.errors import UserError
from cxrdr.experiments import runs
from cxrdr.experiments.carry import (CARRIED, MANIFEST, CarryError, finished_run, main, pack_runs, unpack_runs)
from cxrdr.train.config import TrainConfig

RUN = "efficiency/runs/plain/seed-10"


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def _finished(root: Path, run: str, evaluated_after: bool = True) -> dict[str, bytes]:
    """A run folder trained (summary, config, checkpoint) and evaluated (after its checkpoint, or before)."""
    files = {f"{run}/config.yaml": b"steps: 2\n", f"{run}/summary.json": b'{"steps": 2}',
             f"{run}/metrics.jsonl": b'{"kind": "eval", "step": 2}\n', f"{run}/eval-report/eval.json": b'{"a": 1}',
             f"{run}/eval-report/eval_request.json": b'{"split": "test"}', f"{run}/eval-report/eval.md": b"# a"}
    _write(root, files)
    _write(root, {f"{run}/last.pt": b"weights", f"{run}/best.pt": b"weights",
                  f"{run}/eval-report/heatmaps.png": b"png", f"{run}/.cxrdr.lock": b"1"})
    later = time.time() + (10 if evaluated_after else -10)
    for name in ("eval.json", "eval_request.json"):
        os.utime(root / run / "eval-report" / name, (later, later))
    return files


def test_pack_keeps_the_runs_trained_and_evaluated_and_only_their_text_files(tmp_path):
    root = tmp_path / "lease1"
    files = _finished(root, RUN)
    _finished(root, "efficiency/runs/reinforced/seed-10", evaluated_after=False)  # weights newer than its eval
    _write(root, {"efficiency/runs/plain/seed-11/config.yaml": b"a", "efficiency/runs/plain/seed-11/last.pt": b"w",
                  "efficiency/runs/plain/seed-12/summary.json": b"{}",  # trained, not evaluated
                  "efficiency/runs/plain/seed-12/config.yaml": b"a", "efficiency/runs/plain/seed-12/last.pt": b"w",
                  "teachers/lite2-s1/run/summary.json": b"{}", "shards/dataset.json": b"{}"})
    assert not finished_run(root / "efficiency/runs/reinforced/seed-10")
    archive = tmp_path / "carry.tar.gz"
    assert pack_runs(root, archive, "lease one") == [RUN]
    with tarfile.open(archive) as tar:
        assert set(tar.getnames()) == {MANIFEST, *files}  # no checkpoint, plot or lock; no other folder
        manifest = json.load(tar.extractfile(MANIFEST))
    assert manifest["label"] == "lease one" and manifest["runs"] == [RUN]
    assert pack_runs(tmp_path / "empty", tmp_path / "none.tar.gz", "x") == []
    assert not (tmp_path / "none.tar.gz").exists()  # nothing finished: no archive

    there = tmp_path / "lease2"
    _write(there, {f"{RUN}/stale.txt": b"an interrupted try of the same run, without weights"})
    assert unpack_runs(archive, there) == [RUN]
    assert {p.relative_to(there).as_posix() for p in there.rglob("*") if p.is_file()} == {*files, f"{RUN}/{CARRIED}"}
    assert all((there / name).read_bytes() == data for name, data in files.items())
    assert json.loads((there / RUN / CARRIED).read_text())["from"] == "lease one"
    assert finished_run(there / RUN)  # carried, evaluated: packed again by the lease after (the archive grows)
    assert pack_runs(there, tmp_path / "again.tar.gz", "lease two") == [RUN]
    assert unpack_runs(tmp_path / "again.tar.gz", tmp_path / "lease4") == [RUN]
    assert json.loads((tmp_path / "lease4" / RUN / CARRIED).read_text())["from"] == "lease one"  # where it trained

    own = tmp_path / "lease3"  # a machine that trained the run itself keeps its own
    _write(own, {f"{RUN}/last.pt": b"mine", f"{RUN}/summary.json": b"{}"})
    assert unpack_runs(archive, own) == []
    assert not (own / RUN / CARRIED).exists() and (own / RUN / "summary.json").read_bytes() == b"{}"


class Killed(BaseException):
    """Stands for the process dying at that instant (no ``except Exception`` catches it)."""


def test_an_unpack_killed_midway_leaves_the_run_as_it_was_and_the_next_unpack_carries_it_whole(tmp_path,
                                                                                              monkeypatch):
    files = _finished(tmp_path / "lease1", RUN)
    archive = tmp_path / "carry.tar.gz"
    pack_runs(tmp_path / "lease1", archive, "lease one")
    there = tmp_path / "lease2"
    _write(there, {f"{RUN}/stale.txt": b"an interrupted try of the same run, without weights"})
    real_write, written = Path.write_bytes, []

    def dies_at_the_third_file(path, data):
        written.append(path)
        if len(written) == 3:
            raise Killed()
        return real_write(path, data)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_bytes", dies_at_the_third_file)
        with pytest.raises(Killed):
            unpack_runs(archive, there)
    # a summary.json without its evaluation would read as a finished run whose evaluation cannot be made
    assert [p.name for p in (there / RUN).iterdir()] == ["stale.txt"]
    assert unpack_runs(archive, there) == [RUN]
    assert {p.relative_to(there).as_posix() for p in there.rglob("*") if p.is_file()} == {*files, f"{RUN}/{CARRIED}"}
    assert finished_run(there / RUN)


def test_a_pack_killed_midway_leaves_the_archive_before(tmp_path, monkeypatch):
    """A lease's call packs its runs last, where its time limit kills: what it leaves is the archive as it was."""
    root = tmp_path / "lease"
    _finished(root, RUN)
    archive = tmp_path / "out" / "carry.tar.gz"
    pack_runs(root, archive, "call one")
    before = archive.read_bytes()
    _finished(root, "efficiency/runs/plain/seed-11")
    real_add, added = tarfile.TarFile.add, []

    def dies_at_the_third_file(self, *args, **kwargs):
        added.append(args)
        if len(added) == 3:
            raise Killed()
        return real_add(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(tarfile.TarFile, "add", dies_at_the_third_file)
        with pytest.raises(Killed):
            pack_runs(root, archive, "call two")
    assert archive.read_bytes() == before and [p.name for p in archive.parent.iterdir()] == ["carry.tar.gz"]
    assert pack_runs(root, archive, "call two") == [RUN, "efficiency/runs/plain/seed-11"]


def _archive(path: Path, runs_named: list[str], members: dict[str, bytes], link: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {MANIFEST: json.dumps({"label": "x", "runs": runs_named}).encode(), **members}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
    return path


@pytest.mark.parametrize("runs_named, members, link, named", [
    ([RUN], {f"{RUN}/../../../../evil.json": b"x"}, None, "evil.json"),
    ([RUN], {f"/{RUN}/summary.json": b"{}"}, None, f"'/{RUN}/summary.json'"),  # absolute
    ([RUN], {"shards/dataset.json": b"{}"}, None, "shards/dataset.json"),  # a finished build it is not
    ([RUN], {"efficiency/runs/plain/seed-11/summary.json": b"{}"}, None, "seed-11"),  # not a packed run
    ([RUN], {f"{RUN}0/summary.json": b"{}"}, None, "seed-100"),
    ([RUN], {}, f"{RUN}/eval.json", "eval.json"),  # a link
    (["../runs/plain/seed-10"], {}, None, "../runs/plain/seed-10"),
])
def test_unpack_refuses_what_would_land_outside_a_packed_run_folder(tmp_path, runs_named, members, link, named):
    archive = _archive(tmp_path / "bad.tar.gz", runs_named, members, link)
    target = tmp_path / "recipe"
    with pytest.raises(CarryError, match=named.replace(".", r"\.")):
        unpack_runs(archive, target)
    assert not target.exists() and not (tmp_path / "evil.json").exists()
    assert main(["unpack", str(archive), str(target)]) == 1


def test_unpack_of_an_archive_not_packed_here_says_so(tmp_path):
    path = tmp_path / "other.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("a.json"), io.BytesIO(b""))
    with pytest.raises(CarryError, match="no carried-runs.json"):
        unpack_runs(path, tmp_path / "recipe")


def test_a_carried_run_is_finished_and_its_evaluation_reused_where_the_recipe_asks_the_same(phantom_shards, tmp_path,
                                                                                             monkeypatch):
    """run_training reuses a carried run of the same config (nothing trained), evaluate_run its evaluation (nothing
    evaluated); one asked with other evaluation options cannot be redone without weights and says so."""
    run_dir = tmp_path / "recipe" / RUN
    cfg = TrainConfig(shards=str(phantom_shards), model="tiny-A", out=str(run_dir), steps=2, batch_size=4)
    recipe = {"shards": {"dir": str(phantom_shards)}, "eval": {"split": "test", "n_plots": 2, "efficiency": False}}
    eval_dir, request, _ = runs.evaluation_request(recipe, run_dir, phantom_shards, False)
    _write(run_dir, {"config.yaml": yaml.safe_dump(cfg.to_dict()).encode(), "summary.json": b'{"steps": 2}',
                     f"{eval_dir.name}/eval.json": json.dumps({"summary": {"mean_recall": 0.5}}).encode(),
                     f"{eval_dir.name}/eval_request.json": json.dumps(request).encode()})
    assert runs.run_state(run_dir, cfg) == "todo"  # no weights, not carried: trained again
    (run_dir / CARRIED).write_text(json.dumps({"from": "lease one"}))

    def refuse(*args, **kwargs):
        raise AssertionError("a carried run was trained or evaluated again")

    monkeypatch.setattr(runs, "train", refuse)
    monkeypatch.setattr(runs, "evaluate", refuse)
    assert runs.run_state(run_dir, cfg) == "done" and not runs.unfinished_alike(run_dir, cfg)
    # the CUDA graphs replay the eager step: a run trained with them is the run asked for without them, and back
    for graphs in ({"cuda_graphs": "off"}, {"cuda_graphs_text": "off"},
                   {"cuda_graphs": "on", "cuda_graphs_text": "on"}):
        assert runs.run_state(run_dir, dataclasses.replace(cfg, **graphs)) == "done", graphs
    assert runs.run_state(run_dir, dataclasses.replace(cfg, steps=3)) == "todo"  # what is trained still counts
    assert runs.run_training(cfg, reuse=True, resume=True)["reused"] is True
    assert runs.evaluation_done(recipe, run_dir, phantom_shards, False)
    assert runs.evaluate_run(recipe, run_dir, phantom_shards, False)["summary"]["mean_recall"] == 0.5
    other = {**recipe, "eval": {**recipe["eval"], "n_plots": 3}}
    assert not runs.evaluation_done(other, run_dir, phantom_shards, False)
    with pytest.raises(UserError, match="carried from 'lease one' without its weights.*remove the folder"):
        runs.evaluate_run(other, run_dir, phantom_shards, False)


def test_the_results_name_the_carried_runs_and_the_lease_that_trained_them():
    from cxrdr.experiments.carry import carried_note

    assert carried_note({"plain": [{"seed": 10, "carried": None}]}) is None
    note = carried_note({"plain": [{"seed": 10, "carried": {"from": "lease A"}}, {"seed": 11, "carried": None}],
                         "reinforced": [{"seed": 10, "carried": {"from": "lease A"}},
                                        {"seed": 11, "carried": {"from": "lease B"}}]})
    assert "plain seed 10, reinforced seed 10 from 'lease A'; reinforced seed 11 from 'lease B'" in note


@pytest.mark.parametrize("archive,recipe_file", [("gpu-probe-carry.tar.gz", "gpu-efficiency-probe.yaml"),
                                                 ("gpu-recipe-carry.tar.gz", "gpu-efficiency.yaml")])
def test_every_committed_carried_run_is_done_for_its_recipe_as_it_stands(tmp_path, monkeypatch, archive, recipe_file):
    """The committed carries hold GPU leases' finished runs without their weights: a change to what a run's config
    holds (a field added, a default moved) or to its evaluation request would turn them into runs to train and
    evaluate again, minutes of the next lease. Each must still be done, its evaluation reused, for the recipe as it
    stands (a status listing's view: nothing is built)."""
    from cxrdr.experiments.carry import unpack_runs
    from cxrdr.experiments.efficiency import arm_plan, runs_in_turn
    from cxrdr.experiments.recipe_file import load_recipe, recipe_out

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)  # the recipes' folders are relative: their runs land here
    recipe = load_recipe(repo / "configs" / "experiments" / recipe_file)
    out = Path(recipe_out(recipe))
    carried = unpack_runs(repo / "docs" / "results" / archive, out)
    shards = Path(recipe["shards"]["dir"])
    arm_runs, _, _ = arm_plan(recipe, shards, out / "efficiency", build=False)
    planned = {Path(cfg.out): (cfg, first) for _, _, cfg, first in runs_in_turn(arm_runs)}
    assert carried and all(out / run in planned for run in carried), (carried, list(planned))
    for run in carried:
        cfg, first = planned[out / run]
        assert runs.run_state(out / run, cfg) == "done", run
        assert runs.evaluation_done(recipe, out / run, shards, recipe.get("isolated_efficiency", False), first), run
