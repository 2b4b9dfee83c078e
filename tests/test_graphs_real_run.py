"""benchmarks/graphs_real_run.py: the default graphs' run beside the eager one. On the CPU both runs are eager, so
their logged losses must be equal; a run that stops is reported by name and fails the check."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import graphs_real_run  # noqa: E402


def test_the_default_and_the_eager_run_log_the_same_losses_on_cpu(phantom_shards, tmp_path, capsys, one_thread):
    out = tmp_path / "result.json"
    code = graphs_real_run.main(["--model", "tiny-E", "--steps", "4", "--batch-size", "4", "--device", "cpu",
                                 "--shards", str(phantom_shards), "--json-out", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0 and result["ok"]
    assert [p[0] for p in result["pairs"]] == [1, 2, 3, 4] and all(g == e for _, g, e in result["pairs"])
    assert result["largest_relative_difference"] == 0.0
    assert {r["cuda_graphs"] for r in result["runs"].values()} == {None}  # off CUDA: nothing captured
    assert "largest relative difference: 0.00e+00" in printed and "every loss finite, both runs finished" in printed


def test_a_run_that_stops_fails_the_check_and_says_why(phantom_shards, tmp_path, monkeypatch, one_thread):
    from cxrdr.train import loop

    real_train = loop.train

    def stop_graphed(cfg):
        if cfg["cuda_graphs"] == "auto":
            raise FloatingPointError("non-finite loss at step 2\nmore")
        return real_train(cfg)

    monkeypatch.setattr(loop, "train", stop_graphed)
    result = graphs_real_run.run_pair(phantom_shards, tmp_path, "tiny-A", 2, 4, "cpu", 0)
    assert not result["ok"] and result["pairs"] == []
    assert result["runs"]["graphs"]["error"] == "FloatingPointError: non-finite loss at step 2"
    assert result["runs"]["eager"]["error"] is None and len(result["runs"]["eager"]["losses"]) == 2
    assert "STOPPED: FloatingPointError" in graphs_real_run.report(result)
    assert "FAILED" in graphs_real_run.report(result)


def test_heads_replays_the_heads_in_the_graphed_run_and_anneals_both_runs_alike(tmp_path, monkeypatch):
    """--heads: the graphed run asks for the heads' graphs, and both runs anneal the Top-K mask over a quarter of
    their steps (a graph holds the final K: the default 2,000 steps' anneal would outlast a short run)."""
    from cxrdr.train import loop

    seen = {}

    def record(cfg):
        seen[Path(cfg["out"]).name] = cfg
        return {}

    monkeypatch.setattr(loop, "train", record)
    graphs_real_run.run_pair(tmp_path, tmp_path, "tiny-D", 8, 4, "cpu", 0, heads=True, losses=True)
    assert (seen["graphs"]["cuda_graphs_heads"], seen["eager"]["cuda_graphs_heads"]) == ("on", "off")
    assert (seen["graphs"]["cuda_graphs_losses"], seen["eager"]["cuda_graphs_losses"]) == ("on", "off")
    assert seen["graphs"]["model_overrides"] == seen["eager"]["model_overrides"] == {"k_anneal_steps": 2}
    assert "cuda_graphs_heads" not in graphs_real_run.SETTINGS["graphs"]  # without --heads: the default graphs
