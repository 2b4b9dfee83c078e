"""benchmarks/lease_timeline.py: a lease log's chunk timeline read against its status listing's measured work."""
from __future__ import annotations

import pytest

from tests.script_loader import load_script

LOG = """[gpu-experiment] next chunk (2 copies): stops before a new unit after 390 s, killed at 480 s
[chunk 11 +0.0 s] build runs/experiments/g/shards
[chunk 12 +0.0 s] build runs/experiments/g/teachers/lite2-s1/shards
[chunk 12 +20.0 s] train runs/experiments/g/teachers/lite2-s1/run
[chunk 11 +45.0 s] train runs/experiments/g/efficiency/runs/plain/seed-10
[chunk 12 +48.0 s] add-teacher lite2-s1 to runs/experiments/g/shards
[chunk 11 +125.0 s] evaluate runs/experiments/g/efficiency/runs/plain/seed-10
[chunk 12 +100.0 s] evaluate teacher runs/experiments/g/teachers/lite2-s1/run on report
[chunk 11 +140.0 s] resume runs/experiments/g/efficiency/runs/reinforced/seed-11
[gpu-experiment] chunk exited 124 after 200 s (3: stopped with work left; 124/137: killed, resumes next call)
[gpu-experiment] chunk exited 3 after 190 s (3: stopped with work left; 124/137: killed, resumes next call)
[status] g -> runs/experiments/g/efficiency: 6 of 9 units done, 3 left
  done     students' shards                                         44.7 s  20000 samples (train 16008)
  done     teacher lite2-s1: its shards                             18.6 s  8000 samples
  done     teacher lite2-s1: training                               22.7 s  120 steps x 256
  done     teacher lite2-s1: evaluation on report                    9.5 s  load 0.8 s
  done     teacher lite2-s1: added to the students' shards          42.7 s
  done     plain seed 10: training                                  63.7 s  400 steps x 256
  done     plain seed 10: evaluation                                12.0 s  load 0.5 s
  partial  reinforced seed 11: training                                     interrupted near step 380 of 400
"""


def test_each_units_wall_is_set_against_its_measured_work_by_copy():
    timeline = load_script("benchmarks/lease_timeline.py")
    units, measured = timeline.read_log(LOG)
    walls = {(u.pid, u.name.split()[0]): u.wall for u in units}
    assert walls[(11, "build")] == 45.0 and walls[(12, "add-teacher")] == 52.0  # to the next unit of its process
    assert walls[(11, "resume")] == 60.0 and walls[(12, "evaluate")] == 100.0  # the last: to the chunk's last exit
    assert measured["plain seed 10: training"] == 63.7 and "reinforced seed 11: training" not in measured
    labels = [timeline.status_label(u.name) for u in units]
    assert labels == ["students' shards", "teacher lite2-s1: its shards", "teacher lite2-s1: training",
                      "plain seed 10: training", "teacher lite2-s1: added to the students' shards",
                      "plain seed 10: evaluation", "teacher lite2-s1: evaluation on report",
                      "reinforced seed 11: training"]
    rows = timeline.table(units, measured)
    plain = next(r for r in rows if r.endswith("plain/seed-10") and " train " in f" {r.split()[-2]} ")
    assert plain.split()[2:5] == ["80.0", "63.7", "16.3"]  # wall, measured work, the gap
    assert "–" in next(r for r in rows if "reinforced/seed-11" in r)  # cut by the kill: no measured work
    copy_11 = next(r for r in rows if r.startswith("copy 11:"))
    assert copy_11.startswith("copy 11: 140.0 s of units with measured work, 120.4 s of it their work, 19.6 s")


def test_a_log_without_a_timeline_says_so(tmp_path, capsys):
    timeline = load_script("benchmarks/lease_timeline.py")
    (tmp_path / "lease.log").write_text("[lease] installed in 10 s; mode recipe\n")
    assert timeline.main([str(tmp_path / "lease.log")]) == 2
    assert "no chunk timeline" in capsys.readouterr().err
    (tmp_path / "lease.log").write_text(LOG)
    assert timeline.main([str(tmp_path / "lease.log")]) == 0
    assert "copy 12:" in capsys.readouterr().out


@pytest.mark.parametrize("unit, label", [
    ("build runs/experiments/g/report-shards", "report set"),
    ("step benchmark", "step benchmark, results.json, table.md, plots"),
])
def test_status_labels_of_the_other_units(unit, label):
    assert load_script("benchmarks/lease_timeline.py").status_label(unit) == label
