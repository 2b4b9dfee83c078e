"""Issue 36: the GPU efficiency recipe (configs/experiments/gpu-efficiency.yaml) and its CPU-size twin.

The GPU recipe cannot run here; its twin (the same keys, tiny sizes) runs end to end through the Python entry
scripts/gpu-experiment.sh calls, in chunks, with an interrupted run resumed, so the recipe cannot rot between
GPU sessions. The GPU file itself is checked against the issue's structure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "configs" / "experiments" / "gpu-efficiency.yaml"
TWIN = ROOT / "configs" / "experiments" / "gpu-efficiency-twin.yaml"
PROBE = ROOT / "configs" / "experiments" / "gpu-efficiency-probe.yaml"
SCRIPT = ROOT / "scripts" / "gpu-experiment.sh"


def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


def _plain_runs(recipe):
    from cxrdr.experiments.efficiency import arm_plan

    arm_runs, options, timed_only = arm_plan(recipe, Path(recipe["shards"]["dir"]), Path("unused"), build=False)
    return arm_runs, options, timed_only


def test_the_gpu_recipe_has_the_issues_structure():
    from cxrdr.experiments.recipe_file import load_recipe
    from cxrdr.experiments.teacher_prep import teacher_plans
    from cxrdr.train.models.config import StudentConfig

    recipe = load_recipe(GPU)
    assert recipe["device"] == "cuda" and recipe["resume_runs"] is True
    students = recipe["shards"]["build"]
    assert students["source"].startswith("phantom:") and int(students["source"].split(":")[1]) >= 20000
    # every set its own draw at 224 px: students, the teacher's, the report set
    seeds = {"students": students["source_options"]["seed"]}
    report = recipe["report"]["shards"]["build"]
    assert recipe["report"]["split"] == "test" and report["source_options"]["split"] == "test"
    seeds["report"] = report["source_options"]["seed"]
    plans = teacher_plans(recipe, "efficiency")
    assert len(plans) == 1
    (name, plan), = plans.items()
    seeds["teacher"] = plan["shards"]["build"]["source_options"]["seed"]
    assert len(set(seeds.values())) == 3, seeds
    for build in (students, report, plan["shards"]["build"]):
        assert build["source_options"]["size"] == 224 and build["store_size"] >= 224
    assert recipe["selection"]["split"] == "val" and recipe["efficiency"]["curve_split"] == "report"
    # teacher: towers that start pretrained (ImageNet Lite2, MiniLM; a ViT-B/16 from scratch did not learn in the
    # lease), plain CLIP on its own set with D's heads, judged on the report set, stored
    teacher = StudentConfig.from_yaml(plan["cfg"].model, **plan["cfg"].model_overrides)
    assert (teacher.image_tower, teacher.image_size, teacher.text_tower) == ("efficientnet_lite2", 224, "minilm")
    assert teacher.variant == "D" and teacher.image_kwargs.get("pretrained", True)
    assert plan["cfg"].mode == "plain" and "report" in plan["evaluate"]
    assert recipe["efficiency"]["train"]["teachers"] == plan["shard_name"]
    # arms and seeds; every trained arm a ViT-S/16 + MiniLM student (the same pretrained text tower)
    arm_runs, options, timed_only = _plain_runs(recipe)
    assert {a: len(r) for a, r in arm_runs.items()} == {"plain": 5, "reinforced": 5, "plain-total-samples": 3}
    assert timed_only == {"online"} and options["online"]["online_teacher"] == f"ckpt:{plan['ckpt']}"
    for runs in arm_runs.values():
        for _, cfg in runs:
            student = StudentConfig.from_yaml(cfg.model, **cfg.model_overrides)
            assert (student.image_tower, student.image_size, student.text_tower) == ("vit_small_patch16", 224,
                                                                                     "minilm")
    plain = arm_runs["plain"][0][1]
    budget = plain.steps * plain.batch_size * plain.accum_steps
    teacher_samples = plan["cfg"].steps * plan["cfg"].batch_size * plan["cfg"].accum_steps
    total = arm_runs["plain-total-samples"][0][1]
    assert total.steps * total.batch_size == budget + teacher_samples
    # the crossing is read from measured points <= 5 % of plain's budget apart, for every arm
    for runs in arm_runs.values():
        for _, cfg in runs:
            assert cfg.eval_every and cfg.eval_every * cfg.batch_size * cfg.accum_steps <= 0.05 * budget
            assert cfg.eval_shards == recipe["report"]["shards"]["dir"]
    # the header says how it was sized and that the first GPU run must re-check it
    header = GPU.read_text().split("\nname:")[0]
    assert "SIZING" in header and "re-check" in header


def test_the_gpu_recipe_trains_its_arms_seed_by_seed_so_a_recipe_cut_short_holds_paired_seeds(tmp_path,
                                                                                             monkeypatch):
    """The arms' first seeds, then their second seeds...: a lease that ends part-way leaves plain and reinforced
    runs of the same seeds (not five plain runs and no reinforced one); the status listing shows that order."""
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app
    from cxrdr.experiments.efficiency import runs_in_turn

    arms = {"plain": [(10, "p10"), (11, "p11"), (12, "p12")], "reinforced": [(10, "r10"), (11, "r11"), (12, "r12")],
            "plain-total-samples": [(10, "t10")]}
    assert [(name, seed, first) for name, seed, _, first in runs_in_turn(arms)] == [
        ("plain", 10, True), ("reinforced", 10, True), ("plain-total-samples", 10, True), ("plain", 11, False),
        ("reinforced", 11, False), ("plain", 12, False), ("reinforced", 12, False)]
    monkeypatch.chdir(tmp_path)  # the recipe's relative folders: none exists here, nothing is built by a listing
    listing = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(GPU), "--quiet", "--status"])
    assert listing.exit_code == 3, listing.output
    order = [line.split(":")[0].split(None, 1)[1] for line in listing.output.splitlines() if ": training" in line
             and " seed " in line]
    assert order[:4] == ["plain seed 10", "reinforced seed 10", "plain-total-samples seed 10", "plain seed 11"]
    assert not any(tmp_path.iterdir())


def test_the_twin_is_the_same_recipe_key_for_key():
    gpu, twin = (dict(_leaves(yaml.safe_load(p.read_text()))) for p in (GPU, TWIN))
    assert set(gpu) == set(twin)
    # the same arms, options and structure; sizes, devices and paths differ
    for key in ("resume_runs", "reuse_runs", "selection.split", "report.split", "efficiency.curve_split",
                "efficiency.runs.plain-total-samples.plus_teacher_samples", "efficiency.runs.online.step_benchmark_only",
                "efficiency.train.teachers", "efficiency.train.loss.lambda_distill", "teachers.train.loss.use_syn"):
        assert gpu[key] == twin[key], key


def test_the_rehearsal_is_the_twin_with_the_gpu_recipes_models_and_image_sizes(tmp_path, monkeypatch):
    """scripts/rehearse_gpu_recipe.py: the GPU recipe's students, teacher and sizes at the twin's counts, every path
    under its own folder; the recipe loads and lists its units without writing anything else."""
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app
    from cxrdr.experiments.recipe_file import load_recipe

    script = load_script("scripts/rehearse_gpu_recipe.py")
    out = tmp_path / "rehearsal"
    assert script.main(["--out", str(out), "--write-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]
    (out / "kept").write_text("x")
    assert script.main(["--out", str(out), "--write-only"]) == 0  # an earlier rehearsal's folder is replaced
    assert not (out / "kept").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert script.main(["--out", str(other), "--write-only"]) == 2  # anything else is left alone
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    gpu, twin, rehearsal = (dict(_leaves(yaml.safe_load(p.read_text()))) for p in (GPU, TWIN, out / "recipe.yaml"))
    assert set(rehearsal) == set(twin)
    for key, value in rehearsal.items():
        if key.endswith((".model", ".size", ".store_size", ".workers")) or (
                ".model_overrides." in key and "steps" not in key):
            assert value == gpu[key], key  # the GPU recipe's models, heads, sizes and workers
        elif isinstance(value, str) and str(out) in value:
            assert key.endswith("dir") or key in ("out", "efficiency.runs.online.online_teacher"), key
        elif key not in ("name", "threads"):
            assert value == twin[key], key  # the twin's counts, devices and options
    assert not any("gpu-efficiency-twin" in str(v) for v in rehearsal.values())  # no path left in the twin's folders
    assert rehearsal["train.model"] == "D" and rehearsal["shards.build.store_size"] == 224
    report = {k.rsplit(".", 1)[1]: v for k, v in rehearsal.items() if k.startswith("report.shards.build.")}
    report_shards = int(report["source"].split(":")[1]) / report["shard_size"]
    assert report["workers"] > report_shards  # more workers than shards, as on the GPU
    assert rehearsal["train.model_overrides.k_anneal_steps"] == twin["train.model_overrides.k_anneal_steps"]
    assert load_recipe(out / "recipe.yaml")["out"] == str(out)
    monkeypatch.chdir(tmp_path)
    listing = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(out / "recipe.yaml"), "--quiet",
                                       "--status"])
    assert listing.exit_code == 3, listing.output
    assert sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]
    # --probe: the val probe's own keys over the rehearsal, its runs beside the rehearsal's
    assert script.main(["--out", str(out), "--write-only", "--probe"]) == 0
    probe = load_recipe(out / "probe.yaml")
    assert probe["_extends"] == [str((out / "recipe.yaml").resolve())] and probe["out"] == str(out / "probe")
    assert probe["train"]["model"] == "D" and probe["efficiency"]["seeds"] == [0]
    assert probe["efficiency"]["runs"]["reinforced-kl-only"]["loss"] == {"w_affinity": 0.0, "w_feature": 0.0}


class Killed(Exception):
    """Stands for a command killed in the middle of a run."""


def test_the_twin_runs_end_to_end_in_chunks_and_resumes_an_interrupted_run(tmp_path, monkeypatch, one_thread):
    """The chunked flow scripts/gpu-experiment.sh drives, on the twin: status, one unit per command, a command
    killed inside the teacher's training, the rest, and the results (every arm by one crossing rule, the
    teacher on the report set, heatmaps on report-set images, per-seed curves)."""
    from typer.testing import CliRunner

    from cxrdr.cli import train_app as app
    from cxrdr.train.loop import Trainer

    monkeypatch.chdir(tmp_path)  # the twin's paths are relative: they land here
    recipe = yaml.safe_load(TWIN.read_text())
    out = Path(recipe["out"]) / "efficiency"
    args = ["experiment", "efficiency", "--config", str(TWIN), "--quiet"]

    def invoke(*extra):
        return CliRunner().invoke(app, args + list(extra))

    first = invoke("--status")
    assert first.exit_code == 3 and " 0 of " in first.output and "todo     students' shards" in first.output
    # a chunk with no time does one unit, then stops cleanly with work left (its first unit runs whatever the kill)
    chunk = invoke("--chunk-s", "0", "--chunk-hard-s", "0")
    assert chunk.exit_code == 3, chunk.output + repr(chunk.exception)
    assert "done     students' shards" in chunk.output and " 1 of " in chunk.output
    # the build's throughput and time split in the log (a lease's log comes back where its files may not)
    assert re.search(r"\[shards\] \S+: throughput [\d.]+ samples/s .*time split \(s\): decode_augment", chunk.output)
    students = Path(recipe["shards"]["dir"]) / "dataset.json"
    built = json.loads(students.read_text())["build"]  # add-teacher rewrites dataset.json, not its build record

    real_step = Trainer.train_step

    def killed_at_step_1(self, batches, log_balance):
        if self.cfg.out.endswith(os.path.join("lite2-s1", "run")) and self.step == 1:  # last.pt saved at step 1
            raise Killed()
        return real_step(self, batches, log_balance)

    monkeypatch.setattr(Trainer, "train_step", killed_at_step_1)
    dead = invoke()
    assert isinstance(dead.exception, Killed)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    status = invoke("--status")
    assert "partial  teacher lite2-s1: training" in status.output and "continues it" in status.output
    early = invoke("--partial")  # a lease that ended here: nothing to report, and nothing is run to make it
    assert early.exit_code != 0 and "no partial results yet: 'report set' is not done" in str(early.exception)
    assert not (out / "partial").exists()

    said = []
    for _ in range(12):  # one unit a command, until plain's first seed is trained and evaluated
        step = invoke("--chunk-s", "0")
        said.append(step.output)
        assert step.exit_code == 3, step.output + repr(step.exception)
        if "done     plain seed 10: training" in step.output:
            break
    # add-teacher's time and where it went, in the log
    assert re.search(r"\[teachers\] add-teacher lite2-s1: [\d.]+ s; time split \(s\): loader_wait [\d.]+, embed "
                     r"[\d.]+, write_wait [\d.]+, write [\d.]+", "".join(said)), said
    # the command that trained it evaluated it too, past its time (a trained run without its evaluation would not
    # travel to the next lease)
    assert "done     plain seed 10: evaluation" in step.output, step.output
    assert "todo     reinforced seed 10: training" in step.output  # the arms' seeds in turn: reinforced next
    # where the validation passes spent their time (no probe in the recipe's passes)
    assert re.search(r"plain seed 10: training .* validation passes [\d.]+ s \(embed [\d.]+ s, retrieval [\d.]+ s\)",
                     step.output), step.output
    # and the evaluation's phases (a GPU host's evaluation that outlasted its chunk said nothing of them)
    assert re.search(r"done     plain seed 10: evaluation +[\d.]+ s +load [\d.]+ s, embed [\d.]+ s, retrieval",
                     step.output), step.output
    import cxrdr.experiments.runs as runs_module
    import cxrdr.experiments.teacher_prep as teacher_module

    def refuse(*args, **kwargs):
        raise AssertionError("a partial report trained, evaluated, built or embedded something")

    with monkeypatch.context() as m:  # what a lease that ended here brings back: read, not run
        for module, name in ((runs_module, "train"), (runs_module, "evaluate"), (runs_module, "_build_shards"),
                             (teacher_module, "evaluate"), (teacher_module, "add_teachers")):
            m.setattr(module, name, refuse)
        fresh = invoke("--partial", "--fresh")
        assert fresh.exit_code != 0 and "leave out --fresh" in str(fresh.exception)
        careless = tmp_path / "careless.yaml"  # a recipe that would retrain and rebuild: read all the same
        careless.write_text(yaml.safe_dump({**recipe, "reuse_runs": False,
                                            "shards": {**recipe["shards"], "rebuild": True}}))
        part = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(careless), "--quiet", "--partial"])
    assert part.exit_code == 0, part.output + repr(part.exception)
    partial = json.loads((out / "partial" / "results.json").read_text())
    assert partial["partial"]["finished"] == {"plain": [10]}
    assert partial["partial"]["left"] == {"reinforced": [10], "plain-total-samples": [10]}
    assert list(partial["arms"]) == ["plain"] and partial["bench_step_ms"] == {}
    assert (out / "partial" / "table.md").read_text().startswith("**Partial results**: 1 of 3 runs finished")
    assert partial["partial"]["note"].endswith(
        "Figures over fewer seeds than the recipe names: not the recipe's result.")
    assert not (out / "runs" / "reinforced" / "seed-10" / "last.pt").exists()  # nothing trained for it
    assert not (out / "results.json").exists()

    done = invoke()
    assert done.exit_code == 0, done.output + repr(done.exception)
    assert json.loads(students.read_text())["build"] == built  # reused, not rebuilt
    teacher_run = Path(recipe["teachers"]["dir"]) / "lite2-s1" / "run"
    assert json.loads((teacher_run / "summary.json").read_text())["start_step"] == 1  # resumed, not restarted
    final = invoke("--status")
    assert final.exit_code == 0 and " 0 left" in final.output, final.output
    assert not (out / "partial").exists()  # the recipe's own results replace the partial report

    data = json.loads((out / "results.json").read_text())
    assert [r["run"] for r in data["table"]] == ["plain", "reinforced", "plain-total-samples", "online"]
    runs = {a: data["runs"][a][0]["train_config"] for a in ("plain", "reinforced", "plain-total-samples")}
    teacher_samples = recipe["teachers"]["train"]["steps"] * recipe["teachers"]["train"]["batch_size"]
    assert runs["plain-total-samples"]["steps"] * 8 == runs["plain"]["steps"] * 8 + teacher_samples
    assert runs["plain"]["model"] == runs["reinforced"]["model"] == "tiny-D"
    for arm in ("plain", "reinforced", "plain-total-samples"):  # one crossing rule for every arm
        crossing = data["arms"][arm]["crossing"]
        assert crossing["rule"].startswith("first crossing") and crossing["target"] == data["arms"]["plain"][
            "plain_final_target"]
    assert set(data["bench_step_ms"]) >= {"plain", "reinforced", "online"}
    teacher = data["teachers"]["lite2-s1"]
    assert {"mean_recall", "pointing_z", "pointing_attn"} <= set(teacher["report"])
    assert (out / "runs" / "reinforced" / "seed-10" / "eval-report" / "heatmaps.png").is_file()
    # every evaluation ran on the recipe's device (a GPU host's ran on its CPU cores before)
    evals = [out / "runs" / "reinforced" / "seed-10" / "eval-report", teacher_run / "eval-report-test"]
    assert [json.loads((d / "eval.json").read_text())["meta"]["device"] for d in evals] == ["cpu", "cpu"]
    for name in ("metric_vs_samples.png", "metric_vs_samples_per_seed.png", "table.md"):
        assert (out / name).is_file(), name
    assert "report PG z" in (out / "table.md").read_text()
    judged = [b["bar"] for b in data["bars"]]  # issue 36's bars, as the recipe states them
    assert any("<= 1/4 of plain's samples" in b and "<= 0.333" in b for b in judged)
    assert sum("reinforced pointing_" in b and "train-box prior >= 0.15" in b for b in judged) == 2

    # the val probe of the distillation settings (gpu-efficiency-probe.yaml), its own keys laid over the twin: it
    # reuses the recipe's set-up and reads the students' val split only
    from cxrdr.experiments.recipe_file import load_recipe

    probe, spec = tmp_path / "twin-probe.yaml", yaml.safe_load(PROBE.read_text())
    assert spec["extends"] == "gpu-efficiency"
    probe.write_text(yaml.safe_dump({**spec, "extends": str(TWIN)}, sort_keys=False))
    arm_runs = _plain_runs(load_recipe(probe))[0]
    assert list(arm_runs) == ["plain", "reinforced", "plain-lr-0.00025", "plain-lr-0.001", "reinforced-kl-only",
                              "reinforced-weights-5", "reinforced-lambda-0.5", "reinforced-lambda-0.5-weights-5"]
    configs = [cfg for runs in arm_runs.values() for _, cfg in runs]
    assert {(c.seed, c.eval_split, c.eval_shards) for c in configs} == {(0, "val", None)}
    assert {(c.loss.lambda_distill, c.loss.w_affinity, c.loss.w_feature) for c in configs if c.mode == "reinforced"} \
        == {(1.0, 50.0, 50.0), (1.0, 0.0, 0.0), (1.0, 5.0, 5.0), (0.5, 50.0, 50.0), (0.5, 5.0, 5.0)}
    assert sorted(c.optim.lr for c in configs if c.mode == "plain") == [0.00025, 0.0005, 0.001]
    # run end to end with two of its arms (each arm's run is a run like the recipe's; the test's time is short)
    spec["efficiency"]["runs"].update(dict.fromkeys(list(arm_runs)[1:-1]))  # null: an arm left out
    probe.write_text(yaml.safe_dump({**spec, "extends": str(TWIN)}, sort_keys=False))
    ran = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(probe), "--quiet"])
    assert ran.exit_code == 0, ran.output + repr(ran.exception)
    assert json.loads(students.read_text())["build"] == built  # the recipe's shards, teacher and embeddings reused
    assert json.loads((teacher_run / "summary.json").read_text())["start_step"] == 1
    probed = json.loads((Path("runs/experiments/twin-probe/efficiency/results.json")).read_text())
    assert list(probed["runs"]) == ["plain", "reinforced-lambda-0.5-weights-5"]
    evaluated = {d.name for d in Path("runs/experiments/twin-probe/efficiency/runs").glob("*/seed-0/eval-*")}
    assert evaluated == {"eval-val"}  # no figure of the probe read the report set
    # nor did it evaluate the teacher (its `evaluate: []`; the recipe's report-set figures are its own)
    assert {k: probed["teachers"]["lite2-s1"].get(k) for k in ("report", "own_test", "student_test")} \
        == dict.fromkeys(("report", "own_test", "student_test"))
    assert not list(teacher_run.glob("eval-own-*")) and not list(teacher_run.glob("eval-students-*"))

    # the recipe the probe's rule leaves (scripts/probe_choice.py --write-recipe; MODE=probe-recipe of the lease
    # script goes on with it), had the rule replaced the reinforced arm's setting: the twin's own folder, where its
    # plain runs are done as they stand and the reinforced ones are to train anew with the probe's setting
    decided = {"reinforced": {"replace": True, "best": "reinforced-lambda-0.5-weights-5", "current_value": 0.5,
                              "best_value": 0.6, "gain": 0.1, "margin": 0.01}}
    choice = load_script("scripts/probe_choice.py")
    with pytest.raises(SystemExit, match=r"decide \[\], its file probes \['reinforced'\]"):
        choice.chosen_recipe({}, probe)  # the reinforced arm's runs gave no final figure: no recipe is written
    left, header = choice.chosen_recipe(decided, probe)
    chosen = tmp_path / "chosen.yaml"
    chosen.write_text(header + yaml.safe_dump(left, sort_keys=False))
    assert left["name"] == recipe["name"] and left["out"] == recipe["out"]
    status = CliRunner().invoke(app, ["experiment", "efficiency", "--config", str(chosen), "--quiet", "--status"])
    assert status.exit_code == 3, status.output
    assert re.search(r"done +plain seed 10: training", status.output)
    assert re.search(r"todo +reinforced seed 10: training", status.output)
    assert "done     students' shards" in status.output and "done     teacher lite2-s1: training" in status.output


def test_evaluations_run_on_the_recipes_device_unless_eval_names_one(tmp_path, monkeypatch):
    from cxrdr.experiments import runs
    from cxrdr.experiments.runs import evaluation_device

    opts = {"n_plots": 6}
    assert evaluation_device({"device": "cuda"}, opts) == "cuda" and opts == {"n_plots": 6}
    opts = {"device": "cuda:1", "n_plots": 6}
    assert evaluation_device({"device": "cuda"}, opts) == "cuda:1" and opts == {"n_plots": 6}  # taken out
    assert evaluation_device({}, {}) is None  # evaluate's own default (CPU)
    # a run's evaluation and its benchmark both get it (models load on CPU by default)
    seen = {}

    def recorded(name):
        def call(*args, **kwargs):
            seen[name] = kwargs
            return {"summary": {}}
        return call

    monkeypatch.setattr(runs, "evaluate", recorded("evaluate"))
    monkeypatch.setattr(runs, "run_benchmark", recorded("benchmark"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last.pt").write_bytes(b"")
    recipe = {"device": "cuda:3", "shards": {"dir": str(tmp_path)}, "eval": {"benchmark": "nih-bbox:x", "n_plots": 2}}
    runs.evaluate_run(recipe, tmp_path / "run", tmp_path, isolated=False, efficiency=False)
    assert seen["evaluate"]["device"] == seen["benchmark"]["device"] == "cuda:3" and seen["evaluate"]["n_plots"] == 2


STUB = """#!/usr/bin/env bash
# stands for `train`: --status exits 3 until a chunk has run LEFT times, then 0
echo "$*" >> "$LOG"
n=$(cat "$STATE" 2>/dev/null || echo 0)
case " $* " in
  *" --status "*) [ "$n" -ge "$LEFT" ] && exit 0 || exit 3 ;;
  *) echo $((n + 1)) > "$STATE"; [ "$((n + 1))" -ge "$LEFT" ] && exit 0 || exit 3 ;;
esac
"""


def _script_env(tmp_path: Path, **extra: str) -> dict:
    """The chunk script's environment with the stub as `train` (--status exits 3 until LEFT chunks ran)."""
    stub = tmp_path / "train"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return dict(os.environ, TRAIN=str(stub), LOG=str(tmp_path / "log"), STATE=str(tmp_path / "state"), CHUNK_S="7",
                HARD_S="30", **extra)


def _run_script(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "some.yaml"], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_the_chunk_script_runs_a_chunk_only_while_work_is_left(tmp_path):
    env = _script_env(tmp_path, LEFT="2")

    def call():
        return _run_script(env)

    assert call().returncode == 3  # status: left -> one chunk -> status: still left
    assert call().returncode == 0  # the second chunk finishes it
    calls = (tmp_path / "log").read_text().splitlines()
    assert [("--status" in c, "--chunk-s 7 --chunk-hard-s 30" in c) for c in calls] == \
        [(True, False), (False, True), (True, False)] * 2  # the chunk knows when it is killed (HARD_S)
    assert all("experiment efficiency --config some.yaml --quiet" in c for c in calls)
    again = call()  # nothing left: only the status, no chunk
    assert again.returncode == 0 and "nothing left" in again.stdout
    assert len((tmp_path / "log").read_text().splitlines()) == len(calls) + 1


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_the_chunk_script_runs_copies_side_by_side_and_fails_with_a_failing_copy(tmp_path):
    env = _script_env(tmp_path, LEFT="9", COPIES="2")
    done = _run_script(env)
    assert done.returncode == 3, done.stdout + done.stderr
    calls = (tmp_path / "log").read_text().splitlines()
    assert ["--chunk-s 7" in c for c in calls] == [False, True, True, False]  # status, two copies, status
    assert done.stdout.count("chunk exited 3") == 2 and "(2 copies)" in done.stdout

    failing = tmp_path / "failing"
    failing.write_text("#!/usr/bin/env bash\ncase \" $* \" in *\" --status \"*) exit 3 ;; *) exit 1 ;; esac\n")
    failing.chmod(0o755)
    bad = _run_script(dict(env, TRAIN=str(failing)))
    assert bad.returncode == 1  # an error in a copy is the script's error (the output names the unit)


def test_a_partial_report_with_every_run_finished_says_only_the_step_benchmark_is_missing():
    from cxrdr.experiments.partial_note import partial_caveat

    every_run = partial_caveat({})
    assert "fewer seeds" not in every_run and "final" in every_run and "step benchmark" in every_run
    assert "fewer seeds" in partial_caveat({"reinforced": [14]})


def test_the_probes_rule_replaces_a_setting_only_past_its_margin():
    """scripts/probe_choice.py: within each arm, the best alternative replaces the arm's setting only if it ends
    above it by more than the margin; results not on val are refused."""
    choice = load_script("scripts/probe_choice.py")
    rows = {"plain": 0.300, "plain-lr-0.001": 0.305, "reinforced": 0.250, "reinforced-kl-only": 0.280,
            "reinforced-weights-5": 0.262}
    results = {"curve_split": "val", "table": [{"run": k, "mean_recall": v} for k, v in rows.items()]}
    decided = choice.choices(results, margin=0.010)
    assert decided["plain"]["best"] == "plain-lr-0.001" and not decided["plain"]["replace"]  # +0.005: within it
    assert decided["reinforced"]["best"] == "reinforced-kl-only" and decided["reinforced"]["replace"]
    assert decided["reinforced"]["gain"] == pytest.approx(0.030)
    with pytest.raises(SystemExit, match="read val only"):
        choice.choices({**results, "curve_split": "report"}, margin=0.010)
