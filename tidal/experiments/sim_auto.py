"""``tidal bench sim-auto``: ``--kv-pressure auto`` against each fixed response, and ``--batching auto``
against Pang et al.'s controllers, in the simulator; with ``--page``, the generated page.

Three measurements, every one on several seeds, each seed's ratios kept:

1. **a trace that changes regime** (:mod:`tidal.experiments.auto_trace`): bursty chat, long-context
   conversation and short code completions back to back, on KunServe's cluster
   (:mod:`tidal.experiments.auto_runs`); each phase's rate by KunServe Sec. 5.1's rule on the
   ``recompute`` baseline (mean KV demand at most 60 % of the pool, the queue not growing), searched
   on seed 0; and a sensitivity at 1.25x those rates (fixed before any run). ``auto`` and each fixed
   response: P50 / P99 TTFT, P99 TPOT, goodput and requests lost, per phase and over the trace;
2. **KunServe's own setup** (``tidal bench sim-kunserve``'s datasets and bursty arrivals, the default
   pool, the rate by the same 60 % rule): ``auto`` against drop (the paper's technique) and the baselines;
3. **Pang et al.'s own setup** (``tidal bench sim-policies``' ``pang-sla``): ``--batching auto`` against
   the fixed cap (vLLM), ``sla`` and ``memory+sla`` (the paper's), by capacity at 90 % SLO attainment.

Claims are judged per seed: ``holds`` when every seed meets the bar, ``fails`` when none does, ``tie``
otherwise. ``--real`` adds the real engine: 2 CPU workers under a burst with small pools, ``auto``'s
tokens against one engine's and its recorded choices (:mod:`tidal.experiments.auto_real`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from tidal.common import flags as F
from tidal.common.machine import machine_info, usable_cores
from tidal.common.results import command_line, write_json
from tidal.experiments import auto_runs as AR
from tidal.experiments import auto_trace as AT
from tidal.experiments.parallel import run_all

PROG = "tidal bench sim-auto"
SHARE = 0.6  # KunServe Sec. 5.1: "the average memory demand is lower than 60% of the total memory"
SENSITIVITY = 1.25  # the second load level: every phase's rate times this (chosen before any run)
INITIAL = {"chat": 20.0, "long": 2.0, "code": 20.0, "burstgpt": 40.0, "sharegpt": 12.0, "longbench": 4.0}
PHASE_BAR = 1.05  # per phase: auto's P99 TTFT within 5 % of the best fixed response's
TRACE_BAR = 1.2  # over the trace: every fixed response's P99 TTFT at least 1.2x auto's
PAPER_BAR = 1.05  # the papers' setups: within 5 % of the paper's technique / never 5 % worse than the baseline
PANG_POLICIES = {"static (fixed cap 256)": {"batching": "continuous", "max_num_seqs": 256},
                 "sla": {"batching": "sla", "tbt_slo_ms": 50.0, "max_num_seqs": 256},
                 "memory+sla": {"batching": "memory+sla", "tbt_slo_ms": 50.0, "max_num_seqs": 256},
                 "auto": {"batching": "auto", "tbt_slo_ms": 50.0, "max_num_seqs": 256}}


def verdict(oks: list[bool]) -> str:
    return "holds" if oks and all(oks) else "fails" if oks and not any(oks) else "tie"


# ---------------------------------------------------------------- module-level runs (--jobs)
def phase_search(phase: str, duration_s: float, max_len: int, traces_dir: str | None, probes: int) -> dict[str, Any]:
    def run(rate: float) -> dict[str, Any]:
        return AR.probe(AT.phase_requests(phase, rate, duration_s, 0, max_len, traces_dir), rate, duration_s)
    return AT.search_rate(run, INITIAL[phase], SHARE, max_probes=probes)


def dataset_search(dataset: str, duration_s: float, probes: int) -> dict[str, Any]:
    from tidal.experiments.kunserve_runs import workload

    def run(rate: float) -> dict[str, Any]:
        return AR.probe(workload(dataset, duration_s, rate, 0), rate, duration_s)
    return AT.search_rate(run, INITIAL[dataset], SHARE, max_probes=probes)


def trace_run(system: str, rates: dict[str, float], duration_s: float, seed: int, max_len: int,
              traces_dir: str | None, per_phase: tuple[str, ...] = ()) -> dict[str, Any]:
    """One system on the seed's regime trace; ``per_phase``: a bound's response for each phase, in order
    (pinned from each phase's start)."""
    specs, phases = AT.regime_trace(rates, duration_s, seed, max_len, traces_dir=traces_dir)
    if per_phase:
        pinned = [(p.start_s, r) for p, r in zip(phases, per_phase, strict=True)]
        return AR.simulate(system, specs, phases, pinned=pinned)
    return AR.simulate(system, specs, phases, audit=True)


def dataset_run(system: str, dataset: str, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    from tidal.experiments.kunserve_runs import workload

    return AR.simulate(system, workload(dataset, duration_s, rate, seed), audit=True)


def pang_run(label: str, policy: str, num_requests: int, seed: int) -> dict[str, Any]:
    from tidal.experiments.sim_policies import SCENARIOS, capacity, workload

    sc = SCENARIOS["pang-sla"]
    cap, at, probes = capacity(sc, PANG_POLICIES[policy], workload(sc, label, num_requests, seed), 0.05, 200.0)
    return {"capacity_rps": cap, "tpot_p99_ms": ((at or {}).get("tpot_ms") or {}).get("p99"),
            "output_tok_s": (at or {}).get("output_throughput"), "probes": len(probes)}


# ---------------------------------------------------------------- the three measurements
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def one_best(runs: dict[str, dict[str, Any]], phases: list[str]) -> list[str]:
    """The fixed responses within the phase bar of the best one's P99 TTFT in every phase of one seed's
    runs. A choice made per phase among them is at best one of these in each phase, so where this is
    not empty the trace did not change regime for that seed, and the whole-trace bar asks auto to beat
    a response that was already (near) the best everywhere."""
    def p99(s: str, ph: str) -> float:
        return runs[s]["phases"][ph]["ttft_p99_ms"] or float("inf")
    best = {ph: min(p99(s, ph) for s in runs) for ph in phases}
    return [s for s in runs if all(p99(s, ph) <= PHASE_BAR * best[ph] for ph in phases)]


def hindsight_schedules(judged: dict[str, Any], phases: list[str]) -> list[tuple[str, ...]]:
    """Per seed, each phase's best fixed response as :func:`judge_trace` found it: the hindsight bound's
    schedule."""
    per = [judged["phases"][ph]["per_seed"] for ph in phases]
    return [tuple(p[k]["best_fixed"] for p in per) for k in range(len(per[0]))]


def judge_trace(runs: dict[str, list[dict[str, Any]]], phases: list[str]) -> dict[str, Any]:
    """Per seed: per phase auto's P99 TTFT over the best fixed one's, over the trace each fixed over auto."""
    seeds = len(runs["auto"])
    out: dict[str, Any] = {"phases": {}, "whole": {}}
    for ph in phases:
        per_seed = []
        for k in range(seeds):
            p99 = {s: runs[s][k]["phases"][ph]["ttft_p99_ms"] for s in runs}
            best = min(AR.FIXED, key=lambda s: p99[s] if p99[s] is not None else float("inf"))
            per_seed.append({"best_fixed": best, "auto_over_best": _ratio(p99["auto"], p99[best])})
        oks = [r["auto_over_best"] is not None and r["auto_over_best"] <= PHASE_BAR for r in per_seed]
        out["phases"][ph] = {"per_seed": per_seed, "verdict": verdict(oks),
                             "claim": f"auto's P99 TTFT within {PHASE_BAR - 1:.0%} of the best fixed response's"}
    for s in AR.FIXED:
        ratios = [_ratio(runs[s][k]["whole"]["ttft_p99_ms"], runs["auto"][k]["whole"]["ttft_p99_ms"])
                  for k in range(seeds)]
        out["whole"][s] = {"per_seed": ratios, "verdict": verdict([r is not None and r >= TRACE_BAR for r in ratios]),
                           "claim": f"{s}'s P99 TTFT over auto's >= {TRACE_BAR}x"}
    out["one_best"] = [one_best({s: runs[s][k] for s in AR.FIXED}, phases) for k in range(seeds)]
    lost = {s: [r["whole"]["lost"] for r in runs[s]] for s in runs}
    out["lost"] = lost
    out["no_loss"] = verdict([x == 0 for x in lost["auto"]])
    return out


def judge_paper(runs: dict[str, list[dict[str, Any]]], technique: str, baseline: str, key: str,
                higher_better: bool) -> dict[str, Any]:
    """Per seed: where the paper's technique beats its baseline, auto within 5 % of the technique; where
    it does not, auto no more than 5 % worse than the baseline."""
    per_seed, oks = [], []
    for k in range(len(runs["auto"])):
        a, t, b = (runs[s][k][key] for s in ("auto", technique, baseline))
        if None in (a, t, b):
            per_seed.append(None)
            oks.append(False)
            continue
        wins = t > b if higher_better else t < b
        ref = t if wins else b
        r = (a / ref) if higher_better else (ref / a)  # >= 1: auto as good as the reference or better
        per_seed.append({"technique_wins": wins, "against": technique if wins else baseline, "auto_vs": r})
        oks.append(r >= 1 / PAPER_BAR)
    return {"per_seed": per_seed, "verdict": verdict(oks), "metric": key,
            "claim": f"auto within {PAPER_BAR - 1:.0%} of {technique} where {technique} beats {baseline}, "
                     f"else within {PAPER_BAR - 1:.0%} of {baseline}"}


def run_experiment(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from tidal.sim.models import get_model

    max_len = get_model(AR.MODEL).max_position_embeddings
    seeds = list(range(args.seeds))
    res: dict[str, Any] = {"setup": {"model": AR.MODEL, "hardware": AR.HARDWARE, "instances": AR.INSTANCES,
                                     "link": AR.LINK, "router": AR.ROUTER, "slo": AR.SLO_DEF.to_ms(),
                                     "max_num_batched_tokens": AR.MAX_NUM_BATCHED_TOKENS,
                                     "systems": {k: v["label"] for k, v in AR.SYSTEMS.items()}, "seeds": seeds,
                                     "ablations": {a: AR.SYSTEMS[a]["why"] for a in AR.ABLATIONS},
                                     "bounds": {b: {"label": v["label"], "why": v["why"]} for b, v in AR.BOUNDS.items()},
                                     "share": SHARE, "sensitivity": SENSITIVITY, "phase_duration_s": args.phase_duration,
                                     "sources": AT.SOURCES}}
    if "trace" in args.parts:
        log("the regime trace: each phase's rate by the 60 % rule on recompute")
        found = run_all(phase_search, [(ph, args.phase_duration, max_len, args.traces_dir, args.probes)
                                       for ph in AT.PHASES], args.jobs)
        rates = {ph: f["rate"] for ph, f in zip(AT.PHASES, found, strict=True)}
        res["trace"] = {"phases": list(AT.PHASES), "search": dict(zip(AT.PHASES, found, strict=True)), "levels": {}}
        for level, scale in (("paper rule", 1.0), (f"{SENSITIVITY}x", SENSITIVITY)):
            lr = {ph: r * scale for ph, r in rates.items()}
            log(f"{level}: rates " + ", ".join(f"{ph} {r:.3g}" for ph, r in lr.items()) + " req/s")
            calls = [(s, lr, args.phase_duration, seed, max_len, args.traces_dir) for seed in seeds for s in AR.SYSTEMS]
            outs = run_all(trace_run, calls, args.jobs)
            runs = {s: [o for (sy, *_), o in zip(calls, outs, strict=True) if sy == s] for s in AR.SYSTEMS}
            fixed = {s: runs[s] for s in AR.FIXED}
            lv = {"rates": lr, "runs": runs, "judged": judge_trace(runs, list(AT.PHASES)),
                  "ablations": {a: judge_trace({**fixed, "auto": runs[a]}, list(AT.PHASES)) for a in AR.ABLATIONS}}
            log(f"{level}: the hindsight bound (each phase's best fixed response, pinned)")
            schedules = hindsight_schedules(lv["judged"], list(AT.PHASES))
            bound = run_all(trace_run, [("hindsight", lr, args.phase_duration, seed, max_len, args.traces_dir, sch)
                                        for seed, sch in zip(seeds, schedules, strict=True)], args.jobs)
            lv["bounds"] = {"hindsight": {"schedules": [list(x) for x in schedules], "runs": bound,
                                          "judged": judge_trace({**fixed, "auto": bound}, list(AT.PHASES))}}
            res["trace"]["levels"][level] = lv
    if "kunserve" in args.parts:
        log("KunServe's setup: each dataset's rate by the 60 % rule on recompute")
        datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
        found = run_all(dataset_search, [(d, args.dataset_duration, args.probes) for d in datasets], args.jobs)
        calls = [(s, d, f["rate"], args.dataset_duration, seed) for d, f in zip(datasets, found, strict=True)
                 for seed in seeds for s in AR.SYSTEMS]
        outs = run_all(dataset_run, calls, args.jobs)
        res["kunserve"] = {}
        for d, f in zip(datasets, found, strict=True):
            runs = {s: [o["whole"] | {"choice_counts": o.get("choice_counts")}
                        | {k: o[k] for k in ("groups", "span_s", "limits") if k in o}  # what the page's why reads
                        for (sy, dd, *_), o in zip(calls, outs, strict=True) if sy == s and dd == d]
                    for s in AR.SYSTEMS}
            res["kunserve"][d] = {"search": f, "rate": f["rate"], "runs": runs,
                                  "judged": judge_paper(runs, "drop", "recompute", "ttft_p99_ms", False),
                                  "ablations": {a: judge_paper({**runs, "auto": runs[a]}, "drop", "recompute",
                                                               "ttft_p99_ms", False) for a in AR.ABLATIONS}}
    if "pang" in args.parts:
        log("Pang et al.'s setup: capacity at 90 % attainment, 50 ms TPOT")
        calls = [(lab, pol, args.pang_requests, seed) for lab in ("out-61", "out-447") for seed in seeds
                 for pol in PANG_POLICIES]
        outs = run_all(pang_run, calls, args.jobs)
        res["pang"] = {}
        for lab in ("out-61", "out-447"):
            runs = {p: [o for (lb, pol, *_), o in zip(calls, outs, strict=True) if lb == lab and pol == p]
                    for p in PANG_POLICIES}
            res["pang"][lab] = {"runs": runs, "judged": judge_paper(
                {"auto": runs["auto"], "memory+sla": runs["memory+sla"], "static": runs["static (fixed cap 256)"]},
                "memory+sla", "static", "capacity_rps", True)}
    if args.real:
        from tidal.experiments.auto_real import real_run

        log("the real engine: 2 CPU workers, small pools, a burst")
        res["real"] = real_run()
    return res


# ---------------------------------------------------------------- command line
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-auto", help="--kv-pressure auto and --batching auto against the fixed choices, simulated",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="trace,kunserve,pang", help="of trace, kunserve, pang")
    p.add_argument("--seeds", type=F.positive_int, default=3, help="seeds per claim (trace windows and draws)")
    p.add_argument("--phase-duration", type=F.positive_float, default=150.0, help="seconds of arrivals per phase")
    p.add_argument("--dataset-duration", type=F.positive_float, default=200.0,
                   help="seconds of arrivals per KunServe dataset")
    p.add_argument("--datasets", default="burstgpt,sharegpt,longbench", help="KunServe's datasets")
    p.add_argument("--pang-requests", type=F.positive_int, default=1000, help="requests per capacity probe (Pang)")
    p.add_argument("--probes", type=F.positive_int, default=AT.SEARCH_PROBES, help="runs per rate search")
    p.add_argument("--traces-dir", default=None, help="the shared traces (default: ../shared/traces)")
    p.add_argument("--real", action="store_true", help="also run the real engine (2 CPU workers, a burst)")
    p.add_argument("--jobs", type=F.positive_int, default=1,
                   help=f"simulator runs at once, each a process of its own (this machine: {usable_cores()} cores)")
    p.add_argument("--output", default="docs/results/auto", help="folder for auto_sim.json and the PNGs")
    p.add_argument("--page", default=None, help="also write the generated page here (docs/auto.md)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: write the figures (and --page) from --output's auto_sim.json")
    p.add_argument("--all-schedules", action="store_true",
                   help="run every schedule of the fixed responses over the phases, pinned, on --output's "
                        "auto_sim.json trace (a bound; writes auto_schedules.json and, with --page, the page)")
    p.add_argument("--schedule-levels", default=None, help="--all-schedules: the levels (default: every level)")
    p.add_argument("--schedule-seeds", type=F.positive_int, default=None,
                   help="--all-schedules: the run's first this many seeds (default: all); the level-seed pairs an "
                        "auto_schedules.json of the same trace in --output holds are read from it, not run again")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = [x for x in args.parts if x not in ("trace", "kunserve", "pang")]
    if bad or not args.parts:
        print(f"{PROG}: error: --parts takes trace, kunserve, pang; got {args.parts}", file=sys.stderr)
        return 2
    path = os.path.join(args.output, "auto_sim.json")
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not args.no_progress:
            print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    if args.replot or args.all_schedules:
        flag = "--replot" if args.replot else "--all-schedules"
        if not os.path.isfile(path):
            print(f"{PROG}: error: {flag} reads {path}, which does not exist", file=sys.stderr)
            return 2
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        if args.all_schedules:
            return _all_schedules(res, args, path, t0, log)
        return _write(res, args, path)

    command = command_line(PROG)
    print(f"command: {command}")
    try:
        res = run_experiment(args, log)
    except AT.TraceError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    res.update(command=command, machine=machine_info(), wall_time_s=time.perf_counter() - t0)
    os.makedirs(args.output, exist_ok=True)
    write_json(res, path)
    return _write(res, args, path)


def _all_schedules(res: dict[str, Any], args: argparse.Namespace, path: str, t0: float, log: Any) -> int:
    from tidal.experiments import auto_schedules as S

    if not res.get("trace"):
        print(f"{PROG}: error: --all-schedules needs the trace part in {path}", file=sys.stderr)
        return 2
    levels = ([x.strip() for x in args.schedule_levels.split(",") if x.strip()] if args.schedule_levels
              else list(res["trace"]["levels"]))
    command = command_line(PROG)
    print(f"command: {command}")
    previous = S.read(res, args.output)[0]  # a run on this trace already: its level-seed pairs are read, not run
    try:
        out = S.run_schedules(res, levels, args.schedule_seeds or len(res["setup"]["seeds"]), args.jobs,
                              args.traces_dir, log, previous)
    except (ValueError, AT.TraceError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    before = previous.get("wall_time_s", 0.0) + previous.get("wall_time_before_s", 0.0) if previous else 0.0
    out.update(command=command, machine=machine_info(), wall_time_s=time.perf_counter() - t0,
               wall_time_before_s=before if out["read_back"] else 0.0)
    write_json(out, os.path.join(args.output, S.FILE))
    return _write(res, args, path)


def _write(res: dict[str, Any], args: argparse.Namespace, path: str) -> int:
    from tidal.experiments.auto_page import summary_lines, write_page, write_plots
    from tidal.experiments.auto_schedules import FILE, read

    got, other = read(res, os.path.dirname(path))  # --all-schedules' runs on this trace, read beside it
    if got is not None:
        res = {**res, "schedules": got}
    elif other:
        print(f"{PROG}: {os.path.join(os.path.dirname(path), FILE)} was run on another trace than {path}: left off "
              "the page (run --all-schedules again)", file=sys.stderr)
    figures = write_plots(res, args.output)
    if args.page:
        write_page(res, args.page, figures)
    print("\n".join(summary_lines(res)))
    print(f"wall time {res['wall_time_s']:.0f} s; wrote {path}" + (f" and {args.page}" if args.page else ""))
    return 0


__all__ = ["add_parser", "hindsight_schedules", "judge_paper", "judge_trace", "run", "run_experiment", "verdict"]
