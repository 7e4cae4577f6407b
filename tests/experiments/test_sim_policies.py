"""``tidal bench sim-policies``: every policy of a scenario gets a row, and the rows are the same
whether the policies run here one after another or on ``--jobs`` processes."""

from __future__ import annotations

import json

from tidal.cli import main
from tidal.experiments.sim_policies import SCENARIOS


def _rows(tmp_path, jobs: int) -> dict:
    out = tmp_path / f"p{jobs}.json"
    assert main(["bench", "sim-policies", "--scenarios", "pang-sla", "--num-requests", "40", "--jobs", str(jobs),
                 "--no-plots", "--no-progress", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["scenarios"]["pang-sla"]
    for label_rows in rows.values():
        for r in label_rows:
            assert r.pop("wall_s") > 0  # each row's own wall time: the one thing that may differ
    return rows


def test_rows_are_the_same_on_one_process_and_on_two(tmp_path):
    one, two = _rows(tmp_path, 1), _rows(tmp_path, 2)
    assert one == two
    for label, rows in one.items():
        assert [r["policy"] for r in rows] == list(SCENARIOS["pang-sla"].policies), label
        assert all(r["probes"] for r in rows)


def test_an_unknown_scenario_is_one_line(capsys):
    assert main(["bench", "sim-policies", "--scenarios", "nope"]) == 2
    assert "unknown scenario 'nope'" in capsys.readouterr().err
