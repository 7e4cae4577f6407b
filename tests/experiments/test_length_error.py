"""``tidal bench length-error``: the online replay of the split planner's length predictor."""

from __future__ import annotations

import pytest

from tests.workload.test_workloads import needs_traces
from tidal.cli import main as cli_main
from tidal.experiments.length_error import replay_errors


def test_replay_predicts_before_it_observes():
    # 256 + 20 first (no history), then the running mean + 20: 120, 80 + 20 ...
    r = replay_errors([(100, 100), (100, 60), (100, 80)], margin=20)
    # predictions 276, 120, 100 against 100, 60, 80: errors +176, +60, +20
    assert r["n"] == 3 and r["predicted_mean"] == pytest.approx((276 + 120 + 100) / 3)
    assert r["within_100"] == pytest.approx(2 / 3) and r["under"] == 0.0
    assert r["mae"] == pytest.approx((176 + 60 + 20) / 3)


@needs_traces
def test_the_command_reads_the_traces_and_refuses_a_missing_dir(tmp_path, capsys):
    assert cli_main(["bench", "length-error", "--limit", "300", "--output", str(tmp_path / "l.json")]) == 0
    out = capsys.readouterr().out
    assert "azure" in out and "within +-100" in out and (tmp_path / "l.json").exists()
    assert cli_main(["bench", "length-error", "--traces-dir", str(tmp_path / "none"),
                     "--output", str(tmp_path / "m.json")]) == 2
