"""`train curves`: runs' metrics.jsonl read into series, laid out in panels, drawn; bad input named."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cxrdr.common.errors import UserError
from cxrdr.train.cli import app
from cxrdr.train.curves import curve_panels, load_run, run_labels, smoothed

BATCH = 8


def write_run(folder: Path, terms=("clip",), lr=1e-3, evals=((15, 0.10), (30, 0.25)), half_line=True) -> Path:
    """A run folder's metrics.jsonl: logging steps 10, 20, 30 of BATCH samples; validation passes at ``evals``."""
    folder.mkdir(parents=True)
    records = []
    for step in (10, 20, 30):
        record = {"kind": "train", "step": step, "samples_seen": step * BATCH, "loss": 5.0 - step / 10, "lr": lr,
                  "logit_scale": 14.3, "keep_ratio": 1.0, "samples_per_s": 100.0, "grad_norm": 2.0,
                  "stage": "full"}
        for i, term in enumerate(terms):
            record[f"loss/{term}"] = 1.0 + i + step / 100
            record[f"grad_norm/{term}"] = 0.1 * (i + 1)
        records.append(record)
        records += [{"kind": "eval", "step": s, "split": "val", "mean_recall": r, "chance_mean_recall": 0.05}
                    for s, r in evals if step - 10 < s <= step]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (folder / "metrics.jsonl").write_text(text + ('{"kind": "train", "st' if half_line else ""))
    return folder


def test_a_run_is_read_into_series_with_validation_passes_placed_at_their_samples(tmp_path):
    run = load_run(write_run(tmp_path / "run"), "run")
    xs, ys = run.train["loss"]
    assert xs.tolist() == [80, 160, 240] and ys.tolist() == pytest.approx([4.0, 3.0, 2.0])
    assert run.train["loss/clip"][1].tolist() == pytest.approx([1.1, 1.2, 1.3])
    assert "stage" not in run.train and "kind" not in run.train  # text and bookkeeping are not curves
    xs, ys = run.val["mean_recall"]
    assert xs.tolist() == [120, 240] and ys.tolist() == [0.10, 0.25]  # step 15: halfway between 80 and 160
    assert run.val["chance_mean_recall"][1].tolist() == [0.05, 0.05]
    by_step = load_run(tmp_path / "run", "run", x_axis="step")
    assert by_step.train["loss"][0].tolist() == [10, 20, 30] and by_step.val["mean_recall"][0].tolist() == [15, 30]


def test_panels_cover_every_runs_quantities_each_with_the_runs_that_log_it(tmp_path):
    plain = load_run(write_run(tmp_path / "plain", terms=("clip",)), "plain")
    reinforced = load_run(write_run(tmp_path / "reinforced", terms=("distill", "feature"), lr=5e-4), "reinforced")
    panels = curve_panels([plain, reinforced])
    keys = [p.key for p in panels]
    # fixed quantities first, then loss terms, the total gradient norm and each term's; a kept-token ratio that
    # stays at 1 (no token dropped) gets no panel
    assert keys == ["loss", "val mean_recall", "lr", "logit_scale", "samples_per_s", "loss/clip", "loss/distill",
                    "loss/feature", "grad_norm", "grad_norm/clip", "grad_norm/distill", "grad_norm/feature"]
    by_key = {p.key: p for p in panels}
    assert set(by_key["loss"].lines) == {"plain", "reinforced"}
    assert set(by_key["loss/clip"].lines) == {"plain"} and set(by_key["loss/feature"].lines) == {"reinforced"}
    assert by_key["lr"].lines["reinforced"][1].tolist() == [5e-4] * 3
    assert set(by_key["val mean_recall"].chance) == {"plain", "reinforced"}
    assert by_key["val mean_recall"].title == "val mean recall (dashed: chance)"  # the split the passes read
    assert all(p.log_y == p.key.startswith("grad_norm") for p in panels)


def test_a_dropping_runs_kept_token_ratio_and_a_null_value_are_shown(tmp_path):
    folder = write_run(tmp_path / "e")
    lines = (folder / "metrics.jsonl").read_text().splitlines()[:-1]
    records = [json.loads(line) for line in lines]
    for record, keep in zip((r for r in records if r["kind"] == "train"), (1.0, 0.7, 0.4)):
        record["keep_ratio"] = keep
    records[0]["grad_norm"] = None  # NaN is written as null
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(folder, "e")
    assert run.train["keep_ratio"][1].tolist() == [1.0, 0.7, 0.4]
    assert np.isnan(run.train["grad_norm"][1][0]) and run.train["grad_norm"][1][1:].tolist() == [2.0, 2.0]
    assert "keep_ratio" in [p.key for p in curve_panels([run])]


def test_labels_are_the_shortest_trailing_paths_that_tell_runs_apart(tmp_path):
    a, b = tmp_path / "runs" / "plain" / "seed-0", tmp_path / "runs" / "reinforced" / "seed-0"
    assert run_labels([a, b]) == ["plain/seed-0", "reinforced/seed-0"]
    assert run_labels([tmp_path / "x", tmp_path / "y"]) == ["x", "y"]


def test_smoothing_is_a_debiased_moving_average_that_steps_over_gaps():
    ys = np.array([1.0, 3.0, np.nan, 2.0])
    assert smoothed(ys, 0.0)[[0, 1, 3]].tolist() == [1.0, 3.0, 2.0]
    # w 0.5: running values 0.5, 1.75, (gap), 1.875; debiased by 1 - 0.5^n for the n points seen
    assert smoothed(ys, 0.5).tolist() == pytest.approx([1.0, 1.75 / 0.75, 1.75 / 0.75, 1.875 / 0.875])
    assert np.isnan(smoothed(np.array([np.nan, 1.0]), 0.5)[0])
    with pytest.raises(UserError, match=r"--smooth must be in \[0, 1\)"):
        smoothed(ys, 1.0)


def test_bad_run_folders_are_named(tmp_path):
    with pytest.raises(UserError, match=r"missing[/\\]metrics.jsonl: no such file"):
        load_run(tmp_path / "missing", "m")
    folder = write_run(tmp_path / "damaged", half_line=False)
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    lines[1:3] = ["", "{not json"]  # the file's own line number, blank lines counted
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=r"damaged[/\\]metrics.jsonl, line 3: not a JSON record"):
        load_run(folder, "d")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "mean_recall": 0.1}\n')
    with pytest.raises(UserError, match="no training records yet"):
        load_run(tmp_path / "fresh", "f")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    with pytest.raises(UserError, match="without samples_seen; plot them with --x step"):
        load_run(tmp_path / "old", "o")
    assert load_run(tmp_path / "old", "o", x_axis="step").train["loss"][0].tolist() == [1.0]
    with pytest.raises(UserError, match="--x must be samples or step"):
        load_run(tmp_path / "damaged", "d", x_axis="epoch")


def test_the_command_draws_one_run_beside_itself_and_several_into_the_file_given(tmp_path):
    one = write_run(tmp_path / "runs" / "a" / "seed-0")
    result = CliRunner().invoke(app, ["curves", str(one)])
    assert result.exit_code == 0, result.output
    assert (one / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {one / 'curves.png'}: 8 panels, 1 run(s)" in result.output
    two = write_run(tmp_path / "runs" / "b" / "seed-0", terms=("distill",))
    refused = CliRunner().invoke(app, ["curves", str(one), str(two)])  # run_app makes these one line, exit 2
    assert isinstance(refused.exception, UserError) and "2 runs: give --out FILE.png" in str(refused.exception)
    refused = CliRunner().invoke(app, ["curves", str(one), str(two), "--label", "only-one", "--out", "x.png"])
    assert isinstance(refused.exception, UserError)
    assert "--label given 1 time(s) for 2 run(s)" in str(refused.exception) and not Path("x.png").exists()
    out = tmp_path / "figures" / "both.png"  # a folder not there yet is made
    result = CliRunner().invoke(app, ["curves", str(one), str(two), "--out", str(out), "--x", "step",
                                      "--smooth", "0.6"])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "10 panels, 2 run(s)" in result.output
