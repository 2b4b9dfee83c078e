"""benchmarks/gpu_suite.py: its tiny CPU run, so the GPU suite never rots between GPU sessions.

Checks the structure of what it writes (every section present and holding measured numbers,
every figure carrying GPU busy %, MFU and peak memory, the targets list evaluated and labelled
as the tiny run's own, the Markdown naming them), and that an exhausted time budget skips
sections with a note instead of overrunning. No speed is asserted: figures belong to benchmarks.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("build", "students", "loop", "loop_graphs", "peer", "loop_compiled", "train_step", "table")
# loop_compiled: GPU only
MEASURED_IN_TINY = {"build", "students", "loop", "loop_graphs", "peer", "train_step", "table"}
TARGET_KEYS = {"name", "required", "value", "met"}


# COMPILED_ORDER as it was before the compiled blocks could be graphed: the tests of the compiled section's budget
# and deadlines pin it, so they read the same whatever comes first now
SCOPES_WITHOUT_GRAPHS = (("A", "model"), ("E", "model"), ("D", "model"), ("D", "blocks"), ("A", "blocks"),
                         ("E", "blocks"))

def suite_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """benchmarks/gpu_suite.py's command in this process (its imports are this worker's already; a subprocess spent
    ~5 s importing them again): its exit code and what it printed."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        code = gpu_suite.main(list(args))
    finally:
        torch.set_num_threads(threads)  # --threads is the command's, not the session's
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["gpu_suite.py", *args], code, out.out, out.err)


def run_suite(capsys, out_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    proc = suite_main(capsys, "--tiny", "--device", "cpu", "--threads", "1", "--out-dir", str(out_dir), *args)
    written = sorted(out_dir.glob("*.json"))
    assert len(written) == 1, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert written[0].name.startswith("cpu-") and written[0].name.endswith("-tiny.json")
    md = written[0].with_suffix(".md").read_text()
    return proc, json.loads(written[0].read_text()), md


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def assert_figure(row: dict, busy="gpu_busy_pct", mfu="mfu_pct", peak="peak_memory_mb") -> None:
    """A figure measured on CPU carries its GPU busy %, MFU and peak memory: the peak measured (RSS),
    busy % and MFU None (CUDA only: not made up)."""
    for key in (busy, mfu, peak):
        assert key in row, (row.get("name") or row.get("config"), key)
    assert positive(row[peak])
    assert row[busy] is None and row[mfu] is None


def test_tiny_suite_measures_every_section(tmp_path, capsys):
    proc, result, md = run_suite(capsys, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["errors"] == {}
    assert set(result["sections"]) == MEASURED_IN_TINY
    assert [(s["section"], "tiny" in s["reason"]) for s in result["skipped"]] == [("loop_compiled", True)]
    assert result["peak_bf16_flops"] is None
    s = result["sections"]

    assert positive(s["build"]["build_samples_per_s"]) and positive(s["build"]["teacher_samples_per_s"])
    assert s["build"]["ratio"] == s["build"]["build_samples_per_s"] / s["build"]["teacher_samples_per_s"]
    assert s["build"]["steady_ratio"] >= s["build"]["ratio"]  # from the first batch: start-up left out
    start_up = s["build"]["start_up_seconds"]  # what the steady figure leaves out, within the build's time
    assert set(start_up) == {"setup", "first_batch"} and 0 < sum(start_up.values()) < s["build"]["build_seconds"]
    assert s["build"]["samples"] == 16
    threads = {name.split(" [")[0]: t for name, t in s["build"]["thread_samples"].items()}  # sampled during the build
    assert "MainThread" in threads and "shard-writer" in threads
    assert all(t["samples"] > 0 and all(0 < pct <= 100 for pct in t["own_pct"].values()) for t in threads.values())

    rows = s["students"]["rows"]
    families = [("tiny", v) for v in "ABCDE"] + [("tiny-32px", v) for v in "AE"]  # the second: A and E only
    assert [(r["family"], r["variant"]) for r in rows] == families
    for r in rows:
        for key in ("train_img_per_s", "inference_img_per_s", "latency_ms_per_img", "peak_memory_mb",
                    "gflops_per_img", "patch_usage_pct"):
            assert positive(r[key]), (r["config"], key, r[key])
        assert_figure(r, "train_gpu_busy_pct", "train_mfu_pct", "peak_memory_mb")  # the training figure
        assert_figure(r, "inference_gpu_busy_pct", "inference_mfu_pct", "inference_peak_memory_mb")
        assert r["host_syncs_per_step"] is None and r["autocast"] is None and r["peak_memory_kind"] == "process_rss"
        assert r["train_gflops_per_img"] is None  # counted only where an MFU can be computed (CUDA)
    by = {r["config"]: r for r in rows if r["family"] == "tiny"}
    assert by["tiny-E"]["patch_usage_pct"] < by["tiny-A"]["patch_usage_pct"]  # E timed at its target keep rate
    assert by["tiny-E"]["gflops_per_img"] < by["tiny-A"]["gflops_per_img"]
    assert s["students"]["E_over_A"]["tiny"]["train_img_per_s"] == (
        by["tiny-E"]["train_img_per_s"] / by["tiny-A"]["train_img_per_s"])
    bf16 = "inference_img_per_s_bf16_weights"  # A and E of the loop's family, their weights in bf16, no autocast
    assert [r["config"] for r in rows if bf16 in r] == ["tiny-A", "tiny-E"]
    for v in "AE":  # near the autocast (here fp32) embeddings, not equal: bf16 rounding
        cosine = by[f"tiny-{v}"]["inference_bf16_min_cosine_to_autocast"]
        assert positive(by[f"tiny-{v}"][bf16]) and 0.95 < cosine < 1.0001
    assert s["students"]["E_over_A"]["tiny"][bf16] == by["tiny-E"][bf16] / by["tiny-A"][bf16]

    loop = s["loop"]["rows"]
    # A-E, A again with its texts padded (--no-pack-text): what packing them buys, and D, E with the former heads
    assert [r["name"] for r in loop] == [*"ABCDE", "A padded texts", "D former heads", "E former heads"]
    assert [r["model"] for r in loop] == [f"tiny-{v}" for v in "ABCDEADE"]
    assert s["loop"]["A_packed_over_padded_img_per_s"] == loop[0]["img_per_s"] / loop[5]["img_per_s"]
    assert s["loop"]["D_over_former_heads_D_step"] == loop[3]["step_ms"] / loop[6]["step_ms"]
    assert s["loop"]["E_over_former_heads_E_step"] == loop[4]["step_ms"] / loop[7]["step_ms"]
    for r in loop:
        assert positive(r["img_per_s"]) and positive(r["step_ms"]) and r["data_ms"] >= 0
        # every timed block's ms per step (block of 1 here): the mean is theirs (none dropped below 10 blocks)
        assert len(r["block_ms"]) == r["steps"] and abs(r["step_ms"] - sum(r["block_ms"]) / r["steps"]) < 0.01
        assert r["compile"] is False and r["host_syncs_per_step"] is None and r["gflops_per_img"] is None
        assert_figure(r)
    lb = {r["name"]: r for r in loop}
    assert s["loop"]["D_over_A_step"] == lb["D"]["step_ms"] / lb["A"]["step_ms"]
    assert s["loop"]["shards"] == s["build"]["shards"]  # the loop trains on the build's shards

    graphs = s["loop_graphs"]  # on CPU the graphed trainers run eagerly, and say so
    assert [r["name"] for r in graphs["rows"]] == [n.format(v=v) for v in "AED" for n in (
        "{v}", "{v} CUDA graphs", "{v} CUDA graphs + text", *(["{v} CUDA graphs + text + heads"] if v != "A" else []),
        "{v} all CUDA graphs")]
    assert all(positive(r["img_per_s"]) for r in graphs["rows"])
    graphed_rows = [r for r in graphs["rows"] if " " in r["name"]]
    assert len(graphed_rows) == 11
    assert all(r["graphs_captured"] is None and r["text_graphs_captured"] is None and r["heads_graphs_captured"] is None
               and r["losses_graphs_captured"] is None and r["graphs_failed"] == "no graphs: not a CUDA device"
               for r in graphed_rows)
    # the plumbing only, on CPU: the blocks stand in for the capture; the text tower, without FlashAttention, has none
    assert {v: (a["graphs_captured"], a["max_rel_diff_grad"]) for v, a in graphs["agreement"].items()} == {
        "D": (1, 0.0), "E": (2, 0.0), "E text": (0, 0.0), "D heads": (1, 0.0), "E heads": (1, 0.0),
        "D losses": (1, 0.0)}
    gb = {r["name"]: r for r in graphs["rows"]}
    assert graphs["graphed_over_eager_img_per_s"]["E"] == gb["E CUDA graphs"]["img_per_s"] / gb["E"]["img_per_s"]
    assert graphs["text_graphed_over_graphed_img_per_s"]["A"] == (
        gb["A CUDA graphs + text"]["img_per_s"] / gb["A CUDA graphs"]["img_per_s"])
    assert graphs["graphed_ratios"]["E_over_A_img_per_s"] == (
        gb["E CUDA graphs"]["img_per_s"] / gb["A CUDA graphs"]["img_per_s"])
    assert graphs["text_graphed_ratios"]["E_over_A_img_per_s"] == (
        gb["E CUDA graphs + text"]["img_per_s"] / gb["A CUDA graphs + text"]["img_per_s"])
    assert graphs["heads_graphed_over_text_graphed_img_per_s"]["D"] == (
        gb["D CUDA graphs + text + heads"]["img_per_s"] / gb["D CUDA graphs + text"]["img_per_s"])
    assert graphs["heads_graphed_ratios"]["E_over_A_img_per_s"] == (  # A has no heads: its blocks and text
        gb["E CUDA graphs + text + heads"]["img_per_s"] / gb["A CUDA graphs + text"]["img_per_s"])
    assert graphs["all_graphed_over_heads_graphed_img_per_s"]["A"] == (
        gb["A all CUDA graphs"]["img_per_s"] / gb["A CUDA graphs + text"]["img_per_s"])
    assert graphs["all_graphed_ratios"]["E_over_A_img_per_s"] == (
        gb["E all CUDA graphs"]["img_per_s"] / gb["A all CUDA graphs"]["img_per_s"])

    peer = s["peer"]["rows"]
    assert [r["name"] for r in peer] == ["open_clip tiny eager"] and s["peer"]["notes"]
    assert positive(peer[0]["img_per_s"])
    assert_figure(peer[0])

    names = [r["name"] for r in s["train_step"]["rows"]]
    assert names == ["D stored", "D plain (no teacher)", "D online random:tiny"]
    for r in s["train_step"]["rows"]:
        assert positive(r["step_ms"])
        assert_figure(r)
    assert positive(s["train_step"]["online_over_stored"])

    table = s["table"]["rows"]
    assert [r["run"] for r in table] == list("ABCDE")
    for r in table:
        for key in ("inference_img_per_s", "train_step_ms", "latency_ms", "peak_memory_mb", "gflops_per_img",
                    "patch_usage_pct", "step_ms", "train_img_per_s"):
            assert positive(r[key]), (r["run"], key)
        assert r["step_ms"] == lb[r["run"]]["step_ms"]  # the real loop's step, not a second run

    targets = result["targets"]
    assert all(set(t) >= TARGET_KEYS for t in targets)
    # no compiled rows in the tiny run: the eager and graphed loops' targets, and the build's steady ratio beside its
    # whole one
    assert len(targets) == 34
    graphed_a = next(t for t in targets if t["name"].startswith("A training, real loop, img/s [eager + CUDA graphs of "
                                                                  "the blocks]"))
    assert graphed_a["value"] == gb["A CUDA graphs"]["img_per_s"]
    text_d = next(t for t in targets if t["name"].startswith("D training, real loop, img/s [eager + CUDA graphs of the "
                                                               "blocks and text layers]"))
    assert text_d["value"] == gb["D CUDA graphs + text"]["img_per_s"]
    heads = {t["name"].split(" [")[0]: t for t in targets if "text layers and heads" in t["name"]}
    assert heads["A training, real loop, img/s"]["value"] == gb["A CUDA graphs + text"]["img_per_s"]  # no heads
    assert heads["D training, real loop, img/s"]["value"] == gb["D CUDA graphs + text + heads"]["img_per_s"]
    every = {t["name"].split(" [")[0]: t for t in targets if "all CUDA graphs" in t["name"]}
    assert every["A training, real loop, img/s"]["value"] == gb["A all CUDA graphs"]["img_per_s"]
    assert heads["E / A train img/s, real loop, E at its target keep rate"]["value"] == (
        gb["E CUDA graphs + text + heads"]["img_per_s"] / gb["A CUDA graphs + text"]["img_per_s"])
    steady = next(t for t in targets if t["name"].startswith("build / teacher forward [steady"))
    assert steady["value"] == s["build"]["steady_ratio"] and steady["required"] == ">= 0.9"
    by_name = {t["name"].split(" (")[0]: t for t in targets}
    d_rate = by_name["D training, real loop, img/s [eager]"]
    assert d_rate["value"] == lb["D"]["img_per_s"] and d_rate["required"] == ">= 3500"
    assert d_rate["met"] == (d_rate["value"] >= 3500)
    # A's own row, not "A padded texts" beside it
    assert by_name["A training, real loop, img/s [eager]"]["value"] == lb["A"]["img_per_s"]
    ratio = next(t for t in targets if t["name"].startswith("D step / A step"))
    assert ratio["required"] == "<= 1.25" and ratio["met"] == (ratio["value"] <= 1.25)
    build = next(t for t in targets if t["name"].startswith("build / teacher forward"))
    assert build["value"] == s["build"]["ratio"] and build["met"] == (s["build"]["ratio"] >= 0.9)
    for t in targets:  # GPU-only figures are not measured on CPU, and then not judged
        gpu_only = "GPU busy" in t["name"] or "host syncs" in t["name"]
        assert (t["value"] is None and t["met"] is None) if gpu_only else isinstance(t["met"], bool), t
    assert result["targets_device"] == result["device"] and "tiny CPU run" in result["targets_note"]
    assert "not the GPU targets" in md

    assert "- graphed vs eager tower, E: output 0.0e+00, gradients 0.0e+00 (largest relative difference; 2 graph(s))" \
        in md
    assert "- **A CUDA graphs**: None graph(s) captured; capture failed or off: no graphs: not a CUDA device" in md
    assert "- graphed vs eager tower, E heads: output 0.0e+00, gradients 0.0e+00 (largest relative difference; 1 " \
        "graph(s))" in md and "- with the heads on the patch grid too, over the blocks and text layers, img/s: E " in md
    for heading in ("## Targets", "## 1. Build", "## 2. Students", "## 3. Real training loop", "## 3b. Real training",
                    "## 4. Peer",
                    "## 6. Training step", "## 7. Efficiency table", "Tiny CPU run"):
        assert heading in md
    assert "| target | required | measured | met |" in md and "| D step / A step, real loop [eager] | <= 1.25 |" in md
    assert "| run | infer img/s | synth step ms |" in md  # the ablation's cost-table layout


def test_a_spent_budget_skips_sections_with_a_note_and_still_writes(tmp_path, capsys):
    proc, result, md = run_suite(capsys, tmp_path, "--budget", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["sections"] == {}
    assert [s["section"] for s in result["skipped"]] == list(SECTIONS)
    reasons = {s["section"]: s["reason"] for s in result["skipped"]}
    assert all("budget" in reasons[name] for name in ("build", "students", "loop", "peer", "train_step"))
    assert all(t["met"] is None and t["value"] is None for t in result["targets"])
    assert "not measured" in md and "section **build** skipped" in md


def test_full_suite_refuses_cpu(tmp_path, capsys):
    proc = suite_main(capsys, "--device", "cpu", "--out-dir", str(tmp_path))
    assert proc.returncode == 2 and "--tiny" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())


def test_compiled_section_publishes_each_configuration_and_fits_the_budget(monkeypatch):
    """The compiled loop is timed one configuration at a time, whole first (A, E, D), then by blocks, each beside
    its eager twin, and handed over after each: a run killed during a slow compilation keeps what it finished; a
    configuration that does not fit what is left is passed over for a cheaper one further down."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    class Clock:  # a budget that each timed configuration spends by its estimate
        left_s = 300.0

        def left(self):
            return self.left_s

    clock, plans, published = Clock(), [], []

    def fake_trainers(cfg, work, shards, plan):
        plans.append([(name, compiled) for name, _, compiled, *_ in plan])
        return {name: (SimpleNamespace(scope=compiled, train_step=None), None) for name, _, compiled, *_ in plan}

    def fake_run(cfg, trainers, steps=None):
        scopes = {n: t.scope for n, (t, _) in trainers.items()}
        clock.left_s -= gpu_suite.COMPILE_ESTIMATE_S[next(c for c in scopes.values() if c)]
        return [{"name": n, "compile": bool(c), "compile_scope": c or None, "img_per_s": 200.0 if c else 100.0,
                 "step_ms": 10.0 if c else 20.0} for n, c in scopes.items()]

    monkeypatch.setattr(gpu_suite, "_loop_trainers", fake_trainers)
    monkeypatch.setattr(gpu_suite, "_run_loop", fake_run)
    monkeypatch.setattr(gpu_suite, "_loop_description", lambda cfg: "fake")
    monkeypatch.setattr(gpu_suite, "COMPILE_ESTIMATE_S", {"blocks": 60, "model": 150})
    monkeypatch.setattr(gpu_suite, "COMPILED_ORDER", SCOPES_WITHOUT_GRAPHS)
    cfg = gpu_suite.settings(tiny=True, device="cpu")
    section = gpu_suite.section_loop_compiled(cfg, Path("/nonexistent"), clock, "shards", reserve_after=50,
                                              publish=published.append)
    # 300 s: A whole (150 s) leaves 150 - 50 reserved, too little for another whole model, enough for D by blocks
    assert plans == [[("A eager", None), ("A compiled model", "model")],
                     [("D eager", None), ("D compiled blocks", "blocks")]]
    assert [len(p["rows"]) for p in published] == [2, 4]
    assert "still to measure: E compiled model, D compiled model, D compiled blocks" in published[0]["note"]
    assert section["by_scope"] == {"model": {"compiled_over_twin_img_per_s": {"A": 2.0}, "twins": {"A": "A eager"}},
                                   "blocks": {"compiled_over_twin_img_per_s": {"D": 2.0}, "twins": {"D": "D eager"}}}
    assert "left out for the budget: E compiled model, D compiled model, A compiled blocks, E compiled blocks" \
        in section["note"]
    targets = gpu_suite.evaluate_targets({"loop_compiled": section}, cfg, tiny=True)
    model = {t["name"].split(",")[0]: t["value"] for t in targets if "[compiled model]" in t["name"]}
    assert model["E / A train img/s"] is None  # no E compiled whole to divide
    assert next(t for t in targets if t["name"].startswith("D training, real loop, img/s [compiled blocks]"))[
        "value"] == 200.0


def test_blocks_compiled_and_graphed_are_timed_beside_the_graphed_blocks_and_judged_as_their_own_rows(monkeypatch):
    """--compile-scope blocks with --cuda-graphs on (COMPILED_ORDER's first scope): its twin is the blocks graphed
    uncompiled, so its ratio is what compiling adds to the graphs; what each trainer captured is reported, and the
    targets read its rows under their own label, apart from the blocks compiled alone."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    assert gpu_suite.COMPILED_ORDER[:3] == (("A", "blocks+graphs"), ("D", "blocks+graphs"), ("E", "blocks+graphs"))
    scopes = {scope for _, scope in gpu_suite.COMPILED_ORDER}  # every scope has its settings, estimate and limit
    assert scopes == set(gpu_suite.COMPILE_SETTINGS) == set(gpu_suite.COMPILE_ESTIMATE_S) == set(
        gpu_suite.COMPILE_LIMIT_S)
    plans = []

    class TwoGraphs:  # what each fake trainer captured
        failed = None

        def __len__(self):
            return 2

        def captured(self, tag):
            return 0

    def fake_trainers(cfg, work, shards, plan):
        plans.append([(name, compiled, *fields) for name, _, compiled, *fields in plan])
        return {name: (SimpleNamespace(block_graphs=TwoGraphs(), train_step=None), None) for name, *_ in plan}

    def fake_run(cfg, trainers, steps=None):
        return [{"name": n, "compile": "compiled" in n, "compile_scope": "blocks" if "compiled" in n else None,
                 "img_per_s": {"A": 300.0, "D": 240.0}[n[0]] * (1.25 if "compiled" in n else 1.0),
                 "step_ms": 10.0} for n in trainers]

    class Clock:
        left_s = 100.0

        def left(self):
            return self.left_s

    monkeypatch.setattr(gpu_suite, "_loop_trainers", fake_trainers)
    monkeypatch.setattr(gpu_suite, "_run_loop", fake_run)
    monkeypatch.setattr(gpu_suite, "_loop_description", lambda cfg: "fake")
    monkeypatch.setattr(gpu_suite, "COMPILED_ORDER", (("A", "blocks+graphs"), ("D", "blocks+graphs")))
    cfg = gpu_suite.settings(tiny=True, device="cpu")
    section = gpu_suite.section_loop_compiled(cfg, Path("/nonexistent"), Clock(), "shards", reserve_after=0)
    graphed = {"cuda_graphs": "on", "cuda_graphs_text": "on"}  # the blocks and the text layers, as compiled blocks
    assert plans == [[("A CUDA graphs + text", None, graphed), ("A compiled blocks+graphs", "blocks+graphs")],
                     [("D CUDA graphs + text", None, graphed), ("D compiled blocks+graphs", "blocks+graphs")]]
    assert gpu_suite.COMPILE_SETTINGS["blocks+graphs"] == {"compile": True, "compile_scope": "blocks",
                                                           "cuda_graphs": "on"}
    assert list(section["by_scope"]) == ["blocks+graphs"]
    assert section["by_scope"]["blocks+graphs"]["compiled_over_twin_img_per_s"] == {"A": 1.25, "D": 1.25}
    assert section["by_scope"]["blocks+graphs"]["twins"] == {"A": "A CUDA graphs + text", "D": "D CUDA graphs + text"}
    assert all(r["graphs_captured"] == 2 and r["graphs_failed"] is None for r in section["rows"])
    targets = gpu_suite.evaluate_targets({"loop_compiled": section}, cfg, tiny=True)
    labels = {t["name"]: t["value"] for t in targets if "compiled" in t["name"]}
    assert labels["A training, real loop, img/s [compiled blocks+graphs]"] == 375.0
    assert not any("[compiled blocks]" in name for name in labels)  # graphed rows are not the blocks-alone rows
    md = gpu_suite.markdown({**_minimal_result(), "sections": {"loop_compiled": section}})
    assert "compiled blocks+graphs / graphed img/s: A 1.25x, D 1.25x" in md
    assert "**A compiled blocks+graphs**: 2 graph(s) captured" in md


def test_blocks_compiled_under_every_graph_are_timed_beside_every_graph_uncompiled_and_can_be_timed_alone(
        monkeypatch, tmp_path, capsys):
    """blocks+all-graphs: the image blocks compiled with every graph (blocks, text layers, heads, loss terms), a
    configuration TrainConfig accepts, beside every graph uncompiled; ``--compiled SCOPE`` (cfg["compiled_scopes"])
    times that scope's configurations alone, in COMPILED_ORDER's order, with what each trainer's graphs captured;
    an unknown scope is refused before anything runs."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite
    from cxrdr.train.config import TrainConfig

    settings = gpu_suite.COMPILE_SETTINGS["blocks+all-graphs"]
    assert settings == {"compile": True, "compile_scope": "blocks", **gpu_suite.ALL_GRAPHS}
    assert TrainConfig(shards="s", **settings).heads_graphs() and TrainConfig(shards="s", **settings).losses_graphs()
    assert gpu_suite._compiled_twin("E", "blocks+all-graphs") == ("E all CUDA graphs", gpu_suite.ALL_GRAPHS)
    assert gpu_suite.compiled_order(["blocks+all-graphs"]) == [("A", "blocks+all-graphs"), ("D", "blocks+all-graphs"),
                                                               ("E", "blocks+all-graphs")]
    assert gpu_suite.compiled_order([]) == list(gpu_suite.COMPILED_ORDER)
    with pytest.raises(ValueError, match=r"--compiled blocks\+everything: no such compile scope \(scopes: model, "):
        gpu_suite.compiled_order(["blocks+everything"])
    proc = suite_main(capsys, "--tiny", "--device", "cpu", "--out-dir", str(tmp_path), "--compiled", "blocks+everything")
    assert proc.returncode == 2 and "no such compile scope" in proc.stderr and not list(tmp_path.iterdir())

    plans = []

    class Captured:  # a fake trainer's graphs: 9 in all, 3 of the text tower, 1 of the heads, 1 of the loss terms
        failed = None

        def __len__(self):
            return 9

        def captured(self, tag):
            return {"text": 3, "heads": 1, "losses": 1}[tag]

    def fake_trainers(cfg, work, shards, plan):
        plans.append([(name, compiled, *fields) for name, _, compiled, *fields in plan])
        return {name: (SimpleNamespace(block_graphs=Captured(), train_step=None), None) for name, *_ in plan}

    def fake_run(cfg, trainers, steps=None):
        return [{"name": n, "img_per_s": {"A": 400.0, "D": 320.0, "E": 600.0}[n[0]] * (1.5 if "compiled" in n else 1),
                 "step_ms": 10.0} for n in trainers]

    monkeypatch.setattr(gpu_suite, "_loop_trainers", fake_trainers)
    monkeypatch.setattr(gpu_suite, "_run_loop", fake_run)
    monkeypatch.setattr(gpu_suite, "_loop_description", lambda cfg: "fake")
    cfg = {**gpu_suite.settings(tiny=True, device="cpu"), "compiled_scopes": ["blocks+all-graphs"]}
    clock = SimpleNamespace(left=lambda: 1000.0)
    section = gpu_suite.section_loop_compiled(cfg, Path("/nonexistent"), clock, "shards", reserve_after=0)
    assert plans == [[(f"{v} all CUDA graphs", None, gpu_suite.ALL_GRAPHS), (f"{v} compiled blocks+all-graphs",
                                                                              "blocks+all-graphs")] for v in "ADE"]
    assert section["by_scope"]["blocks+all-graphs"]["compiled_over_twin_img_per_s"] == {"A": 1.5, "D": 1.5, "E": 1.5}
    assert "left out" not in section["note"] and "for blocks+all-graphs every graph uncompiled" in section["note"]
    assert all(r["graphs_captured"] == 9 and r["text_graphs_captured"] == 3 and r["heads_graphs_captured"] == 1
               and r["losses_graphs_captured"] == 1 for r in section["rows"])
    labels = {t["name"]: t["value"] for t in gpu_suite.evaluate_targets({"loop_compiled": section}, cfg, tiny=True)}
    assert labels["A training, real loop, img/s [compiled blocks+all-graphs]"] == 600.0
    assert labels["E / A train img/s, real loop, E at its target keep rate [compiled blocks+all-graphs]"] == 1.5
    md = gpu_suite.markdown({**_minimal_result(), "sections": {"loop_compiled": section}})
    assert "compiled blocks+all-graphs / graphed img/s: A 1.5x, D 1.5x, E 1.5x" in md
    assert ("**E compiled blocks+all-graphs**: 9 graph(s) captured (3 of the text tower) (1 of the heads) (1 of the "
            "loss terms)") in md


def test_a_compiled_configuration_past_its_limit_is_recorded_and_the_section_goes_on(monkeypatch):
    """On CUDA each compiled configuration runs in a child process killed at its limit (COMPILE_LIMIT_S, or what the
    budget leaves): one that does not finish is recorded with the reason, and the next is measured, with one compile
    thread from then on."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite
    from child_deadline import DeadlineExceeded

    class Clock:
        left_s = 1000.0

        def left(self):
            return self.left_s

    clock, limits, envs, published = Clock(), {}, {}, []

    def fake_call(fn, seconds, *args, env=None):
        if fn is gpu_suite.inductor_smoke:
            return 7.5
        cfg, work, shards, variant, scope = args
        assert fn is gpu_suite.compiled_configuration_rows and "recompiles" in env["TORCH_LOGS"]
        limits[(variant, scope)] = seconds
        envs[(variant, scope)] = env.get("TORCHINDUCTOR_COMPILE_THREADS")
        clock.left_s -= seconds if variant == "E" else 50
        if (variant, scope) == ("E", "model"):
            raise DeadlineExceeded("compiled_configuration_rows did not return within 180 s; its child process "
                                   "was killed", [dict(pid=10, ppid=1, state="S", busy=0.0, cpu_s=50.0, cmd="python"),
                                                  dict(pid=11, ppid=10, state="R", busy=0.97, cpu_s=30.0,
                                                       cmd="python -m torch._inductor.compile_worker")])
        return [{"name": f"{variant} eager", "img_per_s": 100.0, "step_ms": 20.0},
                {"name": gpu_suite._compiled_name(variant, scope), "img_per_s": 150.0, "step_ms": 13.0}]

    monkeypatch.setattr(gpu_suite, "call_with_deadline", fake_call)
    monkeypatch.setattr(gpu_suite, "_loop_description", lambda cfg: "fake")
    monkeypatch.setattr(gpu_suite, "COMPILED_ORDER", SCOPES_WITHOUT_GRAPHS)
    cfg = {**gpu_suite.settings(tiny=True, device="cpu"), "device": "cuda"}
    section = gpu_suite.section_loop_compiled(cfg, Path("/nonexistent"), clock, "shards", reserve_after=100,
                                              publish=published.append)
    assert limits[("E", "model")] == gpu_suite.COMPILE_LIMIT_S["model"]
    assert section["failed"] == [{"name": "E compiled model", "error": "compiled_configuration_rows did not return "
                                  "within 180 s; its child process was killed", "env": {}, "processes": [
                                      dict(pid=10, ppid=1, state="S", busy=0.0, cpu_s=50.0, cmd="python"),
                                      dict(pid=11, ppid=10, state="R", busy=0.97, cpu_s=30.0,
                                           cmd="python -m torch._inductor.compile_worker")]}]
    assert envs[("A", "model")] is None and envs[("E", "model")] is None and envs[("D", "model")] == "1"
    assert not published[0]["failed"] and published[1]["failed"] and len(published[1]["rows"]) == 2  # at once
    assert section["by_scope"]["model"]["compiled_over_twin_img_per_s"] == {"A": 1.5, "D": 1.5}
    assert "E compiled model" not in section["note"]  # not "left out": tried and recorded
    md = gpu_suite.markdown({**_minimal_result(), "sections": {"loop_compiled": section}})
    assert "E compiled model** not measured: compiled_configuration_rows did not return" in md
    assert ("killed; 2 processes at the deadline (1 R, 1 S), 1 busy: python -m torch._inductor.compile_worker "
            "0.97 core") in md
    assert section["smoke"] == {"attempts": [{"env": {}, "seconds": 7.5}], "env": {}}
    assert "smoke check (a two-layer MLP's step compiled in a child): inductor defaults: 7.5 s" in md


@pytest.mark.parametrize("works_with_one_thread", [True, False])
def test_the_compiled_section_first_checks_that_inductor_compiles_at_all(monkeypatch, works_with_one_thread):
    """On CUDA a two-layer MLP is compiled in a child first: if it does not finish, once more with one compile
    thread, whose setting the configurations then get; if neither finishes, no configuration spends its limit."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite
    from child_deadline import DeadlineExceeded

    class Clock:
        def left(self):
            return 1000.0

    envs = []

    def fake_call(fn, seconds, *args, env=None):
        if fn is gpu_suite.inductor_smoke:
            assert seconds == gpu_suite.SMOKE_LIMIT_S and args == ("cuda",)
            if env == gpu_suite.SMOKE_FALLBACK_ENV and works_with_one_thread:
                return 12.0
            raise DeadlineExceeded("inductor_smoke did not return within 60 s; its child process was killed")
        envs.append(env)
        return [{"name": f"{args[3]} eager", "img_per_s": 100.0, "step_ms": 20.0},
                {"name": gpu_suite._compiled_name(args[3], args[4]), "img_per_s": 150.0, "step_ms": 13.0}]

    monkeypatch.setattr(gpu_suite, "call_with_deadline", fake_call)
    monkeypatch.setattr(gpu_suite, "_loop_description", lambda cfg: "fake")
    monkeypatch.setattr(gpu_suite, "COMPILED_ORDER", SCOPES_WITHOUT_GRAPHS)
    cfg = {**gpu_suite.settings(tiny=True, device="cpu"), "device": "cuda"}
    section = gpu_suite.section_loop_compiled(cfg, Path("/nonexistent"), Clock(), "shards", reserve_after=0)
    first = {"env": {}, "error": "inductor_smoke did not return within 60 s; its child process was killed"}
    md = gpu_suite.markdown({**_minimal_result(), "sections": {"loop_compiled": section}})
    if works_with_one_thread:
        one_thread = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
        assert section["smoke"] == {"attempts": [first, {"env": one_thread, "seconds": 12.0}], "env": one_thread}
        assert envs and all(e["TORCHINDUCTOR_COMPILE_THREADS"] == "1" and "recompiles" in e["TORCH_LOGS"] for e in envs)
        assert "TORCHINDUCTOR_COMPILE_THREADS=1: 12.0 s" in md
    else:
        assert envs == [] and section["rows"] == [] and section["smoke"]["env"] is None
        assert section["note"].startswith("not measured: torch.compile of a two-layer MLP did not finish within 60 s")
        assert "inductor defaults: inductor_smoke did not return within 60 s" in md


def _minimal_result() -> dict:
    return {"device": "fake", "mode": "full", "torch": "x", "cuda": None, "date": "d", "command": "c",
            "elapsed_s": 1.0, "budget_s": 1.0, "peak_bf16_flops": None, "targets": [], "targets_device": "fake",
            "targets_note": "n", "skipped": [], "errors": {}}


def test_skipped_sections_are_noted_and_each_section_hands_over_the_result_so_far(tmp_path, capsys):
    """--skip leaves sections out with a note (an unknown name is an error naming the sections), and
    on_section gets the result, targets included, after every section: what a call killed at its time
    limit has written."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    assert gpu_suite.main(["--tiny", "--device", "cpu", "--skip", "loop,bogus", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--skip bogus: no such section" in err and "parts: inference_compiled" in err
    assert not list(tmp_path.iterdir())

    handed = []
    result = gpu_suite.run_suite(True, "cpu", 60.0, tmp_path, log=lambda m: None, skip_sections=gpu_suite.SECTIONS,
                                 on_section=lambda r: handed.append([s["section"] for s in r["skipped"]]))
    skipped = [s["section"] for s in result["skipped"]]
    assert set(skipped) == set(gpu_suite.SECTIONS) and result["sections"] == {}
    # table: nothing to tabulate; loop_compiled: the tiny run never times it
    assert all(s["reason"] == "skipped: --skip" for s in result["skipped"]
               if s["section"] not in ("table", "loop_compiled"))
    assert handed and handed[-1] == skipped[:len(handed[-1])] and len(handed[0]) == 1
    assert all(t["met"] is None for t in result["targets"])


def test_compiled_inference_times_the_whole_image_encoder_compiled_as_one_graph():
    """The students section's compiled inference figure (E / A inference [compiled whole]): the image encoder
    compiled whole, with no graph break (fullgraph), gives the eager embeddings and a throughput; a failure to
    compile is recorded in the row instead of raised."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite
    import torch

    from cxrdr.train.models import build_student

    torch.manual_seed(0)
    model = build_student("tiny-E")
    x = torch.rand(2, 1, model.image_size, model.image_size)
    with torch.no_grad():
        eager = model.eval().encode_image(x)
    compiled_calls = []
    original = torch.compile

    def recording_compile(fn, **kwargs):
        compiled_calls.append(kwargs)
        return original(fn, **kwargs)

    try:
        torch.compile = recording_compile
        m = gpu_suite._compiled_inference(model.train(), {"batch_size": 2, "iters": 1, "warmup": 0},
                                          backend="aot_eager")
        failed = gpu_suite._compiled_inference(model, {"batch_size": 2, "iters": 1, "warmup": 0},
                                               backend="no-such-backend")
    finally:
        torch.compile = original
        torch._dynamo.reset()
    assert m[gpu_suite.COMPILED_INFERENCE] > 0 and m["inference_compiled_mode"] == "whole encoder, aot_eager"
    assert 0 < m["inference_compile_s"] <= m["inference_compiled_seconds"]  # the first call compiles
    assert compiled_calls[0] == {"backend": "aot_eager", "fullgraph": True}  # no CUDA graphs off CUDA
    assert model.training  # left as it was found
    assert "no-such-backend" in failed["inference_compiled_error"] and gpu_suite.COMPILED_INFERENCE not in failed
    with torch.no_grad():
        assert torch.allclose(torch.compile(model.eval().encode_image, backend="aot_eager", fullgraph=True)(x),
                              eager, atol=1e-5)
    torch._dynamo.reset()


def test_sections_skipped_by_the_command_reserve_no_time():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    cfg = gpu_suite.settings(tiny=False, device="cuda")
    r = cfg["reserve"]
    assert gpu_suite.reserve_after(cfg, "loop_compiled") == r["train_step"] + r["table"]
    assert gpu_suite.reserve_after(cfg, "loop_graphs", ("peer", "train_step")) == r["loop_compiled"] + r["table"]
    assert gpu_suite.reserve_after(cfg, "loop", ("train_step", "peer")) == r["loop_graphs"] + r["loop_compiled"]


class FakeKinetoEvent:
    """What gpu_activity_spans reads of a raw profiler event."""

    def __init__(self, device, start_us, end_us, annotation=False, name="kernel"):
        from torch.autograd import DeviceType

        self._device = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
        self._span, self._annotation, self._name = (start_us * 1000, end_us * 1000), annotation, name

    def device_type(self):
        return self._device

    def is_user_annotation(self):
        return self._annotation

    def start_ns(self):
        return self._span[0]

    def end_ns(self):
        return self._span[1]

    def name(self):
        return self._name


def test_gpu_busy_counts_kernels_once_and_not_the_gpu_copies_of_annotations():
    """A record_function range (Optimizer.step, a compiled region, the loop's phases) is drawn on the GPU's
    timeline over its kernels and the gaps between them: busy time counts the kernels alone, overlaps once."""
    from cxrdr.train.evaluation.efficiency import gpu_activity_spans, union_length

    events = [FakeKinetoEvent("cuda", 0, 10), FakeKinetoEvent("cuda", 5, 12),  # two streams overlapping
              FakeKinetoEvent("cuda", 40, 50),
              FakeKinetoEvent("cuda", 0, 50, annotation=True, name="Optimizer.step#AdamW.step"),
              FakeKinetoEvent("cpu", 0, 100, name="aten::mm")]
    spans = gpu_activity_spans(events)
    assert spans == [(0, 10), (5, 12), (40, 50)]
    assert union_length(spans) == 22 and union_length([]) == 0


def test_profile_step_splits_the_gpus_waits_over_the_host_phases():
    """profile_step's idle report: the gaps between the GPU's work, each split over the host phase (data,
    forward, ...) that ran meanwhile, the rest "between phases"."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import profile_step

    from cxrdr.train.evaluation.efficiency import merged_spans

    gpu = [(0, 10), (8, 20), (30, 40), (45, 60)]  # busy 0-20, 30-40, 45-60: gaps 20-30 and 40-45
    phases = {"data": [(18, 26)], "forward": [(26, 29)], "backward": [(41, 44)]}
    r = profile_step.idle_by_phase(gpu, phases)
    assert r["busy"] == 45 and r["idle"] == 15 and r["gaps"] == 2
    assert r["by_phase"] == {"data": 6, "forward": 3, "backward": 3, "between phases": 3}
    assert merged_spans([(5, 6), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 6)]



def test_students_compile_the_encoders_only_where_the_budget_allows(monkeypatch):
    """The students section compiles the loop family's A and E encoders (``_compiled_inference``) only where the
    budget, less what the later sections hold back, has COMPILED_INFERENCE_ESTIMATE_S left; else it notes it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    from cxrdr.train.evaluation import efficiency

    compiled = []
    monkeypatch.setattr(efficiency, "efficiency_metrics", lambda model, **kw: {"train_img_per_s": 2.0,
                                                                            "inference_img_per_s": 4.0,
                                                                            "gflops_per_img": 1.0})
    monkeypatch.setattr(gpu_suite, "_compiled_inference",
                        lambda model, st: compiled.append(model.config.variant) or {gpu_suite.COMPILED_INFERENCE: 8.0})
    cfg = gpu_suite.settings(tiny=True, device="cpu")
    cfg.update(compile=True, families={"tiny": ("tiny-{v}", {}, "AE")})

    class Budget:
        def __init__(self, left_s):
            self.left_s = left_s

        def left(self):
            return self.left_s

    room = gpu_suite.section_students(cfg, Path("/nonexistent"), Budget(200.0), reserve_after=100.0)
    assert compiled == ["A", "E"] and room["skipped"] == []
    assert room["E_over_A"]["tiny"][gpu_suite.COMPILED_INFERENCE] == 1.0
    tight = gpu_suite.section_students(cfg, Path("/nonexistent"), Budget(150.0), reserve_after=100.0)
    assert compiled == ["A", "E"]  # not again: 150 - 100 < COMPILED_INFERENCE_ESTIMATE_S
    assert [s.split(":")[0] for s in tight["skipped"]] == ["tiny tiny-A compiled inference",
                                                         "tiny tiny-E compiled inference"]
    assert gpu_suite.COMPILED_INFERENCE not in tight["E_over_A"]["tiny"]
    cfg["compiled_inference"] = False  # --skip inference_compiled: not timed, whatever the budget
    left_out = gpu_suite.section_students(cfg, Path("/nonexistent"), Budget(1000.0))
    assert compiled == ["A", "E"] and left_out["skipped"] == []


def test_patch_embed_benchmark_times_both_forms_and_prints_their_difference(capsys):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import patch_embed

    assert patch_embed.main(["--batch", "2", "--size", "32", "--patch", "8", "--width", "16", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert float(out[0].rsplit(" ", 1)[1]) < 1e-5  # max |conv - matmul|
    assert [line.split()[0] for line in out[1:]] == ["forward", "forward"]
    assert all("convolution" in line and "matrix product" in line and line.endswith("x)") for line in out[1:])


def test_profile_step_profiles_the_image_encoder_without_shards(tmp_path, capsys):
    """profile_step --encoder: the image encoder's inference per model (no shards needed); the step's profiles
    still need --shards, and say so."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import profile_step

    assert profile_step.main(["--encoder", "--out-dir", str(tmp_path), "--models", "tiny-E", "--batch-size", "2",
                              "--device", "cpu", "--warmup", "1", "--steps", "1"]) == 0
    text = (tmp_path / "profile-tiny-E-encoder.txt").read_text()
    assert text.startswith("tiny-E image encoder: 1 batches of 2 on cpu") and "aten::linear" in text
    with pytest.raises(SystemExit):
        profile_step.main(["--out-dir", str(tmp_path)])
    assert "--shards is required" in capsys.readouterr().err


@pytest.mark.parametrize("comparisons", [True, False])
def test_the_loop_section_leaves_its_comparisons_out_when_told(monkeypatch, comparisons):
    """--skip loop_comparisons: the real loop times A-E alone (the padded-text A and the former heads' D and E,
    measured on three leases, give their time to the compiled section) and says so."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_suite

    planned = []

    def fake_trainers(cfg, work, shards, plan):
        planned.extend(name for name, *_ in plan)
        return {}

    monkeypatch.setattr(gpu_suite, "_loop_trainers", fake_trainers)
    monkeypatch.setattr(gpu_suite, "_run_loop", lambda cfg, trainers: [
        {"name": n, "img_per_s": 100.0 + i, "step_ms": 10.0 - i / 10} for i, n in enumerate(planned)])
    monkeypatch.setattr(gpu_suite, "_loop_description", lambda cfg: "fake")
    cfg = {**gpu_suite.settings(tiny=True, device="cpu"), "loop_comparisons": comparisons}
    section = gpu_suite.section_loop(cfg, Path("/nonexistent"), None, "shards")
    extra = [gpu_suite.PADDED_A, gpu_suite.FORMER_HEADS_D, gpu_suite.FORMER_HEADS_E]
    assert planned == list(gpu_suite.VARIANTS) + (extra if comparisons else [])
    assert ("A_packed_over_padded_img_per_s" in section) is comparisons and "D_over_A_step" in section
    assert section["note"].endswith("target rates") is comparisons
    md = gpu_suite.markdown({**_minimal_result(), "sections": {"loop": section}})
    assert "E / A img/s" in md


def test_compiled_and_graphed_configurations_share_their_eager_twins_flop_count():
    """A graphed or compiled step's FLOPs cannot be counted through the graph: it takes its eager twin's, and only
    settings that change the computation (padded texts, other heads) make another key."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_step

    from cxrdr.train.config import TrainConfig

    def key(**fields):
        return train_step.eager_twin_key(TrainConfig.load(None, shards="s", model="D", **fields))

    eager = key(cuda_graphs="off")
    assert key(cuda_graphs="on") == key(cuda_graphs="on", cuda_graphs_text="on") == key(compile=True) == eager
    assert key(cuda_graphs="on", cuda_graphs_heads="on", cuda_graphs_losses="on") == eager
    assert key(cuda_graphs="off", pack_text=False) != eager
