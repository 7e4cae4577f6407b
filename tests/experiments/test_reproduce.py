"""``tidal reproduce PAPER --quick``: each paper's quick run, end to end through the CLI, and the
direction of each claim (who beats whom) read from the numbers the run wrote."""

from __future__ import annotations

import json
import os

import pytest

from tidal.cli import main
from tidal.experiments.repro_bucketserve import BUCKET, DIST, UELLM
from tidal.experiments.reproduce import Claim, beats, capacity_from_sweep, write_results_md


def _run(paper: str, out) -> dict:
    assert main(["reproduce", paper, "--quick", "--output", str(out), "--no-progress",
                 "--results-md", str(out / "results.md")]) == 0
    report = json.loads((out / f"{paper}.json").read_text())
    md = (out / f"{paper}.md").read_text()
    assert "| claim | paper | tidal simulated | tidal real | why they differ |" in md
    assert len(report["claims"]) >= 3 and all(c["why"] and c["paper"] for c in report["claims"])
    for f in report["figures"]:
        assert (out / f).stat().st_size > 1000 and f in (out / "results.md").read_text()
    return report


def test_bucketserve_quick_directions(tmp_path):
    from tidal.experiments.repro_bucketserve import key

    r = _run("bucketserve", tmp_path)
    off = {name: {p["max_batch"]: p for p in pts} for name, pts in r["data"]["offline"].items()}
    for b in off[UELLM]:
        # Fig. 5a: BucketServe over the UELLM-like padded static batch at every max batch size
        assert off[key(BUCKET, "varlen")][b]["tok_s"] > 1.5 * off[UELLM][b]["tok_s"]
        for e in ("varlen", "padded"):
            # the paper's 2 + 2 mixed run is decode-bound, so BucketServe and DistServe are within a few %
            assert off[key(DIST, e)][b]["decode_busy"] > 0.9
            assert off[key(BUCKET, e)][b]["tok_s"] >= 0.9 * off[key(DIST, e)][b]["tok_s"]
        # padding costs the prefill side: DistServe's prefill instances are busier padded than not,
        # and bucketing saves part of it
        busy = {e: off[key(DIST, e)][b]["prefill_busy"] for e in ("varlen", "padded")}
        assert busy["padded"] > 1.2 * busy["varlen"]
        assert off[key(BUCKET, "padded")][b]["prefill_busy"] < busy["padded"]
    # prefill-bound: bucketing pays on the padded engine, not on the varlen one (one seed with --quick)
    pb = {name: runs[0] for name, runs in r["data"]["prefill_bound"]["mixed"].items()}
    assert pb[key(DIST, "padded")]["prefill_busy"] > 0.95
    assert pb[key(BUCKET, "padded")]["tok_s"] > 1.1 * pb[key(DIST, "padded")]["tok_s"]
    assert pb[key(BUCKET, "varlen")]["tok_s"] < 1.05 * pb[key(DIST, "varlen")]["tok_s"]
    on = r["data"]["online"]["mixed"]
    # Fig. 5d: capacity at 80 % attainment on Mixed, BucketServe above UELLM-like
    assert on[key(BUCKET, "varlen")]["capacity_server_rps"] > on[UELLM]["capacity_server_rps"]
    # attainment falls as the rate grows (Fig. 5c-d's shape)
    for name in on:
        att = [p["attainment"] for p in on[name]["points"]]
        assert att[0] > att[-1]
    # the claims' capacity (--quick: read off the sweep), its resolution recorded
    cap = r["data"]["capacity"]["mixed"]
    for name, runs in cap.items():
        assert len(runs) == len(r["data"]["seeds"]) and runs[0]["bracket"] > 0
        assert runs[0]["capacity_server_rps"] == on[name]["capacity_server_rps"]
    claims = {c["claim"]: c for c in r["claims"]}
    off_uellm = claims["offline throughput: BucketServe over UELLM (Fig. 5a, high load)"]
    assert off_uellm["verdict"] == "holds" and len(off_uellm["per_seed"]) == len(r["data"]["seeds"])
    assert "bound 1.0" in claims["offline throughput: BucketServe over DistServe (Fig. 5a)"]["simulated"]
    assert "real_offline" not in r["data"] and "--real runs it" in off_uellm["real"]
    # a capacity claim is judged against its searches' bracket: never "holds" inside it
    for c in r["claims"]:
        assert c["verdict"] in ("holds", "fails", "tie", "n/a")
        if c["verdict"] == "holds":
            assert min(c["per_seed"]) > 1 + c["margin"] and c["margin"] > c["tolerance"]
    # Fig. 6: the latency breakdown and the bucket policy's own time, by bucket count
    f6 = r["data"]["fig6"]["mixed"]["seeds"][0]["runs"]
    assert [x["client_rps"] for x in f6] == [1.0]  # --quick: one rate
    for x in f6:
        assert x["prefill_s"] > 0 and x["decode_s"] > 0 and x["overhead_s_total"] > 0 and x["policy_steps"] > 0
        assert sum(v["steps"] for v in x["by_buckets"].values()) == x["policy_steps"]
    assert any(c.startswith("Fig. 6b (mixed)") for c in claims) and "bucketserve_fig6.png" in r["figures"]


def test_bucketserve_capacity_is_a_bisection_with_its_bracket():
    from tidal.experiments.repro_bucketserve import capacity_search, systems, workload

    c = capacity_search(systems(16)[BUCKET], workload("alpaca", 40, 1, 1.0), 1.0, 64.0, quick=True)
    assert 2 <= len(c["probes"]) <= 4 and c["note"]
    lo, hi = c["capacity_client_rps"], c["first_failing_rps"]
    if lo is not None and hi is not None and hi > lo:
        assert c["bracket"] == pytest.approx(hi / lo - 1.0)
    assert all(p["attainment"] >= 0.8 for p in c["probes"] if p["rate"] == lo)  # the capacity's own probe passed
    assert all(p["attainment"] < 0.8 for p in c["probes"] if p["rate"] == hi)


def test_bucketserve_real_engine_run_computes_the_padding_and_finishes_everything():
    """The real column's run, small: both systems serve every request to its length on the real
    engine; only the padded static baseline computes padding (a timing direction is not asserted:
    two requests on a shared CPU)."""
    from tidal.experiments.repro_bucketserve import REAL_SYSTEMS, _real, real_offline

    r = real_offline(2, 2, seed=0, progress=lambda msg: None, repeats=2)  # one short and one long request, twice
    static, bucket = (r[name] for name in REAL_SYSTEMS)
    assert len(static["runs"]) == len(bucket["runs"]) == 2
    for a, b in zip(static["runs"], bucket["runs"], strict=True):  # each run its own count, on a reused engine
        assert a["padded_tokens_computed"] > 0 and b["padded_tokens_computed"] == 0
        assert a["tok_s"] > 0 and b["tok_s"] > 0 and a["steps"] > 0 and b["steps"] > 0
    assert static["runs"][0]["padded_tokens_computed"] == static["runs"][1]["padded_tokens_computed"]
    assert sorted([static["tok_s"], *(x["tok_s"] for x in static["runs"])])[1] == static["tok_s"]  # the median
    cell = _real({"real_offline": r})
    assert f"{static['padded_tokens_computed']} padding tokens" in cell and "2 mixed requests, max batch 2" in cell
    assert "median of 2 runs taking turns; per run" in cell


def test_pang_quick_directions(tmp_path):
    from tidal.experiments.repro_pang import MEM_CH, MEM_PF, STATIC_CH, STATIC_PF, v0_budget

    r = _run("pang", tmp_path)
    # vLLM v0's budget without chunked prefill: max(max_model_len, 2048)
    assert v0_budget("llama-65b") == 2048 and v0_budget("llama-3-70b") == 8192
    t1 = {(t["row"]["model"], t["row"]["prompt"], t["tp"]): t["seeds"][0] for t in r["data"]["table_i"]}
    assert set(t1) == {(m, p, tp) for m, p in (("llama-65b", 68.4), ("llama-3-70b", 191.0)) for tp in (4, 8)}
    # LLaMA-65B (multi-head KV) at TP4: memory lowers the cap below the static 256 where the KV pool
    # binds; the static cap fills the pool and preempts, memory does not (Eq. 8-9 from every request)
    small = t1["llama-65b", 68.4, 4]
    assert small[MEM_PF]["b_mem"] < 256 and small[MEM_PF]["mean_running"] < small[STATIC_PF]["mean_running"]
    assert small[STATIC_PF]["preemptions"] > 0 and small[STATIC_PF]["recomputed_tokens"] > 0
    assert small[MEM_PF]["preemptions"] == small[MEM_CH]["preemptions"] == 0
    # where the pool holds more than 256 requests, B_max above the static cap is used, and runs more
    for k in (("llama-65b", 68.4, 8), ("llama-3-70b", 191.0, 8)):
        for static, mem in ((STATIC_PF, MEM_PF), (STATIC_CH, MEM_CH)):
            assert t1[k][mem]["b_mem"] > 256 and t1[k][mem]["mean_running"] > t1[k][static]["mean_running"]
    # Table II's first row runs on prefill-first (the paper's third row is its chunked "PD fusion" case)
    t2 = r["data"]["table_ii"][0]
    assert t2["row"]["scheduling"] == "prefill-first" and set(t2["seeds"][0]["results"]) == {STATIC_PF, "sla",
                                                                                              "memory+sla"}
    claims = {c["claim"]: c for c in r["claims"]}
    vs = next(c for name, c in claims.items() if "memory+sla against sla" in name)
    same = t2["seeds"][0]["same_rate"]
    # two runs with every token at the same time are the same run: n/a, never a win
    identical = same["sla"]["timing"] == same["memory+sla"]["timing"]
    assert (vs["verdict"] == "n/a") == identical and vs["identical"] == identical
    if identical:
        assert same["sla"]["tok_s"] == pytest.approx(same["memory+sla"]["tok_s"])
    for c in r["claims"]:
        assert c["verdict"] in ("holds", "fails", "tie", "n/a")
        if c["verdict"] == "holds":
            assert min(c["per_seed"]) > 1 + c["margin"] and c["margin"] > c["tolerance"]
    assert any(name.startswith("Fig. 4") for name in claims)  # --quick says it is not run


def test_capacity_from_sweep_interpolates_the_crossing():
    # 100 % at 1, 90 % at 2, 50 % at 3: 80 % is crossed a quarter of the way from 2 to 3
    assert capacity_from_sweep([(1, 1.0), (2, 0.9), (3, 0.5)], 0.8) == pytest.approx(2.25)
    assert capacity_from_sweep([(1, 0.5)], 0.8) is None
    assert capacity_from_sweep([(1, 1.0), (2, 0.95)], 0.8) == 2
    # "beats" needs more than a 2 % margin, so a tie read off a sweep is not a win
    assert beats(1.03, 1.0) and not beats(1.01, 1.0) and not beats(None, 1.0) and beats(0.1, None)


def test_results_md_keeps_other_papers_sections(tmp_path):
    from tidal.experiments.reproduce import Report

    path = str(tmp_path / "results.md")
    write_results_md(path, Report("a", "Paper A", "setup A", True), "")
    write_results_md(path, Report("b", "Paper B", "setup B", True), "")
    write_results_md(path, Report("a", "Paper A again", "setup A2", True), "")
    text = (tmp_path / "results.md").read_text()
    assert "Paper A again" in text and "Paper B" in text and "setup A\n" not in text
    assert text.index("Paper A again") < text.index("Paper B")


def test_kunserve_quick_reads_its_claims_off_the_bench_run(tmp_path):
    from tidal.experiments.kunserve_claims import REAL, REAL_BUBBLES
    from tidal.experiments.kunserve_runs import DROP, LOOKAHEAD_OFF, VLLM
    from tidal.experiments.reproduce import judge

    r = _run("kunserve", tmp_path)
    bench = json.loads((tmp_path / "kunserve_sim.json").read_text())  # tidal bench sim-kunserve's own JSON
    d = bench["datasets"]["longbench"]
    assert r["data"]["sim"]["datasets"]["longbench"]["ratios"] == d["ratios"] and "real" not in r["data"]
    g = d["regime"]  # --quick searches the rate too: the 60 % rule on the seeds' mean demand, printed
    s = g["search"]
    assert g["rate"] == s["rate"] == s["bracket"][0] and s["share"] == 0.6 and len(s["probes"]) >= 2
    assert all(p["within"] == (p["mean_kv_demand"] <= 0.6) for p in s["probes"]) and g["gpu_memory_share"] > 0.8
    assert max(p["rate"] for p in s["probes"] if p["within"]) == g["rate"]
    claims = {c["claim"]: c for c in r["claims"]}
    for c in claims.values():  # every claim judged on 3 seeds by the shared rule, never holds inside the margin
        assert len(c["per_seed"]) == 3 and c["verdict"] == judge(c["per_seed"], c["margin"], c["tolerance"])
        assert c["verdict"] != "holds" or min(c["per_seed"]) > 1 + c["margin"]
    p99 = claims[f"longbench: P99 TTFT, KunServe (drop) below {VLLM}"]
    assert p99["per_seed"] == pytest.approx(d["ratios"]["p99_ttft"][VLLM]) and p99["real"] == REAL
    med = d["systems"][DROP]["median"]["ttft_ms"]["p99"], d["systems"][VLLM]["median"]["ttft_ms"]["p99"]
    assert p99["simulated"].startswith(f"{med[0]:,.0f} ms vs {med[1]:,.0f} ms")  # the numbers the run wrote
    bubbles = claims["longbench: lookahead microbatches cut pipeline bubbles"]
    assert bubbles["real"] == REAL_BUBBLES and "longbench: lookahead lowers P99 TTFT" in claims
    on, off = d["systems"][DROP]["per_seed"], d["systems"][LOOKAHEAD_OFF]["per_seed"]
    assert claims["longbench: lookahead lowers P99 TTFT"]["per_seed"] == pytest.approx(
        [b["ttft_ms"]["p99"] / a["ttft_ms"]["p99"] for a, b in zip(on, off, strict=True)])
    slo = claims["longbench: fewer SLO violations than the best baseline (scales 1-10)"]
    assert slo["per_seed"] == pytest.approx(d["slo"]["attainment_ratio"])
    assert "kunserve_sim.png" in r["figures"] and "kunserve_sim_search.png" in r["figures"]
    # the bench run records its own command (one a reader can paste), not the reproduce command around it
    assert bench["command"].startswith("tidal bench sim-kunserve ") and "reproduce" not in bench["command"]


@pytest.mark.parametrize("paper", ["bucketserve", "kunserve", "dynaserve"])
def test_readme_line_is_the_recorded_results(paper):
    """README's line of a paper quotes docs/results/<paper>.json's figures (the line the reproduce run wrote)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    rec = json.loads((root / f"docs/results/{paper}.json").read_text())
    line = rec["data"].get("readme_line")
    if line is None:
        pytest.skip(f"docs/results/{paper}.json predates the README line")
    readme = " ".join((root / "README.md").read_text().split())
    assert " ".join(line.split()) in readme


def test_dynaserve_quick_reads_its_claims_off_the_bench_run(tmp_path):
    from tidal.experiments.repro_dynaserve import REAL
    from tidal.experiments.sim_dynaserve import seed_ratios

    r = _run("dynaserve", tmp_path)
    bench = json.loads((tmp_path / "dynaserve_sim.json").read_text())
    rows = bench["results"]["qwen-2.5-14b"]["mini-reasoning"]["systems"]
    assert set(rows) == {"coloc-512", "disagg", "dynaserve-load"}
    claims = r["claims"]
    assert claims[0]["claim"].startswith("Table 1") and claims[0]["verdict"] == "n/a"  # no fit read with --quick
    ratios = seed_ratios(rows, "dynaserve-load", "paper", bench["setup"]["rate_low"], bench["setup"]["rate_high"])
    coloc, disagg = claims[1], claims[2]
    assert "tuned PD Coloc." in coloc["claim"] and "PD Disagg." in disagg["claim"]
    for c, base in ((coloc, "coloc"), (disagg, "disagg")):
        rr = ratios["capacity_rps"][base]
        assert c["per_seed"] == [x for x in rr["per_seed"] if x is not None]
        assert c["tolerance"] == rr["tolerance"] and c["margin"] > c["tolerance"]  # a capacity ratio vs its bracket
        assert c["real"] == REAL
        paper = [row["paper"]["capacity_rps"] for row in rows["dynaserve-load"]]
        assert c["simulated"].startswith(" / ".join("none" if x is None else f"{x:.2f}" for x in paper))
    assert {c["claim"].split(": ")[1] for c in claims[3:5]} == {"goodput, DynaServe above tuned PD Coloc.",
                                                                 "goodput, DynaServe above PD Disagg."}
    assert r["data"]["sim"]["results"]["qwen-2.5-14b"]["mini-reasoning"]["systems"]["disagg"][0]["paper_capacity_rps"] \
        == rows["disagg"][0]["paper"]["capacity_rps"]


def test_dynaserve_real_cells_read_the_real_rows():
    """The real column from a real run's rows (the run itself takes minutes: benchmarks/dynaserve_serve.py):
    capacities as searched (a bound when the search hit one), goodput, and the direction of each claim."""
    from tidal.experiments.dynaserve_real import RealSetup
    from tidal.experiments.repro_dynaserve import REAL, REAL_NO_SHAPE, _real_cells

    st = RealSetup()

    def row(layout, cap, good):
        return {"workload": "dynaserve-219-1467", "layout": layout, "lengths": [55, 367], "capacity_rps": cap,
                "goodput_tok_s": good, "seed": 0}

    real = {"setup": st.__dict__, "rows": [row("colocate", 0.5, 150.0), row("disaggregate", None, 20.0),
                                           row("split", st.search_high, 160.0)]}
    vs_coloc, vs_disagg, good = _real_cells(real, "mini-reasoning")
    assert vs_coloc.startswith(f">= {st.search_high:.2f} vs 0.50 rps: {st.search_high / 0.5:.2f}x")
    assert "seed 0, the paper's placement" in vs_coloc
    assert vs_coloc.endswith("(direction holds: yes)") and "dynaserve-219-1467 at 55/367 tokens" in vs_coloc
    assert vs_disagg.startswith(f">= {st.search_high:.2f} vs < {st.search_low:g} rps: n/a")
    assert vs_disagg.endswith("(direction holds: yes)")  # none passed for 1P1D: any capacity beats it
    assert good.startswith("160 vs 150 (PD Coloc.) and 20 tok/s") and good.endswith("(direction holds: yes)")
    real["rows"][0]["goodput_tok_s"] = 158.0  # within the 2 % margin: no win
    assert _real_cells(real, "mini-reasoning")[2].endswith("(direction holds: **no**)")
    assert _real_cells(real, "hybrid") == (REAL_NO_SHAPE,) * 3
    assert _real_cells(None, "mini-reasoning") == (REAL,) * 3


def test_dynaserve_real_cells_pair_the_seeds_and_hold_only_on_every_seed():
    """Several seeds: each system's figures per seed (the same requests and arrivals for every layout of a
    seed), a ratio per seed, and a direction that holds only where it holds on every seed; a seed that
    lacks a layout is left out of every cell."""
    from tidal.experiments.dynaserve_real import RealSetup
    from tidal.experiments.repro_dynaserve import _real_cells, _real_why

    def row(layout, seed, cap, good):
        return {"workload": "dynaserve-219-1467", "layout": layout, "lengths": [55, 367], "capacity_rps": cap,
                "goodput_tok_s": good, "seed": seed, "tbt_p99_ms": 100.0 + seed, "split_fraction": 1.0,
                "kv_mb_per_request": 2.5}

    rows = [row("split", 1, 1.2, 130.0), row("split", 0, 0.8, 120.0), row("split", 2, 1.0, 125.0),
            row("colocate", 0, 1.0, 100.0), row("colocate", 1, 1.0, 100.0), row("colocate", 2, 1.0, 100.0),
            row("disaggregate", 2, 0.5, 90.0), row("disaggregate", 0, 0.5, 90.0), row("disaggregate", 1, 0.5, 90.0),
            row("split", 3, 9.0, 900.0)]  # seed 3 ran split only: left out
    real = {"setup": RealSetup().__dict__, "rows": rows}
    vs_coloc, vs_disagg, good = _real_cells(real, "mini-reasoning")
    assert vs_coloc.startswith("0.80 / 1.20 / 1.00 vs 1.00 / 1.00 / 1.00 rps per seed: 0.80x, 1.20x, 1.00x")
    assert "seeds 0, 1, 2," in vs_coloc and vs_coloc.endswith("(direction holds: **no**, 1 of 3 seeds)")
    assert vs_disagg.startswith("0.80 / 1.20 / 1.00 vs 0.50 / 0.50 / 0.50 rps per seed: 1.60x, 2.40x, 2.00x")
    assert vs_disagg.endswith("(direction holds: yes)")
    assert good.startswith("120 / 130 / 125 vs 100 / 100 / 100 (PD Coloc.) and 90 / 90 / 90 tok/s (PD Disagg.) per seed")
    assert good.endswith("(direction holds: yes)")
    why = _real_why(real, "mini-reasoning")
    assert ("P99 TBT at capacity 100 / 101 / 102 ms (PD Coloc.), 100 / 101 / 102 (PD Disagg.), 100 / 101 / 102 "
            "(split), per seed") in why  # seed 3 left out
    assert "split 100 / 100 / 100 % of their requests" in why


def test_dynaserve_real_column_from_a_recorded_run(tmp_path):
    """--real-json: the rows and setup of a recorded benchmarks/dynaserve_serve.py run; a seed that lacks
    a claim layout is refused, naming it, and so is a run that was cut off."""
    from tidal.experiments.repro_dynaserve import _real_cells, _recorded_real

    rows = [{"workload": "dynaserve-219-1467", "layout": lay, "lengths": [55, 367], "capacity_rps": cap,
             "goodput_tok_s": good, "seed": 0} for lay, cap, good in (("colocate", 4.0, 540.0),
                                                                       ("disaggregate", 1.5, 300.0),
                                                                       ("split", 3.0, 500.0))]
    path = tmp_path / "real.json"
    path.write_text(json.dumps({"command": "benchmarks/dynaserve_serve.py --search-high 8", "rows": rows,
                                "args": {"search_high": 8.0, "duration": 20.0, "output": "x.json", "seeds": [0]},
                                "complete": True}))
    real = _recorded_real(str(path))
    assert real["setup"]["search_high"] == 8.0 and real["setup"]["duration"] == 20.0 and "output" not in real["setup"]
    vs_coloc, vs_disagg, good = _real_cells(real, "mini-reasoning")
    assert vs_coloc.startswith("3.00 vs 4.00 rps: 0.75x") and vs_coloc.endswith("(direction holds: **no**)")
    assert vs_disagg.startswith("3.00 vs 1.50 rps: 2.00x") and "20 s Poisson probes" in vs_disagg
    assert good.endswith("(direction holds: **no**)")
    path.write_text(json.dumps({"command": "x", "rows": rows + [{**rows[2], "seed": 1}], "args": {}}))
    with pytest.raises(ValueError, match="seed 1 lacks the layouts \\['colocate', 'disaggregate'\\]"):
        _recorded_real(str(path))
    path.write_text(json.dumps({"command": "x", "rows": rows[:2], "args": {}, "complete": False}))
    with pytest.raises(ValueError, match="cut off after 2 layouts"):
        _recorded_real(str(path))


def test_dynaserve_real_runs_every_layout_of_a_seed_before_the_next_and_reports_each_row(tmp_path, monkeypatch):
    """The real runs' order (a seed's layouts, then the next seed's, so a cut-off run keeps whole
    seeds), each run's seed in its own JSON's name and in the client's --seed, and the rows so far
    handed on after each run; an unknown layout is refused before any server starts."""
    from tidal.experiments import dynaserve_real as R

    calls = []

    def fake(wl, layout, setup, seed, out_json, log):
        calls.append((layout, seed, os.path.basename(out_json)))
        return {"system": layout, "capacity_rps": 1.0, "search_note": "", "goodput_tok_s": 1.0, "tbt_p99_ms": 1.0,
                "probes": [], "seed": seed}

    monkeypatch.setattr(R, "run_layout", fake)
    seen = []
    rows = R.run(["dynaserve-219-1467"], ["colocate", "split"], R.RealSetup(seeds=(3, 4)), str(tmp_path / "d" / "r"),
                 log=lambda m: None, on_row=lambda got: seen.append(len(got)))
    assert [(c[0], c[1]) for c in calls] == [("colocate", 3), ("split", 3), ("colocate", 4), ("split", 4)]
    assert calls[1][2] == "r_dynaserve-219-1467_split_s3.json" and (tmp_path / "d").is_dir()
    assert seen == [1, 2, 3, 4] and [r["seed"] for r in rows] == [3, 3, 4, 4]
    with pytest.raises(ValueError, match="unknown layout 'nope'"):
        R.run(["dynaserve-219-1467"], ["nope"], R.RealSetup(), str(tmp_path / "r"), log=lambda m: None)
    assert set(R.CLAIM_LAYOUTS) < set(R.LAYOUTS) and "--split-placement" in R.LAYOUTS["split"][1]
    assert R.LAYOUTS["split"][1][R.LAYOUTS["split"][1].index("--split-placement") + 1] == "load"  # DynaServe Sec. 3.1


def test_dynaserve_real_row_says_why_each_probe_failed(tmp_path, monkeypatch):
    """A real layout's row (from the load client's JSON; the server and client are stood in for):
    its capacity, and per probe how many requests were left unfinished and how the finished did."""
    from tidal.experiments import dynaserve_real as R

    def probe(rate, att, done, left):
        return {"rate": rate, "attainment": att, "passed": att >= 0.9,
                "summary": {"completed": done, "failed": left, "slo_attainment_by_metric": {"tbt": att}}}

    out = tmp_path / "run.json"
    out.write_text(json.dumps({
        "capacity_search": {"capacity_rps": 1.5, "note": "stopped after 2 probes",
                            "probes": [probe(1.5, 1.0, 40, 0), probe(3.0, 0.5, 45, 45)]},
        "requests": [{"placement": {"whole_on": None, "kv_bytes": 2e6}}, {"placement": {"whole_on": 0, "kv_bytes": 0}}],
        "goodput": {"output_throughput": 200.0}, "slo_attainment": 1.0, "itl_ms": {"p99": 120.0},
        "ttft_ms": {"p50": 80.0, "p99": 300.0}}))
    log = tmp_path / "server.log"
    log.write_text("")
    monkeypatch.setattr(R, "serve", lambda flags, engine: (None, "http://127.0.0.1:1", str(log)))
    cmds = []
    monkeypatch.setattr(R, "run_client", cmds.append)
    monkeypatch.setattr(R, "stop", lambda proc: None)
    row = R.run_layout("dynaserve-219-1467", "split", R.RealSetup(), 2, str(out), log=lambda m: None)
    # no warm-up request: its 4-token output would teach the split front's length predictor
    (cmd,) = cmds
    assert cmd[cmd.index("--warmup-requests") + 1] == "0" and cmd[cmd.index("--seed") + 1] == "2"
    assert row["seed"] == 2
    assert row["capacity_rps"] == 1.5 and row["system"] == "DynaServe (split)" and row["lengths"] == [55, 367]
    assert row["probe_failures"][1] == {"rate": 3.0, "unfinished": 45, "finished": 45, "by_metric": {"tbt": 0.5}}
    assert row["split_fraction"] == 0.5 and row["kv_mb_per_request"] == 1.0
    assert not log.exists()  # the server's log is removed once the run is read


def test_reproduce_all_writes_every_papers_section_in_turn(tmp_path, monkeypatch, capsys):
    """``tidal reproduce all``: each registered paper runs once, in order, and gets its JSON, its
    Markdown and its own section of the results page; an unknown paper is a one-line error."""
    from tidal.experiments import reproduce as R

    ran = []

    def fake(name):
        def run(args, log):
            ran.append(name)
            return R.Report(name, f"{name} title", "setup", args.quick, claims=[R.Claim("c", "p", "s", True, "w")])
        return run

    monkeypatch.setattr(R, "PAPERS", {"one": fake("one"), "two": fake("two")})
    md = tmp_path / "results.md"
    assert main(["reproduce", "all", "--output", str(tmp_path), "--results-md", str(md), "--no-progress"]) == 0
    assert ran == ["one", "two"]
    text = md.read_text()
    for name in ran:
        assert json.loads((tmp_path / f"{name}.json").read_text())["paper"] == name
        assert f"<!-- reproduce:{name}:begin -->" in text and f"## {name} title" in text
    assert text.count("Command: `") == 2
    capsys.readouterr()
    assert main(["reproduce", "nope", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown paper 'nope'; available: one, two, all" in err and err.count("\n") == 1


def test_judge_needs_every_seed_past_the_margin_and_a_margin_past_the_tolerance():
    from tidal.experiments.reproduce import Claim, judge

    assert judge([1.10, 1.05, 1.30]) == "holds"
    assert judge([1.10, 1.01, 1.30]) == "tie"  # one seed inside the 2 % margin
    assert judge([1.10, 0.90, 1.30]) == "tie"  # seeds disagree
    assert judge([0.90, 0.95, 0.99]) == "fails"
    assert judge([1.10, 1.10, 1.10], margin=0.02, tolerance=0.04) == "tie"  # a 4 % bracket cannot tell 2 %
    assert judge([1.10, 1.10, 1.10], margin=0.05, tolerance=0.04) == "holds"
    assert judge([1.0, 1.0, 1.0], identical=True) == "n/a"
    assert judge([]) == "n/a"
    c = Claim("c", "p", "s", holds=True, why="w", per_seed=[1.5, 0.9, 1.2])
    assert c.verdict == "tie" and not c.holds and "per seed 1.50x, 0.90x, 1.20x" in c.row()
    assert Claim("c", "p", "s", holds=True, why="w", identical=True).verdict == "n/a"
    assert Claim("c", "p", "s", holds=False, why="w").verdict == "fails"
    with pytest.raises(ValueError):
        Claim("c", "p", "s", holds=True, why="w", verdict="maybe")


def test_dynaserve_readme_line_reads_its_figures_off_the_claims():
    from tidal.experiments.dynaserve_claims import readme_line
    from tidal.experiments.reproduce import Claim

    def claim(name, seeds):
        return Claim(name, "", "", False, "", per_seed=seeds, margin=0.05)

    claims = [claim("qwen-2.5-14b hybrid: capacity, DynaServe above tuned PD Coloc.", [0.9, 1.0, 1.1]),
              claim("qwen-2.5-14b burstgpt: capacity, DynaServe above tuned PD Coloc.", [1.2, 1.3, 1.4]),
              claim("qwen-2.5-14b hybrid: capacity, DynaServe above PD Disagg.", [1.3, 1.4, 1.5]),
              claim("qwen-2.5-72b arxiv: goodput, DynaServe above tuned PD Coloc.", [2.0, 2.1, 2.2]),
              claim("qwen-2.5-14b hybrid [fixed roles (instance 0 is every request's alpha)]: capacity, DynaServe "
                    "above tuned PD Coloc.", [0.7, 0.8, 0.9])]
    fit = {"fit": {"rows": [{"rel_err": {"a": 0.1, "b": -0.2}}], "max_abs_rel_err": 0.2}}
    real = {"rows": [{"layout": "split", "capacity_rps": 1.0}, {"layout": "colocate", "capacity_rps": 2.0},
                     {"layout": "disaggregate", "capacity_rps": 0.5}]}  # recorded before seeds: seed 0
    line = readme_line(claims, fit, real)
    assert "(1 of its 2 figures within 15 %, the largest 20%" in line
    assert ("capacity 1.00-1.30x tuned colocation (medians over its workloads' seeds, seeds 0.90-1.40x; 1 of 2 hold), "
            "overlapping the paper's 1.15-3.07x") in line
    assert " and 1.40-1.40x 1P1D" in line and "overlapping the paper's 1.09-1.67x" in line
    assert "goodput 2.10-2.10x tuned colocation" in line and "(seeds 2.00-2.20x; 1 of 1 hold)" in line
    assert "with fixed roles (one instance every request's alpha) 0.80-0.80x tuned colocation" in line
    assert line.endswith("(seed 0, the paper's placement) capacity 2.00x 1P1D and 0.50x colocation.")
    real = {"rows": [{"layout": lay, "seed": seed, "capacity_rps": cap} for seed, caps in ((0, (1.0, 2.0, 0.5)),
                                                                                           (1, (1.5, 1.5, 0.5)),
                                                                                           (2, (1.0, None, 0.5)))
                     for lay, cap in zip(("split", "colocate", "disaggregate"), caps, strict=True)]}
    line = readme_line(claims, fit, real)  # seed 2 found no colocation capacity: no ratio, left out
    assert line.endswith("(seeds 0, 1, the paper's placement) capacity 2.00-3.00x 1P1D and 0.50-1.00x colocation.")


def test_bucketserve_fig6b_is_not_judged_without_growth_in_the_buckets():
    """Fig. 6b says the bucketing time stays stable as the buckets grow: a run whose load kept one
    bucket count cannot show that (n/a, never holds); two counts are judged on their per-seed ratios."""
    from tidal.experiments.repro_bucketserve import MIN_STEPS, _fig6_claims

    def fig6(counts):
        run = {"client_rps": 1.0, "prefill_s": 1.0, "decode_s": 9.0, "overhead_s_per_request": 1e-6,
               "prefill_step_s": 0.1, "by_buckets": {str(k): {"median_s": 1e-6, "steps": MIN_STEPS} for k in counts}}
        return {"x": {"seeds": [{"seed": s, "runs": [run]} for s in range(3)]}}

    one = {c.claim: c for c in _fig6_claims(fig6([1]))}["Fig. 6b (x): bucketing time per step stays small as the buckets grow"]
    two = {c.claim: c for c in _fig6_claims(fig6([1, 4]))}["Fig. 6b (x): bucketing time per step stays small as the buckets grow"]
    assert one.verdict == "n/a" and "n/a" in one.why and len(one.per_seed) == 3
    assert two.verdict == "holds" and min(two.per_seed) > 1 + two.margin


def test_bucketserve_readme_line_reads_its_figures_off_the_claims():
    from tidal.experiments.repro_bucketserve import readme_line

    def c(name, per):
        return Claim(name, "", "", False, "", per_seed=per)

    cs = [c("offline throughput: BucketServe over UELLM (Fig. 5a, high load)", [4.5, 4.8, 4.7]),
          c("offline throughput: BucketServe over DistServe (Fig. 5a)", [0.97, 0.99, 0.98]),
          c("where bucketing pays: a prefill-bound 1 + 3 layout, alpaca, outputs / 8 (offline)", [1.4, 1.5, 1.6]),
          c("where bucketing pays: a prefill-bound 1 + 3 layout, mixed, outputs / 8 (offline)", [1.2, 1.7, 1.6]),
          c("capacity at 80 % SLO attainment, alpaca (Fig. 5c): BucketServe over DistServe", [1.0, 1.0, 1.0]),
          c("capacity at 80 % SLO attainment, alpaca (Fig. 5c): BucketServe over UELLM", [6.0, 6.3, 5.6])]
    real = {"BucketServe (bucket)": {"tok_s": 60.0}, UELLM: {"tok_s": 25.0}}
    line = readme_line(cs, real)
    assert line.startswith("offline throughput 4.70x (seeds 4.50-4.80x; holds; larger than the paper's 3.58x) "
                           "a padded static batch's, simulated, 2.40x on the real engine (one run)")
    assert ("capacity over UELLM-like 6.00x (seeds 5.60-6.30x; holds; larger than the paper's 1.98x) on Alpaca, "
            "not run on Mixed") in line
    assert "1.50-1.60x (seeds 1.20-1.70x; 2 of 2 hold) where prefill binds" in line
    assert ("layout 0.98x (seeds 0.97-0.99x; fails; smaller than the paper's 1.31x) offline, 1.00x (seeds "
            "1.00x; tie; smaller than the paper's 1.37-1.93x) in capacity") in line
