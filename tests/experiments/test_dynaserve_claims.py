"""DynaServe's claims read off the runs' JSON: per-seed verdicts against the search's bracket, the
testbed's fit read from ``jitter_fit.json``, and the rows of the runs beyond the grid (the
alpha/beta mechanism, Fig. 10, Fig. 11), each from the numbers a run wrote."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tidal.experiments import dynaserve_claims as C
from tidal.sim.jitter import FITTED


def _cap(per_seed, tol, tech=(6.0, 6.1, 6.2), base=(5.0, 5.0, 5.0)):
    return {"system": "coloc-256", "per_seed": list(per_seed), "bound": [False] * 3, "tolerance": tol,
            "technique": list(tech), "baseline": list(base)}


def test_a_capacity_claim_cannot_hold_inside_its_searches_bracket():
    c = C.capacity_claim("m w", _cap([1.05, 1.06, 1.07], 0.04), "p", "why", "real", "coloc")
    assert c.verdict == "tie" and c.margin == pytest.approx(0.06) and c.tolerance == 0.04  # 5 % < 4 % + 2 %
    c = C.capacity_claim("m w", _cap([1.2, 1.3, 1.25], 0.04), "p", "why", "real", "coloc")
    assert c.verdict == "holds" and "6.00 / 6.10 / 6.20 vs 5.00 / 5.00 / 5.00 req/s (coloc-256)" in c.simulated
    assert C.capacity_claim("m w", _cap([0.8, 0.9, 0.95], 0.04), "p", "w", "r", "coloc").verdict == "fails"
    bound = {**_cap([1.2, 1.3, 24.0], 0.0), "bound": [False, False, True]}
    assert "a bound" in C.capacity_claim("m w", bound, "p", "w", "r", "disagg").simulated


def test_cell_claims_give_capacity_only_where_the_paper_has_it_and_the_table2_figures_on_the_hybrid():
    ratios = {"capacity_rps": {k: _cap([1.1] * 3, 0.03) for k in ("coloc", "coloc_2048", "disagg")},
              "max_goodput": {k: {"system": k, "per_seed": [1.1] * 3, "technique": [1.0] * 3, "baseline": [1.0] * 3,
                                  "tolerance": 0.0} for k in ("coloc", "disagg", "best")}}
    cells = C.cell_claims("qwen-2.5-14b", "hybrid", ratios, "why", ("a", "b", "c"), capacity_figure=True)
    assert [c.claim.split(": ", 1)[1] for c in cells] == [
        "capacity, DynaServe above tuned PD Coloc.", "capacity, DynaServe above PD Coloc. at 2,048-token chunks "
        "(Table 1's)", "capacity, DynaServe above PD Disagg.", "goodput, DynaServe above tuned PD Coloc.",
        "goodput, DynaServe above PD Disagg."]
    assert "Table 2: 4.6 / 5.9 / 7.4 rps" in cells[0].paper and cells[2].real == "b" and cells[3].real == "c"
    big = C.cell_claims("qwen-2.5-72b", "arxiv", ratios, "why", ("a", "b", "c"), capacity_figure=False)
    assert len(big) == 2 and all("goodput" in c.claim for c in big)  # Fig. 9 is 14B only


def _fit(tmp_path, params):
    rows = [{"shape": "8192-32", "layout": lay, "sim": {"p50_ms": 20.0, "p99_ms": 60.0, "rps": 0.8},
             "paper": {"p50_ms": 22.7, "p99_ms": 58.09, "rps": 0.83},
             "rel_err": {"p50_ms": -0.12, "p99_ms": 0.03, "rps": err}} for lay, err in (("disagg", -0.04),
                                                                                          ("coloc", 0.2))]
    fit = {"command": "tidal bench calibrate-jitter --output x.json",
           "fit": {"params": params, "rows": rows, "max_abs_rel_err": 0.2, "mean_abs_rel_err": 0.09}}
    path = tmp_path / "jitter_fit.json"
    path.write_text(json.dumps(fit))
    return json.loads(path.read_text())


def test_the_fit_is_read_from_its_json_never_restated(tmp_path):
    fit = _fit(tmp_path, asdict(FITTED))
    text = C.fit_text(fit, FITTED)
    assert "5 of its 6 figures within 15 % (largest 20.0%, mean 9.0%" in text and "differ" not in text
    assert "differ from the simulator's" in C.fit_text(_fit(tmp_path, {**asdict(FITTED), "sigma": 9.0}), FITTED)
    assert "not read" in C.fit_text(None, FITTED)
    row = C.table1_claim(fit)
    assert row.verdict == "n/a" and "8192-32 coloc: p99 TBT 60 ms (paper 58)" in row.simulated


def _run(running, plan=(70, 30), pred=1259.0, actual=1467.0, phi=0.7):
    return {"mean_running": list(running), "imbalance": max(running) / min(running), "phi_p50": phi,
            "tokens": {"planned_by_role": {"alpha": plan[0], "beta": plan[1]}, "predicted_output_mean": pred,
                       "actual_output_mean": actual}}


def test_the_why_row_compares_fixed_roles_imbalance_with_load_placements():
    ab = [{"seed": s, "rate": 2.0, "runs": {"dynaserve/predictor": _run((46.0, 33.0)),
                                            "dynaserve/oracle": _run((61.5, 22.6), plan=(66, 34)),
                                            "dynaserve-load/predictor": _run((37.6, 36.6)),
                                            "dynaserve-load/oracle": _run((38.6, 35.4))}} for s in (0, 1, 2)]
    c = C.why_claim(ab, "real")
    assert c.per_seed == pytest.approx([(46.0 / 33.0) / (37.6 / 36.6)] * 3) and c.verdict == "holds"
    assert "planned 66% of the decode tokens on alpha" in c.simulated and "61.5 vs 22.6 with exact lengths" in c.simulated
    ab[0]["runs"]["dynaserve-load/predictor"] = _run((60.0, 30.0))  # placement no better on one seed
    assert C.why_claim(ab, "real").verdict == "tie"


def test_fig10_and_fig11_rows_read_their_runs():
    def sysrow(g, per):
        return {"goodput": g, "goodput_per_interval": per}

    windows = [{"start_s": 60.0 * m, "systems": {"dynaserve-load": sysrow(110.0, [1, 3, 3]),
                                                 "coloc-256": sysrow(100.0, [2, 2, 2]),
                                                 "disagg": sysrow(120.0, [0, 4, 4])}} for m in (0, 8, 16)]
    f10 = {"headline": "dynaserve-load", "coloc": "coloc-256", "windows": windows, "rate_mean": 5.9,
           "input_mean": 1178.0, "output_mean": 202.0}
    coloc, disagg = C.replay_claims(f10, "r")
    assert coloc.verdict == "holds" and coloc.per_seed == pytest.approx([1.1] * 3)
    assert disagg.verdict == "fails" and "ahead in 2, 2, 2 of 3 intervals" in coloc.simulated
    assert "starting at minutes 0, 8, 16" in coloc.why
    seeds = [{"seed": s, "rate": 4.0, "with": {"within_slo": 0.99, "tbt_max_ms": 120.0},
              "without": {"within_slo": 0.6, "tbt_max_ms": 300.0}} for s in (0, 1, 2)]
    c = C.ablation_claim({"seeds": seeds}, "r")
    assert c.verdict == "holds" and c.per_seed == pytest.approx([0.99 / 0.6] * 3)
    assert "99.0% / 99.0% / 99.0% of the gaps within 100 ms" in c.simulated


def test_the_real_runs_profile_comes_from_its_step_log(tmp_path):
    from tidal.experiments.dynaserve_real import step_profile

    log = tmp_path / "steps.jsonl"
    lines = [{"instance": 0, "step_s": 0.5, "prefill_tokens": 55, "decodes": 4, "running": 5},
             {"instance": 0, "step_s": 0.3, "prefill_tokens": 55, "decodes": 2, "running": 3},
             {"instance": 0, "step_s": 0.12, "prefill_tokens": 0, "decodes": 4, "running": 4},
             {"instance": 1, "step_s": 0.066, "prefill_tokens": 0, "decodes": 3, "running": 3}]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    p = step_profile(str(log))["instances"]
    assert p["0"]["steps"] == 3 and p["0"]["mixed_steps"] == 2 and p["0"]["decode_s_per_seq"] == pytest.approx(0.03)
    assert p["0"]["mixed_s"][0] == pytest.approx(0.32) and p["1"]["decode_s_per_seq"] == pytest.approx(0.022)
    assert p["1"]["mixed_s"] is None
