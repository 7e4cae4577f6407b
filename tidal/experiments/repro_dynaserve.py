"""DynaServe (Sec. 6, Fig. 8-9, Table 2) in the simulator: serving capacity and goodput of split
micro-requests (DynaServe) against colocation with chunked prefill (PD Coloc., its chunk tuned)
and 1P1D disaggregation (PD Disagg.), two A100-80G instances of Qwen-2.5-14B.

It runs :mod:`tidal.experiments.sim_dynaserve` (``tidal bench sim-dynaserve``: capacity = the highest
Poisson rate at which 99 % of the requests keep their own P99 TBT within 100 ms and the median
TTFT within 2 s, found by search) and reads the claims off its JSON. The full run takes the
paper's hybrid workload (Table 2) and Mini Reasoning (Fig. 9) with the bench's own windows and
search; ``--quick`` Mini Reasoning only, three systems, 40 s windows of at most 200 requests per
probe, 3 probes. Both on the testbed fitted to the paper's Table 1 baselines (``--step-jitter
fitted``, :mod:`tidal.sim.jitter`). Without ``--quick`` (or with ``--real``) the three layouts also run on 2 real CPU
instances of the default model (:mod:`tidal.experiments.dynaserve_real`), on the shape of each simulated
workload that has one; ``--real-json`` reads a recorded run of them instead.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from tidal.common.machine import usable_cores
from tidal.experiments import sim_dynaserve as D
from tidal.experiments.reproduce import (
    Claim,
    Progress,
    Report,
    beats,
    fmt_rate,
    fmt_ratio,
    ratio,
    run_bench,
    runs_real,
)

REAL = ("not run here: Qwen-2.5-14B does not fit this 2-core CPU; the same three layouts on 2 real CPU "
        "instances of the default model run without --quick (or with --real)")
# the simulated workloads whose shape the real run can serve (lengths scaled down): Mini Reasoning's
REAL_SHAPES = {"mini-reasoning": "dynaserve-219-1467"}
REAL_NO_SHAPE = "not run on the real engine: only Mini Reasoning's shape is (a 2-core CPU's time)"
WHY_REAL = ("real: a 135M model on 1 CPU thread per instance, not vLLM on A100s; PD Coloc. there is one chunk "
            "size (256 tokens) with the same slo-compose local policy as the other two. Profiled from the workers' "
            "step reports (`tidal serve --step-log`): alpha is instance 0 of the only pair, so it runs every new "
            "prompt's prefill beside its decodes, and such a mixed step takes 0.3-0.7 s here, a gap over the TBT SLO "
            "for every request decoding on it; the length predictor starts cold (276 tokens predicted for 367), so part "
            "of the decode stays on alpha, whose decode steps cost ~30 ms a sequence against beta's ~22; a 1P1D prefill "
            "instance, idle most of the time, leaves its core to the decode instance")
WHY = ("the A100 analytic cost model with the testbed fitted to the paper's own baselines stands in for vLLM on "
       "A100s (`--step-jitter fitted`: Table 1's colocation and 1P1D runs give the prefill attention, 70 % of peak "
       "with a causal self factor of 1.15, the host jitter, the mixed-step interference and 1P1D's blocking KV "
       "receive; all 18 of its figures within 15 %, `tidal bench calibrate-jitter`; never fitted to DynaServe's "
       "own results)")
WHY_WL = {
    "hybrid": ("On the hybrid (prefill-bound: ~1,340 tokens in, ~69 out) colocation with 256-token chunks keeps "
               "nearly every request within the TBT SLO even with Table 1's tails (Table 1 measured colocation at "
               "2,048-token chunks, whose mixed steps are what break the SLO there), so its capacity is its queue "
               "growing: a split moves work, it removes none. Split's own losses: a request split inside its prompt "
               "runs its prefill on alpha, then on beta (TTFT), and beta's steps lengthen where hand-offs land"),
    "mini-reasoning": ("On Mini Reasoning (decode-heavy: 219 tokens in, 1,467 out) every layout's capacity is where "
                       "the host tails, which grow with the decode batch, put more than 1 % of the requests over the "
                       "100 ms TBT SLO; at the rates where colocation still keeps every request within it, split's "
                       "p99 TBT is longer (the probes' TBT p99 in `dynaserve_sim.json`)"),
}
# the bench's own windows (240 s, at most 2000 requests) and search (10 probes, 4 % bracket)
FULL = ["--workloads", "hybrid,mini-reasoning", "--systems", "coloc-256,coloc-512,coloc-2048,disagg,dynaserve",
        "--step-jitter", "fitted"]
QUICK = ["--workloads", "mini-reasoning", "--systems", "coloc-512,disagg,dynaserve", "--step-jitter", "fitted",
         "--num-requests", "200",
         "--window", "40", "--max-probes", "3", "--rate-low", "1", "--rate-high", "16"]


def _bench_argv(args: argparse.Namespace) -> list[str]:
    argv = ["bench", "sim-dynaserve", *(QUICK if args.quick else [*FULL, "--jobs", str(usable_cores())])]
    if args.no_progress:  # otherwise the bench's own lines (one per probe) show the progress
        argv.append("--no-progress")
    if args.no_plots:
        argv.append("--no-plots")
    return argv


def reproduce(args: argparse.Namespace, log: Progress) -> Report:
    data = run_bench(D.add_parser, _bench_argv(args), os.path.join(args.output, "dynaserve_sim.json"), log)
    s = data["setup"]
    cost = ("the testbed fitted to the paper's Table 1 baselines" if s.get("step_jitter") == "fitted"
            else "the mean cost model")
    report = Report(
        "dynaserve", "DynaServe: split micro-requests vs colocation vs 1P1D (Sec. 6, Fig. 9, Table 2)",
        f"Simulated: {', '.join(data['results'])} on {s['instances']} x {s['hardware']} ({cost}), Poisson arrivals, "
        f"{s['window_s']:g} s windows of at most {s['num_requests']} requests per probe; two capacities: the paper's "
        f"(highest sustained rate with >= {s['target']:.0%} of requests at P99 TBT <= {s['tbt_slo_ms']:g} ms) and the "
        f"TTFT-guarded one (the same and median TTFT <= {s['ttft_p50_ms']:g} ms); PD Coloc. = the best of its chunks ({', '.join(n for n in s['systems'] if n in D.COLOC)}). "
        f"Runs `tidal bench sim-dynaserve` (its JSON: `dynaserve_sim.json`).",
        args.quick, data=_slim(data), figures=[os.path.basename(p) for p in data.get("plots", [])])
    recorded, real = getattr(args, "real_json", None), None
    if recorded:
        real = _recorded_real(recorded)
    elif runs_real(args):
        real = _run_real(data, log)
    if real is not None:
        report.data["real"] = real
        how = (f"recorded earlier by `{real['command']}` (read from {recorded})" if recorded
               else f"run by this command, as `{real['command']}` runs it")
        report.setup += f" Real column: {how}."
    for model, by_wl in data["results"].items():
        for wl, res in by_wl.items():
            cells = _real_cells(real, wl)
            why = f"{WHY}. {WHY_WL[wl]}" if wl in WHY_WL else WHY
            why = f"{why}; {WHY_REAL}" if real is not None and wl in REAL_SHAPES else why
            report.claims += _claims(model, wl, res["systems"], data["ratios"][model][wl].get("dynaserve", {}), cells,
                                     why)
            paper = data.get("ratios_paper", {}).get(model, {}).get(wl, {}).get("dynaserve")
            if paper is not None:
                report.claims += _paper_claims(model, wl, res["systems"], paper, why)
    return report


def _run_real(data: dict[str, Any], log: Progress) -> dict[str, Any]:
    """The three layouts on 2 real CPU instances, on the shape of every simulated workload that has one."""
    from tidal.experiments import dynaserve_real as R

    setup = R.RealSetup()
    shapes = sorted({REAL_SHAPES[wl] for by_wl in data["results"].values() for wl in by_wl if wl in REAL_SHAPES})
    with tempfile.TemporaryDirectory(prefix="tidal-dynaserve-real-") as tmp:  # each run's records: not kept
        rows = R.run(shapes, list(R.LAYOUTS), setup, os.path.join(tmp, "run"), log)
    command = f"python benchmarks/dynaserve_serve.py --workloads {','.join(shapes)}"
    return {"setup": setup.__dict__, "engine_flags": setup.engine_flags(), "rows": rows, "command": command}


def _recorded_real(path: str) -> dict[str, Any]:
    """The real column from a recorded ``benchmarks/dynaserve_serve.py`` run's JSON (its runs take
    about 7 minutes a layout here): its setup, rows and command, checked for every layout of each shape."""
    from tidal.experiments import dynaserve_real as R

    with open(path) as f:
        rec = json.load(f)
    st = {**R.RealSetup().__dict__, **{k: v for k, v in rec["args"].items() if k in R.RealSetup().__dict__}}
    for wl in REAL_SHAPES.values():
        missing = set(R.LAYOUTS) - {r["layout"] for r in rec["rows"] if r["workload"] == wl}
        if missing and any(r["workload"] == wl for r in rec["rows"]):
            raise ValueError(f"{path}: {wl} lacks the layouts {sorted(missing)}")
    return {"setup": st, "rows": rec["rows"], "command": rec["command"], "machine": rec.get("machine")}


def _real_cells(real: dict[str, Any] | None, wl: str) -> tuple[str, str, str]:
    """The real column of the three claims of workload ``wl`` (capacity vs PD Coloc., vs PD Disagg.,
    goodput), or why there is none."""
    if real is None:
        return REAL, REAL, REAL
    by = {r["layout"]: r for r in real["rows"] if r["workload"] == REAL_SHAPES.get(wl)}
    if not by:
        return REAL_NO_SHAPE, REAL_NO_SHAPE, REAL_NO_SHAPE
    st = real["setup"]
    split, coloc, disagg = by["split"], by["colocate"], by["disaggregate"]
    slo = ", ".join(f"{k} <= {v} ms" for k, v in (kv.split("=") for kv in st["slo"].split(",")))
    where = (f"2 CPU instances of the default model, {REAL_SHAPES[wl]} at {split['lengths'][0]}/{split['lengths'][1]} "
             f"tokens, {slo} for {st['target']:.0%}, {st['duration']:g} s Poisson probes")

    def cap(row: dict[str, Any]) -> str:
        c = row["capacity_rps"]
        if c is None:
            return f"< {st['search_low']:g}"
        return f">= {c:.2f}" if c >= st["search_high"] else f"{c:.2f}"

    def cap_cell(base: dict[str, Any]) -> str:
        gain = ratio(split["capacity_rps"], base["capacity_rps"])
        holds = beats(split["capacity_rps"], base["capacity_rps"])
        return (f"{cap(split)} vs {cap(base)} rps: {fmt_ratio(gain)} ({where}) "
                f"(direction holds: {'yes' if holds else '**no**'})")

    holds = beats(split["goodput_tok_s"], coloc["goodput_tok_s"]) and beats(split["goodput_tok_s"],
                                                                            disagg["goodput_tok_s"])
    good = (f"{split['goodput_tok_s']:.0f} vs {coloc['goodput_tok_s']:.0f} (PD Coloc.) and "
            f"{disagg['goodput_tok_s']:.0f} tok/s (PD Disagg.), each at its own capacity ({where}) "
            f"(direction holds: {'yes' if holds else '**no**'})")
    return cap_cell(coloc), cap_cell(disagg), good


def _claims(model: str, wl: str, rows: dict[str, Any], r: dict[str, Any],
            real: tuple[str, str, str] = (REAL, REAL, REAL), why: str = WHY) -> list[Claim]:
    cap = {k: v["capacity_rps"] for k, v in rows.items()}
    good = {k: v["max_goodput"] for k, v in rows.items()}
    coloc_name, coloc = r["capacity_rps"]["coloc"], None
    if coloc_name:
        coloc = cap[coloc_name]
    paper_cap = "1.15-3.07x PD Coloc., 1.09-1.67x PD Disagg. (Sec. 1, Fig. 9)"
    if wl == "hybrid":
        paper_cap += "; Table 2: 4.6 / 5.9 / 7.4 rps"
    out = [
        Claim(f"{model} {wl}: capacity, DynaServe above tuned PD Coloc.", paper_cap,
              f"{fmt_rate(cap.get('dynaserve'))} vs {fmt_rate(coloc)} rps ({coloc_name}): "
              f"{fmt_ratio(r['capacity_rps']['vs_coloc'])}", beats(cap.get("dynaserve"), coloc), why, real[0]),
        Claim(f"{model} {wl}: capacity, DynaServe above PD Disagg. (1P1D)", paper_cap,
              f"{fmt_rate(cap.get('dynaserve'))} vs {fmt_rate(cap.get('disagg'))} rps: "
              f"{fmt_ratio(r['capacity_rps']['vs_disagg'])}", beats(cap.get("dynaserve"), cap.get("disagg")), why,
              real[1]),
    ]
    g_coloc = r["max_goodput"]["coloc"]
    out.append(Claim(
        f"{model} {wl}: goodput, DynaServe above PD Coloc. and PD Disagg.",
        "up to 1.91x PD Coloc. and 1.61x PD Disagg. (Fig. 8)" + ("; Table 2: 316 / 399 / 474 tok/s" if wl == "hybrid"
                                                                  else ""),
        f"{_tok(good.get('dynaserve'))} vs {_tok(good.get(g_coloc) if g_coloc else None)} ({g_coloc}) and "
        f"{_tok(good.get('disagg'))} tok/s (the highest over the probes that kept up)",
        beats(good.get("dynaserve"), good.get(g_coloc) if g_coloc else None) and beats(good.get("dynaserve"),
                                                                                        good.get("disagg")),
        why, real[2]))
    return out


PAPER_DEF = ("the paper's capacity (Sec. 6.3): >= 99 % of requests at P99 TBT <= the SLO, the rate sustained "
             "(the last quarter's median TTFT at most 2x the first quarter's + 1 s: no growing queue), no TTFT bound")
REAL_PAPER_DEF = "the real run reports the TTFT-guarded capacity only"


def _paper_claims(model: str, wl: str, rows: dict[str, Any], r: dict[str, Any], why: str) -> list[Claim]:
    """The two capacity claims under the paper's own definition (``paper`` fields of each row)."""
    cap = {k: v.get("paper", {}).get("capacity_rps") for k, v in rows.items()}
    coloc_name = r["capacity_rps"]["coloc"]
    coloc = cap.get(coloc_name) if coloc_name else None
    paper_cap = "1.15-3.07x PD Coloc., 1.09-1.67x PD Disagg. (Sec. 1, Fig. 9)" + (
        "; Table 2: 4.6 / 5.9 / 7.4 rps" if wl == "hybrid" else "")
    return [
        Claim(f"{model} {wl}: capacity by the paper's definition, DynaServe above tuned PD Coloc.", paper_cap,
              f"{fmt_rate(cap.get('dynaserve'))} vs {fmt_rate(coloc)} rps ({coloc_name}): "
              f"{fmt_ratio(r['capacity_rps']['vs_coloc'])}", beats(cap.get("dynaserve"), coloc),
              f"{PAPER_DEF}; {why}", REAL_PAPER_DEF),
        Claim(f"{model} {wl}: capacity by the paper's definition, DynaServe above PD Disagg. (1P1D)", paper_cap,
              f"{fmt_rate(cap.get('dynaserve'))} vs {fmt_rate(cap.get('disagg'))} rps: "
              f"{fmt_ratio(r['capacity_rps']['vs_disagg'])}", beats(cap.get("dynaserve"), cap.get("disagg")),
              f"{PAPER_DEF}; {why}", REAL_PAPER_DEF),
    ]


def _tok(x: float | None) -> str:
    return "none" if x is None else f"{x:,.0f}"


def _slim(data: dict[str, Any]) -> dict[str, Any]:
    """Capacity, goodput and ratios (the bench's own JSON, next to this one, has every probe)."""
    return {"setup": data["setup"], "ratios": data["ratios"], "ratios_paper": data.get("ratios_paper", {}), "results": {
        m: {wl: {"workload": res["workload"],
                 "systems": {k: {**{kk: v[kk] for kk in ("capacity_rps", "goodput_at_capacity", "max_goodput")},
                                 "paper_capacity_rps": v.get("paper", {}).get("capacity_rps")}
                             for k, v in res["systems"].items()}}
            for wl, res in by_wl.items()}
        for m, by_wl in data["results"].items()}}
