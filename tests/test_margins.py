"""Pointing-game margins over the train-box prior pooled over seeds (cxrdr.experiments.margins)."""
from __future__ import annotations

import json

import pytest

from cxrdr.experiments import margins


def _block(model, prior, keys=None):
    keys = keys or [f"img{i}" for i in range(len(model))]
    return {"keys": keys, "model": model, "chance": [0.1] * len(model), "train_prior": prior}


def test_eval_blocks_keep_the_figures_scored_against_a_train_prior():
    results = {"localisation": {"hits": {"unit": "text", "mask": _block([1, 0], [0, 0]),
                                         "mask_pathology": {"keys": ["a"], "model": [1], "chance": [0.2]},
                                         "attention": _block([1, 1, 0], [1, 0, 0], ["a", "a", "b"])}}}
    blocks = margins.eval_hit_blocks(results)
    assert set(blocks) == {"pointing_z", "pointing_attn"}  # mask_pathology has no train prior: left out
    assert blocks["pointing_attn"]["keys"] == ["a", "a", "b"]
    assert margins.eval_hit_blocks({}) == {}


def _benchmark(model_hits, prior_hits):
    scored = [{"key": f"k{i // 2}", "model": {"hit": m}, "train_prior": {"hit": p}, "chance": {"hit": 0.1}}
              for i, (m, p) in enumerate(zip(model_hits, prior_hits))]
    return {"localisation": {"per_target": {"mask": scored, "attention": scored[:2]}}}


def test_benchmark_blocks_read_the_per_target_scores(tmp_path):
    bench = _benchmark([1.0, 0.0, 1.0], [0.0, 0.0, 1.0])
    blocks = margins.benchmark_hit_blocks(bench)
    assert blocks["pg_z"] == {"keys": ["k0", "k0", "k1"], "model": [1.0, 0.0, 1.0], "train_prior": [0.0, 0.0, 1.0]}
    assert blocks["pg_attention"]["model"] == [1.0, 0.0]
    # an eval.json that names its benchmark folder brings the benchmark's figures along
    (tmp_path / "benchmark.json").write_text(json.dumps(bench))
    assert set(margins.eval_hit_blocks({"benchmark": {"dir": str(tmp_path)}})) == {"pg_z", "pg_attention"}
    with pytest.raises(FileNotFoundError, match="benchmark.json"):
        margins.eval_hit_blocks({"benchmark": {"dir": str(tmp_path / "gone")}})


def test_pooled_margins_average_the_seeds_and_bound_them():
    seed_a = {"pointing_z": _block([1, 1, 1, 1], [0, 0, 0, 0]), "pointing_attn": _block([1, 0], [0, 0])}
    seed_b = {"pointing_z": _block([1, 1, 0, 0], [0, 0, 0, 0])}
    pooled = margins.pooled_margins([seed_a, seed_b])
    assert set(pooled) == {"pointing_z"}  # only the figures every seed scored
    m = pooled["pointing_z"]
    assert m["margin"] == pytest.approx(0.75) and [s["margin"] for s in m["per_seed"]] == [1.0, 0.5]
    assert m["interval"][0] <= 0.75 <= m["interval"][1] and m["n_seeds"] == 2 and m["n_images"] == 4
    assert margins.pooled_margins([]) == {}
    # the same hits on model and prior: a margin of exactly 0, both intervals [0, 0]
    same = margins.pooled_margins([{"pointing_z": _block([1, 0, 1], [1, 0, 1])}])["pointing_z"]
    assert same["margin"] == 0 and same["interval"] == same["interval_images"] == [0.0, 0.0]


def test_margins_markdown_has_a_row_per_arm_and_figure():
    pooled = margins.pooled_margins([{"pointing_z": _block([1, 0, 1, 1], [0, 0, 1, 0])}])
    lines = margins.margins_markdown({"D": pooled, "E": pooled})
    rows = [ln for ln in lines if ln.startswith("| D") or ln.startswith("| E")]
    assert len(rows) == 2 and "+0.500" in rows[0]
    assert lines[0].startswith("## ") and margins.margins_markdown({"D": pooled}, "### NIH")[0] == "### NIH"
    assert margins.margins_markdown({}) == []
