"""benchmarks/cpu_bars.py: the demo's seconds fitted on its student step, the CI runs counted against the bar,
and the figures docs/limitations.md and the README quote are the committed CSV's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
HEADER = "stop,kind,seconds,student_step_ms,commit,note\n"


@pytest.fixture(scope="module")
def bars():
    return load_script("benchmarks/cpu_bars.py")


def _csv(tmp_path, body):
    path = tmp_path / "bars.csv"
    path.write_text(HEADER + body)
    return path


def test_fit_recovers_a_line_and_the_step_that_meets_the_bar(bars, tmp_path):
    # seconds = 0.8 x step - 40: 300 s at 425 ms; the row without a step is read but not fitted
    rows = bars.read_rows(_csv(tmp_path, "1,demo,280,400,,\n2,demo,320,450,,\n3,demo,360,500,,\n4,demo,999,,,x\n"))
    fit = bars.demo_fit(rows)
    assert fit["n"] == 3 and fit["slope_s_per_ms"] == pytest.approx(0.8) and fit["intercept_s"] == pytest.approx(-40)
    assert fit["r"] == pytest.approx(1.0) and fit["step_ms_at_bar"] == pytest.approx(425.0)


def test_ci_runs_are_counted_per_stop_against_the_bar(bars, tmp_path):
    rows = bars.read_rows(_csv(tmp_path, "1,demo,280,400,,\n2,demo,320,450,,\n3,demo,360,500,,\n"
                                         "5,ci_tests,170.0,,abc,\n5,ci_tests,190.0,,def,control\n6,ci_tests,180.0,,,\n"))
    assert bars.tests_by_stop(rows) == {5: [170.0, 190.0], 6: [180.0]}
    text = bars.report(rows)
    assert "   5: 1 / 2, 170.0-190.0 s" in text and "   6: 1 / 1, 180.0-180.0 s" in text


def test_a_bad_row_is_named_by_its_line(bars, tmp_path):
    with pytest.raises(SystemExit, match=r"bars.csv:3: .*'seconds': 'slow'"):
        bars.read_rows(_csv(tmp_path, "1,demo,280,400,,\n2,demo,slow,450,,\n"))
    with pytest.raises(SystemExit, match="2 demo runs with a student step"):
        bars.demo_fit(bars.read_rows(_csv(tmp_path, "1,demo,280,400,,\n2,demo,300,450,,\n")))


def test_the_docs_quote_the_committed_csv(bars):
    rows = bars.read_rows(bars.CSV)
    fit = bars.demo_fit(rows)
    limitations = (REPO / "docs" / "limitations.md").read_text()
    readme = (REPO / "README.md").read_text()
    assert f"{fit['n']} demo runs" in limitations and f"r {fit['r']:.3f}" in limitations
    assert f"{fit['slope_s_per_ms']:.3f} s per ms - {-fit['intercept_s']:.0f} s" in limitations
    assert f"<= {fit['step_ms_at_bar']:.0f} ms" in limitations and f"<= {fit['step_ms_at_bar']:.0f} ms" in readme
    runs = [s for seconds in bars.tests_by_stop(rows).values() for s in seconds]
    met = sum(s <= bars.TESTS_BAR_S for s in runs)
    assert f"{met} of {len(runs)} fresh-clone CI runs" in limitations


def test_the_plot_is_written(bars, tmp_path):
    rows = bars.read_rows(_csv(tmp_path, "1,demo,280,400,,\n2,demo,320,450,,\n3,demo,360,500,,\n"
                                         "2,ci_tests,170.0,,,\n2,ci_tests,190.0,,,control: before\n"))
    bars.plot(rows, tmp_path / "figs" / "bars.png")
    assert (tmp_path / "figs" / "bars.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
