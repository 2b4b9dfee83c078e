"""benchmarks/gpu_suite.py: its tiny CPU run, so the GPU suite never rots between GPU sessions.

Checks the structure of what it writes (every section present and holding measured numbers,
targets evaluated, the Markdown naming them), and that an exhausted time budget skips sections
with a note instead of overrunning. No speed is asserted: figures belong to benchmarks.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "gpu_suite.py"
SECTIONS = ("build", "students", "train_step", "table")


def run_suite(out_dir: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SUITE), "--tiny", "--device", "cpu", "--threads", "1",
                           "--out-dir", str(out_dir), *args], capture_output=True, text=True, env=env, timeout=240)
    written = sorted(out_dir.glob("*.json"))
    assert len(written) == 1, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert written[0].name.startswith("cpu-") and written[0].name.endswith("-tiny.json")
    md = written[0].with_suffix(".md").read_text()
    return proc, json.loads(written[0].read_text()), md


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_tiny_suite_measures_every_section(tmp_path):
    proc, result, md = run_suite(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["errors"] == {} and result["skipped"] == []
    assert set(result["sections"]) == set(SECTIONS)
    s = result["sections"]

    assert positive(s["build"]["build_samples_per_s"]) and positive(s["build"]["teacher_samples_per_s"])
    assert s["build"]["ratio"] == s["build"]["build_samples_per_s"] / s["build"]["teacher_samples_per_s"]
    assert s["build"]["samples"] == 16

    rows = s["students"]["rows"]
    assert [(r["family"], r["variant"]) for r in rows] == [(f, v) for f in ("tiny", "cpu") for v in "ABCDE"]
    for r in rows:
        for key in ("train_img_per_s", "inference_img_per_s", "latency_ms_per_img", "peak_memory_mb",
                    "gflops_per_img", "patch_usage_pct"):
            assert positive(r[key]), (r["config"], key, r[key])
    by = {r["config"]: r for r in rows}
    assert by["tiny-E"]["patch_usage_pct"] < by["tiny-A"]["patch_usage_pct"]  # E timed at its target keep rate
    assert by["tiny-E"]["gflops_per_img"] < by["tiny-A"]["gflops_per_img"]
    assert s["students"]["E_over_A"]["tiny"]["train_img_per_s"] == (
        by["tiny-E"]["train_img_per_s"] / by["tiny-A"]["train_img_per_s"])

    names = [r["name"] for r in s["train_step"]["rows"]]
    assert names == ["A stored", "E stored", "D stored", "D plain (no teacher)", "D online random:tiny"]
    assert all(positive(r["step_ms"]) for r in s["train_step"]["rows"])
    assert positive(s["train_step"]["online_over_stored"])
    assert s["train_step"]["shards"] == s["build"]["shards"]  # the build's shards, stored teacher = online one

    table = s["table"]["rows"]
    assert [r["run"] for r in table] == list("ABCDE")
    for r in table:
        for key in ("inference_img_per_s", "train_step_ms", "latency_ms", "peak_memory_mb", "gflops_per_img",
                    "patch_usage_pct", "step_ms", "train_img_per_s"):
            assert positive(r[key]), (r["run"], key)

    targets = {t["target"]: t for t in result["targets"]}
    assert set(targets) == {">= 0.9", ">= 1.5"}
    assert targets[">= 0.9"]["value"] == s["build"]["ratio"]
    assert targets[">= 0.9"]["met"] == (s["build"]["ratio"] >= 0.9)
    for heading in ("## Targets", "## 1. Build", "## 2. Students", "## 3. Training step", "## 4. Efficiency table",
                    "Tiny CPU run"):
        assert heading in md
    assert "| run | infer img/s | synth step ms |" in md  # the ablation's cost-table layout


def test_a_spent_budget_skips_sections_with_a_note_and_still_writes(tmp_path):
    proc, result, md = run_suite(tmp_path, "--budget", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert result["sections"] == {}
    assert [s["section"] for s in result["skipped"]] == list(SECTIONS)
    assert all("budget" in s["reason"] for s in result["skipped"])
    assert all(t["met"] is None and t["value"] is None for t in result["targets"])
    assert "not measured" in md and "section **build** skipped" in md


def test_full_suite_refuses_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SUITE), "--device", "cpu", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "--tiny" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())
