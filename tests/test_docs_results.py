"""Docs vs results (issue 37): every results-backed figure and verdict of the README and docs/ is generated from a
committed results file by scripts/headline.py, and nothing outside those blocks claims a verdict."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
# pages other engineers own (GPU, CPU benchmarks, resume): their figures come from benchmark scripts, not results
OTHERS = {"gpu.md", "benchmarks.md", "resume.md"}
PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.name not in OTHERS]
SUPERSEDED = re.compile(r"<!-- superseded: (\d{4}-\d{2}-\d{2}) ([0-9a-f]{7,40}) -->\n(.*?)<!-- /superseded -->", re.S)
# verdict words and claims that need a results file behind them
CLAIMS = [re.compile(r"\bMET\b"), re.compile(r"\bMISSED\b"), re.compile(r"\babove (the|their)\b[^.|]*\bpriors?\b"),
          re.compile(r"\bpays?\b"), re.compile(r"\bby a hair\b")]
# sections whose every decimal figure must sit in a generated block
GENERATED_SECTIONS = [("README.md", "## Headline figures"), ("README.md", "## On real radiographs"),
                      ("docs/protocol.md", "## Re-measured headlines"),
                      ("docs/real-radiographs.md", "### NIH test"), ("docs/real-radiographs.md", "### The issue's bars"),
                      ("docs/real-radiographs.md", "### What fails")]


@pytest.fixture(scope="module")
def headline():
    return load_script("scripts/headline.py")


def _outside(text: str, headline) -> str:
    """The page with its generated and its labelled superseded blocks blanked out."""
    text = headline.BLOCK.sub("", text)
    return SUPERSEDED.sub("", text)


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_generated_blocks_match_their_results(page, headline):
    """A figure or MET/MISSED word in a block that differs from what its results file gives fails here."""
    for m in headline.BLOCK.finditer(page.read_text()):
        assert m.group(2) in headline.BLOCKS, f"{page.name}: unknown block {m.group(2)}"
        assert m.group(3) == headline.render(m.group(2)), (
            f"{page.name}: block {m.group(2)} differs from the results; run python scripts/headline.py --write")


def test_the_headline_pages_hold_their_blocks(headline):
    names = {p.name: {m.group(2) for m in headline.BLOCK.finditer(p.read_text())} for p in PAGES}
    assert {"readme-efficiency", "readme-ladder", "nih-readme"} <= names["README.md"]
    assert {"efficiency", "efficiency-reading", "efficiency-caveats", "ladder", "ladder-margins", "ladder-reading",
            "provenance"} <= names["protocol.md"]
    assert {"nih-table", "nih-findings", "nih-bars", "nih-efficiency", "nih-reading", "nih-iobb"} <= names[
        "real-radiographs.md"]
    assert {"controls-table", "controls-reading", "controls-reinforced-minilm", "controls-distill-probe",
            "controls-strong-teacher"} <= names["experiments.md"]
    assert {"limitations-ladder", "limitations-controls"} <= names["limitations.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_verdicts_only_where_a_results_file_backs_them(page, headline):
    """MET / MISSED / "above the ... prior" / "pays" outside a generated block only in a labelled superseded one."""
    text = _outside(page.read_text(), headline)
    found = [m.group(0) for pattern in CLAIMS for m in pattern.finditer(text)]
    assert not found, f"{page.name}: unbacked claims {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_superseded_blocks_are_labelled_with_date_and_commit(page):
    git = (ROOT / ".git").exists()
    for m in SUPERSEDED.finditer(page.read_text()):
        date, commit, body = m.groups()
        label = body.strip().splitlines()[0]
        assert "Superseded" in label and date in label and commit in label, f"{page.name}: label {label!r}"
        if git:
            ok = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                                capture_output=True).returncode == 0
            assert ok, f"{page.name}: commit {commit} not in the history"


@pytest.mark.parametrize("page, heading", GENERATED_SECTIONS, ids=lambda x: str(x))
def test_headline_sections_quote_no_figure_outside_a_block(page, heading, headline):
    text = (ROOT / page).read_text()
    start = text.index(heading)
    level = heading.split(" ")[0]
    nxt = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(heading):], re.M)
    section = text[start: start + len(heading) + (nxt.start() if nxt else len(text))]
    stray = re.findall(r"(?<![\w.])\d+\.\d+", _outside(section, headline))
    assert not stray, f"{page} {heading!r}: figures outside a generated block {stray}"


def test_every_recipe_setting_has_a_provenance_row(headline):
    entries = headline.provenance_entries()
    missing = [f"{recipe}.yaml: {key}" for recipe, settings in headline.recipe_settings().items()
               for key, _ in settings if headline.provenance_match(recipe, key, entries) is None]
    assert not missing, f"no row in docs/results/provenance.yaml for {missing}"
    assert len(headline.recipe_settings()) == len(list((ROOT / "configs" / "experiments").glob("*.yaml")))


def test_derived_checks_are_of_the_committed_results(headline):
    checks = headline._load(headline.CHECKS)
    assert checks["source_sha256"] == hashlib.sha256(headline.EFFICIENCY.read_bytes()).hexdigest(), (
        "docs/results/cpu-demo-efficiency.json changed: run python scripts/headline.py --derive")


def test_nih_tables_agree_with_the_nih_results(headline):
    headline._nih_check_md_against_json(headline.nih_facts())


def test_a_shift_read_from_table_cells_is_the_welch_interval_of_the_seeds(headline):
    """nih-tables.md holds 'mean ± half-width' cells, not seeds: the sd recovered from a cell gives the same
    Welch interval (to the cells' rounding) as the seeds themselves, and the direction follows its sign."""
    before, after = [0.52, 0.55, 0.49, 0.58, 0.51], [0.47, 0.49, 0.48, 0.46, 0.50]
    direction, text = headline._shift(before, after)
    from_cells, text_cells = headline._shift_cells(headline._ci(before), 5, headline._ci(after), 5)
    assert direction == from_cells == "lower"
    ends = [float(x.replace("−", "-")) for x in re.findall(r"[+−]\d\.\d+", text.split(";")[1])]
    ends_cells = [float(x.replace("−", "-")) for x in re.findall(r"[+−]\d\.\d+", text_cells.split(";")[1])]
    assert ends == pytest.approx(ends_cells, abs=0.002)
    assert headline._shift(before, before[::-1])[0] == "no different beyond seed noise"


def test_the_samples_bar_limit_and_seeds_at_chance_are_read_from_the_results(headline):
    bar = {"bar": "reinforced reaches plain's final with <= 1/2 of plain's samples and the ratio's 95 % upper "
                  "bound <= 0.6"}
    assert headline._samples_upper_limit(bar) == 0.6
    arm = {"seeds": [20, 21, 22], "final_mean_recall": [0.27, 0.03, 0.29], "final": {"chance_mean_recall": 0.021}}
    assert headline._at_chance(arm) == [(21, 0.03)]


def test_the_gpu_recipes_block_says_not_measured_until_its_results_exist(headline, tmp_path, monkeypatch):
    """docs/experiments.md's gpu-efficiency block: a line saying no GPU has run the recipe while
    docs/results/gpu-efficiency.json is absent; its table, bars and teacher once it is there."""
    monkeypatch.setattr(headline, "GPU_EFFICIENCY", tmp_path / "gpu-efficiency.json")
    monkeypatch.setattr(headline, "GPU_EFFICIENCY_PARTIAL", tmp_path / "gpu-efficiency-partial.json")
    assert headline.gpu_efficiency()[0].startswith("*Not measured yet:*")
    final = {"final_mean_recall": [0.2, 0.3], "final": {"mean_recall_findings_seeds": [0.5, 0.6],
                                                        "probe_auc_seeds": [0.8, 0.9], "chance_mean_recall": 0.01}}
    res = {"protocol": {"report_shards": "report"}, "seeds": [10, 11],
           "arms": {"plain": {**final, "crossing": {"samples": 30720, "ratio": 1.0, "ratio_ci": [1.0, 1.0]}},
                    "reinforced": {**final, "crossing": {"samples": 6144, "ratio": 0.2, "ratio_ci": [0.1, 0.3]}}},
           "cost": {"teacher_train_samples": 30720}, "bars": [{"bar": "a bar", "value": 0.2, "met": True}],
           "teachers": {"lite2-s1": {"model": "teacher-lite2-gpu-D", "steps": 120,
                                     "report": {"mean_recall": 0.4, "chance_mean_recall": 0.006, "pointing_z": 0.8,
                                                "train_prior_pointing_z": 0.5, "pointing_attn": 0.9,
                                                "train_prior_pointing_attn": 0.55}}}}
    (tmp_path / "gpu-efficiency.json").write_text(json.dumps(res))
    text = "\n".join(headline.gpu_efficiency())
    assert "--config configs/experiments/gpu-efficiency.yaml" in text and "seeds [10, 11]):" in text
    assert "| reinforced | 2 | 0.250 ± " in text and "0.200 [0.100, 0.300]" in text
    assert "- a bar: 0.200 — **MET**" in text
    assert "teacher lite2-s1 (teacher-lite2-gpu-D, 120 steps)" in text and "PG z 0.800 (train-box prior 0.500)" in text
    assert "earlier version" not in text  # no recipe in these results: nothing to compare


def test_results_of_an_earlier_recipe_version_say_which_keys_differ(headline, tmp_path, monkeypatch):
    """Figures of a recipe run before its file changed are said to be the earlier version's, naming each key that
    differs (the value it ran, the value now); the same recipe says nothing."""
    now = {"_path": "here.yaml", "name": "r", "train": {"steps": 400, "lr": 0.001}, "efficiency": {"seeds": [10]}}
    monkeypatch.setattr(headline, "load_recipe", lambda path: now if path == headline.GPU_RECIPE else None)
    monkeypatch.setattr(headline, "GPU_EFFICIENCY", tmp_path / "gpu-efficiency.json")
    ran = {"_path": "elsewhere.yaml", "name": "r", "train": {"steps": 120, "lr": 0.001},
           "efficiency": {"seeds": [10]}, "gone": True}
    res = {"protocol": {"report_shards": "report"}, "seeds": [10], "arms": {}, "bars": [], "recipe": ran}
    (tmp_path / "gpu-efficiency.json").write_text(json.dumps(res))
    assert headline.gpu_efficiency()[0] == (
        "*Run at an earlier version of the recipe:* `gone` True (now –), `train.steps` 120 (now 400). "
        "The recipe as it stands has not run to its end on a GPU.")
    res["recipe"] = {**now, "_path": "elsewhere.yaml"}  # where it was read from is no part of the recipe
    (tmp_path / "same.json").write_text(json.dumps(res))  # a file of its own: results are read once a path
    monkeypatch.setattr(headline, "GPU_EFFICIENCY", tmp_path / "same.json")
    assert "earlier version" not in "\n".join(headline.gpu_efficiency())
    # how often a run saved changes no figure (a resumed run is the run never interrupted): not a drift
    assert headline.recipe_drift({**now, "train": {**now["train"], "save_every": 30}},
                                 {**now, "train": {**now["train"], "save_every": 100}}) == ""


def test_the_gpu_recipes_block_shows_a_leases_partial_results_until_the_recipe_finishes(headline, tmp_path,
                                                                                          monkeypatch):
    """Without results.json, the latest lease's --partial results, said so first; a teacher without its own
    train-box prior is shown beside the students' (the same report set), an open crossing bound as 'inf'."""
    monkeypatch.setattr(headline, "GPU_EFFICIENCY", tmp_path / "gpu-efficiency.json")
    monkeypatch.setattr(headline, "GPU_EFFICIENCY_PARTIAL", tmp_path / "gpu-efficiency-partial.json")
    final = {"final_mean_recall": [0.019, 0.021], "final": {"chance_mean_recall": 0.005}}
    student = {"final": {"train_prior_pointing_z": 0.505, "train_prior_pointing_attn": 0.588}}
    res = {"protocol": {"report_shards": "report"}, "seeds": [10, 11],
           "arms": {"plain": {**final, "crossing": {"samples": 27000, "ratio": 1.0, "ratio_ci": [0.65, None]}},
                    "plain-total-samples": {"final_mean_recall": [0.04], "crossing": {}}},
           "bars": [], "runs": {"plain": [student, student]},
           "partial": {"finished": {"plain": [10, 11]}, "left": {}},
           "teachers": {"lite2-s1": {"model": "teacher-lite2-gpu-D", "steps": 120,
                                     "report": {"mean_recall": 0.38, "pointing_z": 0.75, "pointing_attn": 0.81,
                                                "train_prior_pointing_z": None}}}}
    (tmp_path / "gpu-efficiency-partial.json").write_text(json.dumps(res))
    lines = headline.gpu_efficiency()
    assert lines[0].startswith("*Partial results*") and "Finished runs: plain seeds 10, 11." in lines[0]
    assert "the step costs and the timed-only arms wait for the step benchmark" in lines[0]
    text = "\n".join(lines)
    assert "| plain | 2 | 0.020 ± " in text and "1.000 [0.650, inf]" in text
    assert "seeds [10, 11], plain-total-samples on its own seed list)" in text  # the arms with fewer seeds, named
    assert "PG z 0.750 (train-box prior 0.505, the students')" in text
    assert "PG attention 0.810 (train-box prior 0.588, the students')" in text


def test_partial_results_of_the_recipe_as_it_stands_come_before_whole_results_of_an_earlier_version(
        headline, tmp_path, monkeypatch):
    """Whole results of an earlier recipe and a lease's partial results of the recipe now: the partial block first
    (said partial), then the whole one under its drift note; partial results of an earlier recipe stay hidden."""
    now = {"name": "r", "train": {"steps": 400}}
    monkeypatch.setattr(headline, "load_recipe", lambda path: now)
    monkeypatch.setattr(headline, "GPU_EFFICIENCY", tmp_path / "gpu-efficiency.json")
    monkeypatch.setattr(headline, "GPU_EFFICIENCY_PARTIAL", tmp_path / "gpu-efficiency-partial.json")
    base = {"protocol": {"report_shards": "report"}, "arms": {}, "bars": []}
    (tmp_path / "gpu-efficiency.json").write_text(json.dumps(
        {**base, "seeds": [10, 11, 12], "recipe": {"name": "r", "train": {"steps": 120}}}))
    partial = {"note": "", "finished": {"plain": [10]}, "left": {"plain": [11]}}
    (tmp_path / "gpu-efficiency-partial.json").write_text(json.dumps(
        {**base, "seeds": [10], "recipe": now, "partial": partial}))
    text = "\n".join(headline.gpu_efficiency())
    assert text.startswith("*Partial results*") and "Finished runs: plain seeds 10" in text
    assert text.index("seeds [10])") < text.index("**The whole recipe, at an earlier version:**") \
        < text.index("`train.steps` 120 (now 400)") < text.index("seeds [10, 11, 12])")
    (tmp_path / "older-partial.json").write_text(json.dumps(  # an older lease's partial: left out
        {**base, "seeds": [10], "recipe": {"name": "r", "train": {"steps": 60}}, "partial": partial}))
    monkeypatch.setattr(headline, "GPU_EFFICIENCY_PARTIAL", tmp_path / "older-partial.json")  # (read once a path)
    text = "\n".join(headline.gpu_efficiency())
    assert "Partial results" not in text and text.startswith("*Run at an earlier version of the recipe:*")


def _efficiency_results(arms: dict[str, dict[int, float]], teacher_own: float, lr: float = 0.001) -> dict:
    """A minimal efficiency results file: per arm its seeds' finals, a two-point curve ending there, a step time."""
    runs = {name: [{"seed": s, "train_summary": {"mean_step_ms": 100.0},
                    "curve": [{"samples_seen": 320, "mean_recall": v / 2}, {"samples_seen": 640, "mean_recall": v}]}
                   for s, v in seeds.items()] for name, seeds in arms.items()}
    return {"runs": runs, "arms": {name: {"final_mean_recall": list(seeds.values())} for name, seeds in arms.items()},
            "teachers": {"t": {"own_test": {"mean_recall": teacher_own}}},
            "recipe": {"efficiency": {"runs": {name: {"optim": {"lr": lr}} for name in arms}}}}


def test_reinforced_minilm_is_paired_with_plain_minilm_tuned_seed_by_seed_and_checks_its_teacher(headline):
    """The controls' missing cell: each seed of reinforced-minilm against the same seed of plain-minilm-tuned trained
    beside it (whatever the runs' order), a t-interval over the paired differences, the controls' own run of
    plain-minilm-tuned beside it, and whether the teacher made again is the controls' one."""
    ctl = _efficiency_results({"plain-minilm-tuned": {20: 0.40, 21: 0.38, 22: 0.39}}, teacher_own=0.5)
    ctl["teachers"]["t"]["code"] = {"commit": "a423c2d67d9ae05889c71af34442f3d473c966fd"}
    res = _efficiency_results({"reinforced-minilm": {22: 0.40, 20: 0.42, 21: 0.39},
                               "plain-minilm-tuned": {20: 0.40, 21: 0.38, 22: 0.39}}, teacher_own=0.5)
    f = headline.reinforced_minilm_facts(res, ctl)
    assert f["seeds"] == [22, 20, 21] and f["diffs"] == pytest.approx([0.01, 0.02, 0.01])
    sd = float(np.std([0.01, 0.02, 0.01], ddof=1))  # the paired differences' sd; t(2) = 4.3027
    assert f["paired"]["gap"] == pytest.approx(0.04 / 3)
    assert f["paired"]["gap_ci"] == pytest.approx([0.04 / 3 - 4.302652729911275 * sd / 3 ** 0.5,
                                                   0.04 / 3 + 4.302652729911275 * sd / 3 ** 0.5])
    text = headline.controls_reinforced_minilm(res, ctl)[0]
    assert "the same teacher" in text and "22: 0.400 vs 0.390" in text and "(t over 3 seeds; " in text
    # the curves here are evaluated at 320 and 640 samples only: no point at a quarter of the budget, no early reading
    assert "Read from the curves" not in text
    for arm in res["runs"].values():  # an evaluation at 160 samples too: the reading appears, from the seed means
        for run in arm:
            run["curve"].insert(0, {"samples_seen": 160, "mean_recall": 0.1 if run in res["runs"]["reinforced-minilm"]
                                    else 0.05})
    text = headline.controls_reinforced_minilm(res, ctl)[0]
    assert ("160 samples: reinforced-minilm 0.100, plain-minilm-tuned 0.050; 320 samples: reinforced-minilm" in text
            and "the distilled student leads at a quarter of the budget and ends higher on every seed" in text)
    other = headline.controls_reinforced_minilm(
        _efficiency_results({"reinforced-minilm": {20: 0.4}, "plain-minilm-tuned": {20: 0.4}}, 0.6), ctl)[0]
    assert "another teacher than the controls' (code a423c2d)" in other and "(one seed: no interval)" in other


def _distill_probe(finals: dict[str, float], chosen: str) -> dict:
    best = max(finals, key=finals.get)
    return {"rule": "r", "margin": 0.010, "chosen": chosen, "best": best,
            "best_ahead_of_current": finals[best] - finals["current"],
            "runs": {label: {"final_mean_recall": v} for label, v in finals.items()}}


def test_distill_probe_block_says_what_the_rule_kept_and_pairs_the_choice_once_it_ran(headline):
    """The val probe of reinforced-minilm's distillation terms: every candidate's final, the rule's verdict in
    words, and the chosen setting's report-set runs paired seed by seed with plain-minilm-tuned once the recipe
    holds them (before: said not made)."""
    ctl = _efficiency_results({"plain-minilm-tuned": {20: 0.40, 21: 0.38, 22: 0.39}}, teacher_own=0.5)
    ctl["teachers"]["t"]["code"] = {"commit": "a423c2d67d9ae05889c71af34442f3d473c966fd"}
    res = _efficiency_results({"reinforced-minilm": {20: 0.35, 21: 0.36, 22: 0.37},
                               "plain-minilm-tuned": {20: 0.40, 21: 0.38, 22: 0.39}}, teacher_own=0.5)
    kept = headline.controls_distill_probe(_distill_probe({"current": 0.512, "kl-only": 0.50}, "current"), res, ctl)[0]
    assert "current 0.512; kl-only 0.500" in kept and "the current setting ends highest and stays" in kept
    close = headline.controls_distill_probe(_distill_probe({"current": 0.512, "kl-only": 0.52}, "current"), res, ctl)[0]
    assert "kl-only ends highest, ahead of the current setting by +0.008, not more than the margin" in close
    probe = _distill_probe({"current": 0.512, "lambda-0.5": 0.54}, "lambda-0.5")
    waiting = headline.controls_distill_probe(probe, res, ctl)[0]
    assert "lambda-0.5 ends highest, ahead of the current setting by +0.028, and replaces it" in waiting
    assert "Its report-set runs (reinforced-minilm-lambda-0.5) are not made yet." in waiting
    res = _efficiency_results({"reinforced-minilm": {20: 0.35, 21: 0.36, 22: 0.37},
                               "reinforced-minilm-lambda-0.5": {20: 0.41, 21: 0.37, 22: 0.40},
                               "plain-minilm-tuned": {20: 0.40, 21: 0.38, 22: 0.39}}, teacher_own=0.5)
    done = headline.controls_distill_probe(probe, res, ctl)[0]
    assert "reinforced-minilm-lambda-0.5 ends at" in done and "20: 0.410 vs 0.400, 21: 0.370 vs 0.380" in done
    assert "the paired difference is +0.003 [" in done and "(t over 3 seeds; not shown" in done


def test_the_stronger_teacher_with_minilm_students_is_paired_with_plain_minilm_tuned_and_the_weaker_teacher(headline):
    """cpu-demo-controls-strong-teacher-minilm: each distilled MiniLM arm against plain-minilm-tuned trained beside it
    and against the same arm with the weaker teacher, seed by seed; a bridge whose runs are equal on every seed says
    so instead of printing a zero-width interval; the README and limitations quote the clause."""
    res, weak = headline._load(headline.CONTROLS_STRONG_MINILM), headline._load(headline.CONTROLS_MINILM)
    f = headline.strong_minilm_facts(res, weak)
    final = lambda r, arm: {run["seed"]: run["final"]["mean_recall"] for run in r["runs"][arm]}  # noqa: E731
    assert set(f["arms"]) == set(headline.STRONG_MINILM_ARMS) & set(res["runs"]) and f["arms"]
    for name, a in f["arms"].items():
        mine, ref, before = final(res, name), final(res, "plain-minilm-tuned"), final(weak, name)
        assert a["paired"]["gap"] == pytest.approx(np.mean([mine[s] - ref[s] for s in a["seeds"]]))
        assert a["vs_weak"]["gap"] == pytest.approx(np.mean([mine[s] - before[s] for s in a["vs_weak"]["seeds"]]))
        assert sorted(a["vs_weak"]["seeds"]) == sorted(set(mine) & set(before))
    same = headline._paired_seeds({20: 0.4, 21: 0.5}, {21: 0.5, 20: 0.4})
    assert headline._bridge_text(same) == "equal on all 2 seeds: the same runs"
    moved = headline._paired_seeds({20: 0.4, 21: 0.5, 22: 0.45}, {20: 0.3, 21: 0.52, 22: 0.41})
    assert headline._bridge_text(moved).startswith("+0.040 [")
    clause = headline._readme_strong_minilm()
    assert clause and clause in (ROOT / "README.md").read_text() and clause in (ROOT / "docs" / "limitations.md").read_text()


def test_the_stronger_teacher_is_paired_seed_by_seed_with_the_controls_runs(headline):
    """cpu-demo-controls-strong-teacher: reinforced against the controls' reinforced (the weaker teacher), against
    plain-minilm-tuned and against its own plain, each seed with the same seed whatever the runs' order; both
    teachers' report-set figures from the one `train eval` file; the README and limitations quote them."""
    pairs = headline._paired_seeds({22: 0.5, 20: 0.4, 21: 0.45}, {20: 0.3, 21: 0.3, 22: 0.3, 23: 0.9})
    assert pairs["seeds"] == [22, 20, 21] and pairs["gap"] == pytest.approx(0.15)
    res, ctl = headline._load(headline.CONTROLS_STRONG), headline._load(headline.CONTROLS)
    f = headline.strong_teacher_facts(res, ctl, headline._load(headline.TEACHER_REPORT))
    final = lambda r, arm: {run["seed"]: run["final"]["mean_recall"] for run in r["runs"][arm]}  # noqa: E731
    for key, mine, theirs in (("vs_weak", final(res, "reinforced"), final(ctl, "reinforced")),
                              ("vs_tuned", final(res, "reinforced"), final(ctl, "plain-minilm-tuned")),
                              ("vs_plain", final(res, "reinforced"), final(res, "plain"))):
        seeds = sorted(set(mine) & set(theirs))
        assert sorted(f[key]["seeds"]) == seeds
        assert f[key]["gap"] == pytest.approx(np.mean([mine[s] - theirs[s] for s in seeds]))
        assert f[key]["gap_ci"][0] < f[key]["gap"] < f[key]["gap_ci"][1]
    assert f["weak"] < f["strong"] and f["strong"] == res["teachers"]["lite2-s1-3k"]["report"]["mean_recall"]
    clause = headline._readme_strong(ctl)
    assert clause and clause in (ROOT / "README.md").read_text() and clause in (ROOT / "docs" / "limitations.md").read_text()
