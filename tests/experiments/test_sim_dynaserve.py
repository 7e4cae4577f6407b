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


def _row(cap, good=None, bracket=0.0, paper=None):
    p = paper if paper is not None else cap
    return {"capacity_rps": cap, "max_goodput": good, "bracket": bracket,
            "paper": {"capacity_rps": p, "max_goodput": good, "bracket": bracket}}


def test_seed_ratios_take_the_tuned_chunk_per_workload_and_the_widest_bracket():
    rows = {"coloc-512": [_row(4.0, 900.0, 0.03), _row(4.4, 950.0)],
            "coloc-2048": [_row(1.0, 1000.0), _row(None, 1100.0)],
            "disagg": [_row(5.0, None, 0.04), _row(5.5, 800.0)],
            "dynaserve-load": [_row(6.0, 1500.0, 0.02), _row(5.5, 1650.0)]}
    # the tuned chunk is one chunk for every seed: the best median over the seeds
    assert B.tuned_coloc(rows, "capacity_rps") == "coloc-512" and B.tuned_coloc(rows, "max_goodput") == "coloc-2048"
    r = B.seed_ratios(rows, "dynaserve-load", "paper", rate_low=0.25, rate_high=32.0)
    cap = r["capacity_rps"]
    assert cap["coloc"]["system"] == "coloc-512" and cap["coloc"]["per_seed"] == pytest.approx([1.5, 5.5 / 4.4])
    assert cap["coloc"]["tolerance"] == pytest.approx(0.03) and cap["disagg"]["tolerance"] == pytest.approx(0.04)
    # Table 1's chunk met no searched rate on seed 1: the ratio is a bound (>= 5.5 / 0.25)
    assert cap["coloc_2048"]["per_seed"] == pytest.approx([6.0, 22.0]) and cap["coloc_2048"]["bound"] == [False, True]
    good = r["max_goodput"]
    assert good["coloc"]["per_seed"] == pytest.approx([1.5, 1.5]) and good["disagg"]["per_seed"][0] is None
    assert good["best"]["per_seed"] == pytest.approx([1.5, 1650.0 / 1100.0])
    # the TTFT-guarded definition reads the top-level fields
    rows["dynaserve-load"][0]["capacity_rps"] = 2.0
    assert B.seed_ratios(rows, "dynaserve-load", "ttft")["capacity_rps"]["coloc"]["per_seed"][0] == pytest.approx(0.5)


def test_capacity_ratios_and_brackets():
    from tidal.experiments.dynaserve_stats import bracket, cap_ratio

    assert bracket(4.0, 4.2) == pytest.approx(0.05) and bracket(None, 1.0) == 0.0 and bracket(4.0, None) == 0.0
    assert cap_ratio(6.0, 3.0, 0.25) == (2.0, False)
    assert cap_ratio(6.0, None, 0.25) == (24.0, True) and cap_ratio(None, 2.0, 0.25) == (0.125, True)
    assert cap_ratio(None, None, 0.25) == (None, False)


def test_split_tokens_count_where_each_decode_ran():
    """Alpha samples s - P + 1 tokens of a split at s >= P; a split that leaves beta nothing runs the
    request's real output on alpha however short the prediction was; s = 0 is all on beta."""
    from types import SimpleNamespace

    from tidal.experiments.dynaserve_stats import split_tokens
    from tidal.workload import RequestSpec

    def t(i, alpha, s, handoff, pred=100, prompt=10, **kw):
        return SimpleNamespace(index=i, alpha=alpha, beta=1 - alpha, split=s, prompt_len=prompt,
                               predicted_output=pred, handoff=handoff, finished_on_alpha=kw.get("fin", False),
                               stayed_on_alpha=False)

    specs = [RequestSpec(0.0, 10, 100), RequestSpec(0.0, 10, 300), RequestSpec(0.0, 10, 100), RequestSpec(0.0, 10, 50)]
    got = split_tokens([t(0, 0, 49, True), t(1, 1, 109, False), t(2, 0, 0, False), t(3, 1, 89, True, fin=True)],
                       specs, 2)
    # 0: alpha 40 on instance 0, beta 60 on 1; 1: whole on alpha (instance 1), all 300; 2: all on beta (1);
    # 3: ended on alpha (instance 1) before its split: all 50
    assert got["by_instance"] == [40, 60 + 300 + 100 + 50]
    assert got["actual_by_role"] == {"alpha": 40 + 300 + 50, "beta": 60 + 100}
    assert got["planned_by_role"] == {"alpha": 40 + 100 + 0 + 80, "beta": 60 + 0 + 100 + 20}
    assert got["whole_on_alpha_past_prediction"] == 1 and got["predicted_output_mean"] == 100


def test_load_placement_puts_alphas_on_both_instances_and_fixed_roles_on_instance_0():
    from tidal import workload as W
    from tidal.sim.build import build_simulator

    base = W.make_requests(W.WorkloadOptions(num_requests=40, rate=1.0, seed=0, **B.WORKLOADS["mini-reasoning"]))
    specs = W.specs_at_rate(base, 2.0, 20.0)
    alphas = {}
    for name in ("dynaserve", "dynaserve-load", "dynaserve-place"):
        spec = B.cluster_spec("qwen-2.5-14b", B.SYSTEMS[name], 0.1, 2.0, step_jitter="fitted")
        assert (spec.split is None) == (name == "dynaserve")
        if spec.split is not None:  # Alg. 1 has no TTFT target: only tidal's variant sets one
            assert spec.split.flip_roles and (spec.split.ttft_target_s is None) == (name == "dynaserve-load")
        res = build_simulator(spec, specs).run()
        alphas[name] = {t.alpha for t in res.splits}
        assert all(r.success for r in res.records)
    assert alphas["dynaserve"] == {0} and alphas["dynaserve-load"] == {0, 1}
    with pytest.raises(ValueError, match="placement"):
        B.System("split", "slo-compose", 2048, placement="round-robin")


def test_bench_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = cli_main(["bench", "sim-dynaserve", "--workloads", "mini-reasoning", "--systems", "coloc-512,disagg,dynaserve",
                   "--num-requests", "40", "--window", "20", "--rate-low", "0.5", "--rate-high", "4",
                   "--max-probes", "3", "--step-jitter", "fitted", "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    rows = {k: v[0] for k, v in r["results"]["qwen-2.5-14b"]["mini-reasoning"]["systems"].items()}  # one seed
    assert set(rows) == {"coloc-512", "disagg", "dynaserve"}
    for row in rows.values():
        assert 1 <= len(row["probes"]) <= 6 and all(p["num_requests"] <= 40 for p in row["probes"])
        assert row["capacity_rps"] is None or row["at_capacity"]["kept_up"]
        paper = row["paper"]
        assert paper["capacity_rps"] is None or (paper["at_capacity"]["paper_kept_up"]
                                                 and paper["at_capacity"]["paper_attainment"] >= 0.99)
        rates = [p["rate"] for p in row["probes"]]
        assert len(rates) == len(set(rates))  # the two searches share their probes
    split = [p for p in rows["dynaserve"]["probes"] if "splits" in p]
    assert split and all(len(p["instances"]) == 2 for p in split)
    tok = split[0]["splits"]["tokens"]  # fixed roles: instance 0 is every alpha
    assert tok["by_instance"][0] == tok["actual_by_role"]["alpha"] and tok["by_instance"][1] == tok["actual_by_role"]["beta"]
    assert r["plots"] and r["plots"][0].endswith(".png")
    text = capsys.readouterr().out
    assert "dynaserve capacity, TTFT-guarded, per seed:" in text and "dynaserve capacity, paper's" in text
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
