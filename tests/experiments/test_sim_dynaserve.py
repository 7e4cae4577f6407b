"""``tidal bench sim-dynaserve``: the per-request TBT criterion, the ratios against the tuned
colocation and P/D, and a tiny end-to-end run (one workload, three systems, a few probes)."""

from __future__ import annotations

import json

from tidal.cli import main as cli_main
from tidal.experiments import sim_dynaserve as B
from tidal.metrics import RequestRecord


def _rec(gaps, success=True):
    r = RequestRecord(0, 0.0, 10, len(gaps) + 1)
    r.success, r.itl_s, r.ttft_s = success, list(gaps), 0.05
    return r


def test_a_request_attains_when_its_own_p99_gap_meets_the_tbt_slo():
    assert B.attains(_rec([0.03] * 199 + [0.5]), 0.1)  # one stall in 200 gaps: the p99 is still ~30 ms
    assert not B.attains(_rec([0.03] * 20 + [0.5]), 0.1)  # one in 21: the p99 is the stall
    assert B.attains(_rec([]), 0.1)  # a single token has no gaps
    assert not B.attains(_rec([0.03] * 999 + [1.5]), 0.1)  # a stall fails it, though the p99 hides it
    assert not B.attains(_rec([0.01], success=False), 0.1)


def test_ratios_take_the_better_colocation_chunk():
    rows = {"coloc-512": {"capacity_rps": 4.0, "max_goodput": 900.0},
            "coloc-2048": {"capacity_rps": 1.0, "max_goodput": 1000.0},
            "disagg": {"capacity_rps": 5.0, "max_goodput": None},
            "dynaserve": {"capacity_rps": 6.0, "max_goodput": 1500.0}}
    r = B.ratios(rows)
    assert r["capacity_rps"] == {"coloc": "coloc-512", "vs_coloc": 1.5, "vs_disagg": 1.2}
    assert r["max_goodput"] == {"coloc": "coloc-2048", "vs_coloc": 1.5, "vs_disagg": None}


def test_bench_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = cli_main(["bench", "sim-dynaserve", "--workloads", "mini-reasoning", "--systems", "coloc-512,disagg,dynaserve",
                   "--num-requests", "40", "--window", "20", "--rate-low", "0.5", "--rate-high", "4",
                   "--max-probes", "3", "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = r["results"]["qwen-2.5-14b"]["mini-reasoning"]["systems"]
    assert set(rows) == {"coloc-512", "disagg", "dynaserve"}
    for row in rows.values():
        assert 1 <= len(row["probes"]) <= 3 and all(p["num_requests"] <= 40 for p in row["probes"])
        assert row["capacity_rps"] is None or row["at_capacity"]["kept_up"]
    assert any("splits" in p for p in rows["dynaserve"]["probes"])
    assert r["plots"] and r["plots"][0].endswith(".png")
    text = capsys.readouterr().out
    assert "dynaserve capacity:" in text and "rate" in text
    assert cli_main(["bench", "sim-dynaserve", "--workloads", "nope", "--output", str(out)]) == 2
