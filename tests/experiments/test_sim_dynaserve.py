"""``tidal bench sim-dynaserve``: the per-request TBT criterion, the ratios against the tuned
colocation and P/D, and a tiny end-to-end run (one workload, three systems, a few probes)."""

from __future__ import annotations

import json

import pytest

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


def test_the_papers_definition_has_no_stall_rule():
    assert not B.attains(_rec([0.03] * 999 + [1.5]), 0.1)
    assert B.attains(_rec([0.03] * 999 + [1.5]), 0.1, stall=False)  # its p99 is 30 ms: the paper counts it
    assert not B.attains(_rec([0.03] * 20 + [0.5]), 0.1, stall=False)


def test_sustained_means_a_queue_that_does_not_grow():
    from tidal.workload import RequestSpec

    specs = [RequestSpec(float(i), 10, 11) for i in range(101)]  # one a second for 100 s, 11 tokens each

    def recs(delay, first=True):  # request i waits delay(i) for its first token, then 10 gaps of 0.1 s
        out = []
        for i, sp in enumerate(specs):
            r = RequestRecord(i, sp.arrival_s, 10, 11)
            r.send_s, r.itl_s, r.success = sp.arrival_s, [0.1] * 10, True
            r.ttft_s = 0.1 + delay(i) if first or i < 50 else None
            out.append(r)
        return out

    kept = recs(lambda i: 0.0)
    assert B.sustained(kept) and B.queue_growth(kept) == (pytest.approx(0.1), pytest.approx(0.1))
    assert abs(B.emission_ratio(kept, specs) - 1.0) < 0.03  # reported beside: 11 tokens a second, as offered
    assert B.sustained(recs(lambda i: 2.0 + (i % 3)))  # a steady wait of a few seconds is no growth
    growing = recs(lambda i: 0.5 * i)  # a queue growing by 0.5 s a request
    assert not B.sustained(growing) and B.emission_ratio(growing, specs) < 0.9
    assert not B.sustained(recs(lambda i: 0.0, first=False))  # the last ones never started


def test_ratios_take_the_better_colocation_chunk():
    rows = {"coloc-512": {"capacity_rps": 4.0, "max_goodput": 900.0},
            "coloc-2048": {"capacity_rps": 1.0, "max_goodput": 1000.0},
            "disagg": {"capacity_rps": 5.0, "max_goodput": None},
            "dynaserve": {"capacity_rps": 6.0, "max_goodput": 1500.0}}
    r = B.ratios(rows)
    assert r["capacity_rps"] == {"coloc": "coloc-512", "vs_coloc": 1.5, "vs_disagg": 1.2}
    assert r["max_goodput"] == {"coloc": "coloc-2048", "vs_coloc": 1.5, "vs_disagg": None}
    # the paper's definition reads each row's ``paper`` fields
    for n, cap in (("coloc-512", 2.0), ("coloc-2048", 4.0), ("disagg", 8.0), ("dynaserve", 6.0)):
        rows[n]["paper"] = {"capacity_rps": cap, "max_goodput": None}
    r = B.ratios(rows, definition="paper")
    assert r["capacity_rps"] == {"coloc": "coloc-2048", "vs_coloc": 1.5, "vs_disagg": 0.75}


def test_bench_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = cli_main(["bench", "sim-dynaserve", "--workloads", "mini-reasoning", "--systems", "coloc-512,disagg,dynaserve",
                   "--num-requests", "40", "--window", "20", "--rate-low", "0.5", "--rate-high", "4",
                   "--max-probes", "3", "--step-jitter", "fitted", "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = r["results"]["qwen-2.5-14b"]["mini-reasoning"]["systems"]
    assert set(rows) == {"coloc-512", "disagg", "dynaserve"}
    for row in rows.values():
        assert 1 <= len(row["probes"]) <= 6 and all(p["num_requests"] <= 40 for p in row["probes"])
        assert row["capacity_rps"] is None or row["at_capacity"]["kept_up"]
        paper = row["paper"]
        assert paper["capacity_rps"] is None or (paper["at_capacity"]["paper_kept_up"]
                                                 and paper["at_capacity"]["paper_attainment"] >= 0.99)
        rates = [p["rate"] for p in row["probes"]]
        assert len(rates) == len(set(rates))  # the two searches share their probes
    assert any("splits" in p for p in rows["dynaserve"]["probes"])
    assert r["plots"] and r["plots"][0].endswith(".png")
    text = capsys.readouterr().out
    assert "dynaserve capacity, TTFT-guarded:" in text and "dynaserve capacity, paper's" in text
    assert r["setup"]["step_jitter"] == "fitted"
    assert cli_main(["bench", "sim-dynaserve", "--workloads", "nope", "--output", str(out)]) == 2


def test_the_hybrid_has_the_papers_output_lengths():
    from tidal import workload as W

    base = W.make_requests(W.WorkloadOptions(num_requests=4000, rate=1.0, seed=0, **B.WORKLOADS["hybrid"]))
    stats = W.length_stats(base)
    # Table 2's goodput over capacity: 64-69 tokens a request
    assert 60 <= stats["output_mean"] <= 72, stats


def test_calibrate_jitter_measures_a_table1_setup_and_refuses_bad_params(tmp_path):
    from tidal.experiments import jitter_fit as J
    from tidal.sim.jitter import JitterParams

    off = J.run_point("8192-32", "disagg", None, seed=0, scale=0.5)
    again = J.run_point("8192-32", "disagg", None, seed=0, scale=0.5)
    assert off == again  # deterministic given the seed
    assert 15 < off["p50_ms"] < 40 and off["p99_ms"] >= off["p50_ms"] and 0.3 < off["rps"] < 1.2
    tails = J.run_point("8192-32", "disagg", JitterParams(seq_s=2e-3, sigma=1.0), seed=0, scale=0.5)
    assert tails["p99_ms"] > off["p99_ms"] + 5  # 2 ms a sequence, log-normal: a longer tail
    assert cli_main(["bench", "calibrate-jitter", "--params", "1,2", "--output", str(tmp_path / "j.json")]) == 2


def test_fitted_tails_reach_table1s_long_prompt_1p1d_p99():
    """8192 / 32 under 1P1D: a p50 of 23 ms, a p99 of 58 ms (Table 1) with 1-2 decodes a step; the
    per-sequence terms alone gave 29 ms (-50 %), the blocking receive of an 8K prompt's KV reaches it."""
    from tidal.experiments import jitter_fit as J
    from tidal.sim.jitter import FITTED

    got = J.run_point("8192-32", "disagg", FITTED, seed=0)
    p50, p99, _ = J.TABLE1[("8192-32", "disagg")]
    assert got["p50_ms"] == pytest.approx(p50, rel=0.15)
    assert got["p99_ms"] == pytest.approx(p99, rel=0.15)


def test_the_jitter_search_takes_each_terms_best_value_in_turn(monkeypatch):
    """``search`` on a made-up error surface (its minimum on the grid): coordinate descent lands on it,
    evaluating each distinct point once; ``--params`` reads six values."""
    from tidal.experiments import jitter_fit as J
    from tidal.sim.jitter import FITTED, JitterParams

    target = dict(attn_compute_efficiency=0.5, attn_self_factor=1.15, mixed_s=0.45e-3, sigma=1.4, seq_s=38e-6,
                  recv_bw=40e9)
    calls = []

    def fake(p, seed, scale, log=False, jobs=1):
        calls.append(p)
        err = sum(abs(getattr(p, k) - v) / (max(J.GRID[k]) or 1.0) for k, v in target.items())
        return {"params": p, "mean_abs_rel_err": err, "max_abs_rel_err": err}

    monkeypatch.setattr(J, "evaluate", fake)
    best, tried = J.search(FITTED, 0, 1.0, log=lambda m: None)
    assert best == JitterParams(**target)
    assert len(calls) == len(set(calls)) == len(tried)
    assert J._parse("30e-6,1.2,0.3e-3,55e9,0.5,1.15") == JitterParams(30e-6, 1.2, 0.3e-3, 55e9,
                                                                     attn_compute_efficiency=0.5, attn_self_factor=1.15)


def test_the_fitted_testbed_reaches_table1s_long_prompt_colocation():
    """8192 / 32 colocated (Table 1: p50 / p99 TBT 309.7 / 352.9 ms, 1.49 rps): each step a 2,048-token
    chunk deep into a long prompt, so prefill attention sets them. Vidur's A100 attention (34 % of
    peak, the full causal square) gave +19 / +21 %; the testbed's fitted attention is within 15 %."""
    from tidal.experiments import jitter_fit as J
    from tidal.sim.jitter import FITTED

    paper = J.TABLE1[("8192-32", "coloc")]
    got = J.run_point("8192-32", "coloc", FITTED, seed=0)
    for metric, want in zip(J.METRICS, paper, strict=True):
        assert got[metric] == pytest.approx(want, rel=0.15), metric
