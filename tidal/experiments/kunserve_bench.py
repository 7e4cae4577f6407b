"""What ``tidal bench sim-kunserve`` runs, in order, and how its JSON is put together.

1. every dataset's compute capacity (an unlimited pool, steady arrivals);
2. the rate: the paper's 60 % rule, one :class:`tidal.experiments.kunserve_regime.DemandSearch` per
   dataset, all datasets' probes (one run a seed) at once;
3. every (dataset, seed, system) run, the pipeline-fit runs, the shrunken pool's sizing runs and
   the extreme burst's runs; then the runs that need the fitted gap or the shrunken pool;
4. per dataset: each system's runs (one a seed) with medians, the per-seed ratios every claim is
   judged on, the SLO curves, the regime as it came out (each seed's busiest window, vLLM's KV).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.experiments import kunserve_extreme as X
from tidal.experiments import kunserve_pipeline_fit as PF
from tidal.experiments import kunserve_regime as R
from tidal.experiments import kunserve_slo as SLO
from tidal.experiments.kunserve_runs import (
    BASELINES,
    CALIBRATED,
    CLUSTERS,
    DROP,
    GROUP_RULE,
    LOOKAHEAD_OFF,
    SYSTEMS,
    VLLM,
    default_blocks,
    pool_memory,
    workload,
)
from tidal.experiments.parallel import run_all
from tidal.experiments.sim_kunserve import SHRUNKEN, capacity_run, demand_run, system_run

BIG = ("timelines", "ttft_series", "requests", "events")
Log = Callable[[str], None]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def _median(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return float(statistics.median(v)) if v else None


def _done(log: Log, tag: Callable[[int], str]) -> Callable[[int, Any], None]:
    def on_done(i: int, out: dict[str, Any]) -> None:
        t, o = out["ttft_ms"], out["tpot_ms"]
        bubble = f", bubbles {out['bubble_ratio']:.1%}" if out.get("bubble_ratio") is not None else ""
        log(f"{tag(i)}: TTFT p50/p99 {_ms(t['p50'])} / {_ms(t['p99'])} ms, TPOT p50/p99 {_ms(o['p50'])} / "
            f"{_ms(o['p99'])} ms, {out['num_preemptions']} preemptions{bubble}, {out['lost']} lost "
            f"({out['wall_s']:.0f} s wall)")
    return on_done


def search_rates(args: argparse.Namespace, names: list[str], seeds: list[int], log: Log) -> dict[str, Any]:
    """The paper's rule per dataset: every dataset's next probe on every seed at once, each probe the
    mean over the seeds of vLLM's time-mean KV demand."""
    c = CLUSTERS[args.cluster]
    searches = {ds: R.DemandSearch(c.initial_rate[ds], tolerance=args.search_tolerance, max_probes=args.search_probes)
                for ds in names}
    while todo := [(ds, rate) for ds, s in searches.items() if (rate := s.next_rate()) is not None]:
        calls = [(args.cluster, ds, args.duration, rate, seed, args.arrivals, args.azure_trace)
                 for ds, rate in todo for seed in seeds]
        outs = run_all(demand_run, calls, args.jobs)
        for k, (ds, rate) in enumerate(todo):
            per = outs[k * len(seeds):(k + 1) * len(seeds)]
            demand = _mean([p["mean_kv_demand"] for p in per])
            searches[ds].record(rate, demand, mean_kv_use=_mean([p["mean_kv_use"] for p in per]),
                                per_seed=[p["mean_kv_demand"] for p in per],
                                vllm_ttft_p99_ms=[p["ttft_p99_ms"] for p in per],
                                vllm_tpot_p50_ms=[p["tpot_p50_ms"] for p in per])
            log(f"{ds}: demand search: {rate:.3g} req/s -> vLLM's time-mean KV demand {demand:.0%} of the pool "
                f"(seeds: {', '.join(f'{x:.0%}' for x in (p['mean_kv_demand'] for p in per))}; in use "
                f"{_mean([p['mean_kv_use'] for p in per]):.0%}) "
                f"{'<=' if demand <= R.DEMAND_SHARE else '>'} {R.DEMAND_SHARE:.0%}")
    return {ds: s.result() for ds, s in searches.items()}


def _window(args: argparse.Namespace, ds: str, rate: float, seed: int) -> float:
    times = np.asarray([s.arrival_s for s in workload(ds, args.duration, rate, seed, args.arrivals, args.azure_trace)])
    return float(R.window_rates(times, args.duration).max())


def execute(args: argparse.Namespace, report: dict[str, Any], names: list[str], labels: list[str], seeds: list[int],
            gaps: list[float], shrunken: bool, extreme: bool, log: Log) -> None:
    cl, dur, jobs = args.cluster, args.duration, args.jobs
    caps = run_all(capacity_run, [(cl, ds, seeds[0], "llumnix", args.probe_duration, args.probes) for ds in names], jobs)
    cap = dict(zip(names, caps, strict=True))
    for ds in names:
        log(f"{ds}: compute capacity {cap[ds]['capacity']:.2f} req/s ({cap[ds]['definition']})")
    if args.rate is None:
        searched = search_rates(args, names, seeds, log)
        rates = {ds: searched[ds]["rate"] for ds in names}
    else:
        searched, rates = {}, dict.fromkeys(names, args.rate)
    blocks = default_blocks(cl)
    regimes: dict[str, dict[str, Any]] = {}
    for ds in names:
        r, k = rates[ds], cap[ds]["capacity"]
        peaks = [_window(args, ds, r, s) for s in seeds]
        regimes[ds] = {"rate": r, "rate_source": "searched" if args.rate is None else "given (--rate)",
                       "search": searched.get(ds), "capacity": cap[ds], "rate_over_capacity": r / k,
                       "compute_bound": r > k, "num_blocks": blocks, **pool_memory(cl, blocks),
                       "max_window_rate": peaks, "max_window_over_capacity": [p / k for p in peaks]}
        log(f"{ds}: mean rate {r:.3g} req/s = {r / k:.0%} of the compute capacity"
            + (" (compute saturates before the 60 % rule binds)" if r > k else "")
            + f"; busiest {R.WINDOW_S:g} s windows {', '.join(f'{p / k:.0%}' for p in peaks)} of it; pool {blocks} blocks "
            f"({regimes[ds]['pool_gib']:.1f} GiB, weights + pool {regimes[ds]['gpu_memory_share']:.0%} of the GPUs)")
    # batch A: the runs that need only the rate
    head = [x for x in labels if x != CALIBRATED]
    calls: list[tuple[Any, ...]] = []
    tags: list[tuple[str, ...]] = []
    for ds in names:
        for seed in seeds:
            for label in head:
                calls.append((cl, ds, dur, rates[ds], seed, args.arrivals, args.azure_trace, label))
                tags.append(("run", ds, str(seed), label))
    fit_ds = "longbench" if "longbench" in names else names[0]
    fit = CALIBRATED in labels
    if fit:
        for g in gaps:
            for label in (DROP, LOOKAHEAD_OFF):
                calls.append((cl, fit_ds, dur, rates[fit_ds], seeds[0], args.arrivals, args.azure_trace, label, None, g))
                tags.append(("fit", fit_ds, str(g), label))
    sh_rate: dict[str, tuple[float, float]] = {}
    if shrunken:
        for ds in names:
            gen = lambda r, ds=ds: R.arrivals(args.arrivals, np.random.default_rng(seeds[0]), dur, r, args.azure_trace)  # noqa: E731
            sh_rate[ds] = R.rate_under_capacity(cap[ds]["capacity"], gen, dur)
            calls.append((cl, ds, dur, sh_rate[ds][0], seeds[0], args.arrivals, args.azure_trace, VLLM, R.UNLIMITED_BLOCKS))
            tags.append(("sizing", ds, str(seeds[0]), VLLM))
    if extreme:
        xds = fit_ds
        for seed in seeds:
            for label in (VLLM, DROP):
                calls.append((cl, xds, dur, rates[xds], seed, args.arrivals, args.azure_trace, label, None, 0.0,
                              args.extreme_s))
                tags.append(("extreme", xds, str(seed), label))
    outs = run_all(system_run, calls, jobs, _done(log, lambda i: " ".join(tags[i])))
    by = dict(zip(tags, outs, strict=True))
    # batch B: the fitted gap's runs and the shrunken pool's
    calls, tags2 = [], []
    if fit:
        pts = {cfg: [(g, by[("fit", fit_ds, str(g), label)]["bubble_ratio"]) for g in gaps]
               for cfg, label in (("lookahead", DROP), ("token-count", LOOKAHEAD_OFF))}
        report["pipeline_fit"] = {"dataset": fit_ds, "seed": seeds[0], "rate": rates[fit_ds], **PF.fit_stage_gap(pts)}
        gap = report["pipeline_fit"]["gap_s"]
        log(f"pipeline fit on {fit_ds}: " + (f"stage gap {gap * 1000:.2f} ms -> bubbles "
            f"{report['pipeline_fit']['fitted']['lookahead']:.1%} with lookahead (paper 8.3 %), "
            f"{report['pipeline_fit']['fitted']['token-count']:.1%} without (paper 21.9 %)" if gap is not None
            else report["pipeline_fit"]["reason"]))
        if gap is not None:
            for ds in names:
                for seed in seeds:
                    calls.append((cl, ds, dur, rates[ds], seed, args.arrivals, args.azure_trace, CALIBRATED, None, gap))
                    tags2.append(("run", ds, str(seed), CALIBRATED))
    sh_blocks: dict[str, dict[str, Any]] = {}
    for ds in sh_rate:
        kv = R.kv_in_use(by[("sizing", ds, str(seeds[0]), VLLM)]["timelines"], R.UNLIMITED_BLOCKS)
        nb = R.pool_blocks(kv["mean_blocks"])
        sh_blocks[ds] = {"num_blocks": nb, "unlimited_mean_blocks": kv["mean_blocks"],
                         "unlimited_peak_blocks": kv["peak_blocks"], **pool_memory(cl, nb)}
        log(f"{ds}: shrunken pool: {sh_rate[ds][0]:.3g} req/s (busiest window {sh_rate[ds][1]:.3g} req/s = "
            f"{sh_rate[ds][1] / cap[ds]['capacity']:.0%} of capacity), pool {nb} blocks = 2x vLLM's mean in use "
            f"({sh_blocks[ds]['gpu_memory_share']:.0%} of a GPU; a pair frees "
            f"{sh_blocks[ds]['freed_over_pool']['2']:.1f}x its pool)")
        for seed in seeds:
            for label in SHRUNKEN:
                calls.append((cl, ds, dur, sh_rate[ds][0], seed, args.arrivals, args.azure_trace, label, nb))
                tags2.append(("shrunken", ds, str(seed), label))
    by.update(zip(tags2, run_all(system_run, calls, jobs, _done(log, lambda i: " ".join(tags2[i]))), strict=True))
    report["_seed0"] = {}
    for ds in names:
        report["datasets"][ds] = dataset_block(by, ds, [x for x in labels if ("run", ds, str(seeds[0]), x) in by],
                                               seeds, regimes[ds], "run")
        report["_seed0"][ds] = {x: by[("run", ds, str(seeds[0]), x)] for x in labels if ("run", ds, str(seeds[0]), x) in by}
        if ds in sh_rate:
            g = {"rate": sh_rate[ds][0], "max_window_rate": sh_rate[ds][1],
                 "max_window_over_capacity": sh_rate[ds][1] / cap[ds]["capacity"], "capacity": cap[ds]["capacity"],
                 "rate_source": f"every {R.WINDOW_S:g} s window at most {R.CAPACITY_SHARE:.0%} of the compute capacity "
                                "(seed 0's arrivals)",
                 "pool_source": f"{R.POOL_OVER_MEAN:g} x vLLM's mean KV in use with an unlimited pool", **sh_blocks[ds]}
            report["datasets"][ds]["shrunken_pool"] = dataset_block(by, ds, list(SHRUNKEN), seeds, g, "shrunken")
    if extreme:
        report["extreme_burst"] = extreme_block(by, fit_ds, seeds, rates[fit_ds], blocks, cl, args.extreme_s)


def _slim_run(out: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in out.items() if k not in BIG} | {"num_events": len(out.get("events", []))}


def _peak_demand(out: dict[str, Any]) -> float:
    return max((max(tl["kv_demand"]) for tl in out["timelines"] if tl["kv_demand"]), default=0.0)


def dataset_block(by: dict[tuple[str, ...], Any], ds: str, labels: list[str], seeds: list[int],
                  regime: dict[str, Any], kind: str) -> dict[str, Any]:
    """One dataset's systems (per seed, medians), the per-seed ratios and the SLO curves."""
    runs = {x: [by[(kind, ds, str(s), x)] for s in seeds] for x in labels}
    v = runs[VLLM]
    regime["per_seed"] = [{"seed": s, "num_requests": o["num_requests"], "vllm_mean_kv_demand": o["mean_kv_demand"],
                           "vllm_mean_kv_use": o["mean_kv_use"], "vllm_peak_kv_demand": _peak_demand(o)}
                          for s, o in zip(seeds, v, strict=True)]
    specs0 = None
    out: dict[str, Any] = {"rate": regime["rate"], "seeds": seeds, "regime": regime,
                           "num_requests": [o["num_requests"] for o in v], "systems": {}}
    if kind == "run":
        specs0 = runs[VLLM][0]["requests"]
        out["num_requests_seed0"] = len(specs0["arrival"])
    for x, rs in runs.items():
        out["systems"][x] = {"role": SYSTEMS[x]["role"], "per_seed": [_slim_run(o) for o in rs], "median": {
            "ttft_ms": {p: _median([o["ttft_ms"][p] for o in rs]) for p in ("p50", "p99")},
            "tpot_ms": {p: _median([o["tpot_ms"][p] for o in rs]) for p in ("p50", "p99")},
            "bubble_ratio": _median([o["bubble_ratio"] for o in rs])}}

    def ratio(a: str, b: str, metric: str, p: str) -> list[float | None]:
        """Per seed, ``a``'s metric over ``b``'s."""
        return [(x[metric][p] / y[metric][p]) if x[metric][p] and y[metric][p] else None
                for x, y in zip(runs[a], runs[b], strict=True)]

    bases = [b for b in BASELINES if b in runs]
    r: dict[str, Any] = {"p99_ttft": {b: ratio(b, DROP, "ttft_ms", "p99") for b in bases},
                         "p50_tpot_cost": {b: ratio(DROP, b, "tpot_ms", "p50") for b in bases},
                         "p99_tpot_cost": {b: ratio(DROP, b, "tpot_ms", "p99") for b in bases}}
    if LOOKAHEAD_OFF in runs:
        r["lookahead_bubbles"] = [(off["bubble_ratio"] / on["bubble_ratio"]) if on["bubble_ratio"] and off["bubble_ratio"]
                                  is not None else None for on, off in zip(runs[DROP], runs[LOOKAHEAD_OFF], strict=True)]
        r["lookahead_p99_ttft"] = ratio(LOOKAHEAD_OFF, DROP, "ttft_ms", "p99")
        r["lookahead_p99_tpot"] = ratio(LOOKAHEAD_OFF, DROP, "tpot_ms", "p99")
    if GROUP_RULE in runs:
        r["group_dispatch_p99_ttft"] = ratio(DROP, GROUP_RULE, "ttft_ms", "p99")
    if CALIBRATED in runs:
        r["calibrated_p99_ttft"] = {b: ratio(b, CALIBRATED, "ttft_ms", "p99") for b in bases}
        r["calibrated_p50_tpot_cost"] = {b: ratio(CALIBRATED, b, "tpot_ms", "p50") for b in bases}
    out["ratios"] = r
    if kind == "run":
        per = []
        for i in range(len(seeds)):
            c = SLO.curves({x: runs[x][i]["requests"] for x in [*bases, DROP]}, bases)
            c["attainment_ratio"], c["best_baseline"], c["violation_reduction"] = SLO.attainment_ratio(c, DROP, bases)
            per.append(c)
        at5 = SLO.SCALES.index(X.SLO_SCALE)
        out["slo"] = {"per_seed": per, "attainment_ratio": [c["attainment_ratio"] for c in per],
                      "violation_reduction": [c["violation_reduction"] for c in per],
                      "best_baseline": [c["best_baseline"] for c in per],
                      "drop_at_5": [c["systems"][DROP]["violation"][at5] for c in per],
                      "mean_violation": {x: [c["systems"][x]["mean_violation"] for c in per] for x in per[0]["systems"]}}
    return out


def extreme_block(by: dict[tuple[str, ...], Any], ds: str, seeds: list[int], rate: float, blocks: int,
                  cluster: str, extreme_s: float = X.EXTREME_S) -> dict[str, Any]:
    """Fig. 16 per seed: each system's memory limit after the burst, what the drops freed, SLO (5x)."""
    pool = pool_memory(cluster, blocks)["pool_gib"] * 1024**3 * CLUSTERS[cluster].instances
    per = []
    for s in seeds:
        v, d = by[("extreme", ds, str(s), VLLM)], by[("extreme", ds, str(s), DROP)]
        start = v["burst_start_s"]
        end = start + extreme_s
        lv, ld = X.memory_limit(v["events"], start, "preempt"), X.memory_limit(d["events"], start, "drop")
        ndrops, nbytes = X.freed(d["events"], ld)
        head = by[("run", ds, str(s), VLLM)]  # the normal run's P50s: Fig. 13's SLO scale
        ttft_slo, tpot_slo = (X.SLO_SCALE * SLO.p50(head["requests"]["ttft"]),
                              X.SLO_SCALE * (SLO.p50(head["requests"]["tpot"]) or 0) or None)
        t1 = ld if ld is not None else end
        wv = X.window_slo(v["requests"], start, t1, ttft_slo, tpot_slo)
        wd = X.window_slo(d["requests"], start, t1, ttft_slo, tpot_slo)
        ref = SLO.p50(head["requests"]["ttft"])
        # a limit not reached within the run counts as the run's end (the ratio is then a bound)
        sv, sd = (lv if lv is not None else end) - start, (ld if ld is not None else end) - start
        per.append({"seed": s, "burst_start_s": start, "vllm_limit_s": lv, "drop_limit_s": ld,
                    "drop_limit_censored": ld is None, "vllm_limit_censored": lv is None,
                    "sustain_ratio": sd / sv if sv > 0 else None,
                    "drops": ndrops, "freed_bytes": nbytes, "freed_over_pool": nbytes / pool,
                    "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo, "window_s": [start, t1], "vllm": wv, "drop": wd},
                    "attainment_ratio": (wd["attainment"] / wv["attainment"]) if wv["attainment"] else
                    (float("inf") if wd["attainment"] else None),
                    "vllm_max_ttft_over_p50": (wv["max_ttft_s"] / ref) if wv["max_ttft_s"] is not None and ref else None,
                    "runs": {VLLM: _slim_run(v), DROP: _slim_run(d)}})
    return {"dataset": ds, "rate": rate, "burst_factor": X.BURST_FACTOR, "extreme_s": extreme_s,
            "slo_scale": X.SLO_SCALE, "per_seed": per,
            "_runs": {s: {VLLM: by[("extreme", ds, str(s), VLLM)], DROP: by[("extreme", ds, str(s), DROP)]}
                      for s in seeds[:1]}}


def seed0_view(report: dict[str, Any]) -> dict[str, Any]:
    """Seed 0's full runs, shaped as :func:`tidal.experiments.kunserve_timelines.write_timelines` reads them."""
    return {"command": report["command"], "datasets": {ds: {"systems": runs} for ds, runs in report["_seed0"].items()}}


def slim(report: dict[str, Any]) -> dict[str, Any]:
    """The JSON: no per-run timelines, TTFT series or per-request latencies (the timelines JSON has seed 0's)."""
    out = {k: v for k, v in report.items() if not k.startswith("_")}
    if "extreme_burst" in out:
        out["extreme_burst"] = {k: v for k, v in out["extreme_burst"].items() if not k.startswith("_")}
    return out


def print_tables(report: dict[str, Any]) -> None:
    for ds, d in report["datasets"].items():
        _table(ds, d)
        if "shrunken_pool" in d:
            _table(f"{ds} (shrunken pool, sensitivity)", d["shrunken_pool"])
        if "slo" in d:
            print(f"{ds}: SLO attainment (mean over scales 1-10) KunServe over the best baseline, per seed: "
                  + ", ".join(f"{c['attainment_ratio']:.3f} ({c['best_baseline'].split(' (')[0]})"
                              for c in d["slo"]["per_seed"]))
    fit = report.get("pipeline_fit")
    if fit and fit.get("gap_s") is not None:
        print(f"\npipeline fit: stage gap {fit['gap_s'] * 1000:.2f} ms: bubbles {fit['fitted']['lookahead']:.1%} / "
              f"{fit['fitted']['token-count']:.1%} (paper 8.3 % / 21.9 %)")
    for e in (report.get("extreme_burst") or {}).get("per_seed", []):
        print(f"extreme burst, seed {e['seed']}: burst at {e['burst_start_s']:.0f} s, vLLM out of memory at "
              f"{_ms(e['vllm_limit_s'])} s, KunServe at {_ms(e['drop_limit_s'])} s"
              + (" (not within the run)" if e["drop_limit_censored"] else "")
              + f" after {e['drops']} drops freeing {e['freed_over_pool']:.0%} of the pool")


def _table(ds: str, d: dict[str, Any]) -> None:
    print(f"\n== {ds}: {d['rate']:.3g} req/s, seeds {d['seeds']} (medians over the seeds)")
    print(f"{'system':<52}{'TTFT p50':>10}{'TTFT p99':>11}{'TPOT p50':>10}{'TPOT p99':>10}{'bubbles':>9}  "
          "P99 TTFT / drop's, per seed")
    for label, s in d["systems"].items():
        m = s["median"]
        per = d["ratios"]["p99_ttft"].get(label)
        bubble = "-" if m["bubble_ratio"] is None else f"{m['bubble_ratio']:.1%}"
        print(f"{label:<52}{_ms(m['ttft_ms']['p50']):>10}{_ms(m['ttft_ms']['p99']):>11}{_ms(m['tpot_ms']['p50']):>10}"
              f"{_ms(m['tpot_ms']['p99']):>10}{bubble:>9}  "
              + (", ".join("-" if x is None else f"{x:.2f}x" for x in per) if per else ""))


__all__ = ["dataset_block", "execute", "extreme_block", "print_tables", "search_rates", "seed0_view", "slim"]
