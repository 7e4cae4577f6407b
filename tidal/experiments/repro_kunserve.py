"""KunServe (Sec. 5.1-5.5, Fig. 13-16) in the simulator: P99 TTFT and TPOT of dropping layers
(KunServe) against vLLM (recompute), vLLM + PP, InferCept-like swapping and Llumnix-like migration
under BurstGPT-like bursts, in the paper's regime (the default pool, the rate by its 60 % rule),
each claim judged on several seeds (:func:`tidal.experiments.reproduce.judge`).

It runs :mod:`tidal.experiments.sim_kunserve` (``tidal bench sim-kunserve``) twice: cluster A
(Qwen-2.5-14B on 8 A800s; BurstGPT, ShareGPT, LongBench; the ablations, the calibrated pipeline
cost and the shrunken pool as labelled rows; ``kunserve_sim.json``) and cluster B (Qwen-2.5-72B at
TP 4 on H800s, LongBench, with Fig. 16's extreme burst; ``kunserve_sim_72b.json``), and reads the
claims off their JSON. ``--quick``: cluster A only, LongBench-like lengths, 60 s of arrivals,
vLLM / KunServe / KunServe w/o lookahead, a short search and capacity probe; ``--reuse-sim``
reads the two JSON already in ``--output`` instead. The real column: the same policies on 2 CPU
instances on several seeds, run without ``--quick`` or read from ``--real-json`` (a recorded
``kunserve_real.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from tidal.common.machine import usable_cores
from tidal.common.results import write_json
from tidal.experiments import kunserve_claims as C
from tidal.experiments import sim_kunserve as K
from tidal.experiments.reproduce import Progress, Report, all_reused, run_or_reuse, runs_real

FIGURES = ("", "_search", "_slo", "_pipeline_fit", "_extreme")  # the page shows these of each bench run


def _bench_argv(args: argparse.Namespace, cluster: str) -> list[str]:
    argv = ["bench", "sim-kunserve", "--cluster", cluster]
    if args.no_progress:  # otherwise the bench's own lines (one per run) show the progress
        argv.append("--no-progress")
    if args.no_plots:
        argv.append("--no-plots")
    if args.quick:
        argv += ["--datasets", "longbench", "--duration", "60", "--probe-duration", "20", "--probes", "2",
                 "--search-probes", "2", "--systems", "vllm,drop,no-lookahead", "--no-shrunken-pool"]
    else:  # the full run's simulator runs on every core
        argv += ["--jobs", str(usable_cores())]
    return argv


def _figures(data: dict[str, Any]) -> list[str]:
    """The bench run's main figures, and the per-instance timelines of vLLM and KunServe."""
    names = [os.path.basename(p) for p in data.get("plots", [])]
    stem = os.path.splitext(os.path.basename(names[0]))[0] if names else ""
    keep = {f"{stem}{s}.png" for s in FIGURES}
    return [n for n in names if n in keep] + [n for n in names if n.endswith(("_vllm-preempt-recompute_instances.png",
                                                                             "_kunserve-drop_instances.png"))]


def reproduce(args: argparse.Namespace, log: Progress) -> Report:
    names = ("kunserve_sim.json",) if args.quick else ("kunserve_sim.json", "kunserve_sim_72b.json")
    reused = all_reused(args, names)
    a = run_or_reuse(args, K.add_parser, _bench_argv(args, "a"), os.path.join(args.output, names[0]), log)
    b = None if args.quick else run_or_reuse(args, K.add_parser, _bench_argv(args, "b"),
                                             os.path.join(args.output, names[1]), log)
    report = Report("kunserve", "KunServe: drop layers instead of preempting under memory pressure (Fig. 13-16)",
                    C.setup_text(a, b), args.quick, data={"sim": _slim(a), "sim_72b": _slim(b) if b else None},
                    figures=_figures(a) + (_figures(b) if b else []), reused_sim=reused)
    real = _real(args, log)
    if real is not None and not args.no_plots:
        from tidal.experiments.kunserve_plots import plot_real

        report.figures.append(os.path.basename(plot_real(real, os.path.join(args.output, "kunserve_real.png"))))
    if real is not None:
        report.data["real"] = real
        source = f"{real['source']}; " if real.get("source") else ""
        report.setup += (f" Real column: recorded by `{real['command']}` ({source}read from "
                         f"`{os.path.basename(args.real_json)}`)." if getattr(args, "real_json", None) else
                         " Real column: run by this command (its record: `kunserve_real.json`).")
    for ds, d in a["datasets"].items():
        report.claims += C.dataset_claims("14B", ds, d, real)
    if b:
        for ds, d in b["datasets"].items():
            report.claims += C.dataset_claims("72B", ds, d, None)
        if b.get("extreme_burst"):
            report.claims += C.extreme_claims(b["extreme_burst"])
    report.data["readme_line"] = C.readme_line(report.claims, a, b, real)
    return report


def _real(args: argparse.Namespace, log: Progress) -> dict[str, Any] | None:
    """The real runs: read from ``--real-json``, or run here (full run, not ``--no-real``)."""
    from tidal.experiments import kunserve_real as R

    recorded = getattr(args, "real_json", None)
    if recorded:
        with open(recorded) as f:
            return R.check_record(json.load(f), recorded)
    if not runs_real(args):
        return None
    from tidal.common.machine import machine_info
    from tidal.common.results import command_line

    out, command, info = os.path.join(args.output, "kunserve_real.json"), command_line("tidal reproduce"), machine_info()
    with tempfile.TemporaryDirectory(prefix="tidal-kunserve-real-") as tmp:  # each run's records: not kept
        # the memory-bound regime first: the capacity probe, the rate under it, the pool from the mean in use
        setup, regime = R.resolve(R.RealSetup(), os.path.join(tmp, "run"), log)
        rows = R.run(list(R.SYSTEMS), setup, os.path.join(tmp, "run"), log,
                     on_row=lambda rows: write_json(R.record(command, setup, regime, rows, False, info), out))
    real = R.record(command, setup, regime, rows, True, info)
    write_json(real, out)
    return real


def _slim(data: dict[str, Any]) -> dict[str, Any]:
    """The numbers the table uses (the bench's own JSON, next to this one, has the rest)."""
    keep = ("ttft_ms", "tpot_ms", "num_preemptions", "bubble_ratio", "completed", "failed", "lost", "mean_kv_demand",
            "participation")
    out = {"setup": data["setup"], "pipeline_fit": data.get("pipeline_fit"), "datasets": {}}
    for ds, d in data["datasets"].items():
        out["datasets"][ds] = {
            "rate": d["rate"], "seeds": d["seeds"], "num_requests": d["num_requests"], "ratios": d["ratios"],
            "regime": {k: v for k, v in d["regime"].items() if k != "search"} | {
                "search": {k: v for k, v in (d["regime"].get("search") or {}).items() if k != "probes"}},
            "systems": {k: {"role": v["role"], "median": v["median"],
                            "per_seed": [{kk: r.get(kk) for kk in keep} for r in v["per_seed"]]}
                        for k, v in d["systems"].items()},
            "slo": {k: v for k, v in (d.get("slo") or {}).items() if k != "per_seed"},
            "shrunken_pool": {"regime": d["shrunken_pool"]["regime"], "ratios": d["shrunken_pool"]["ratios"]}
            if "shrunken_pool" in d else None}
    if data.get("extreme_burst"):
        out["extreme_burst"] = {**data["extreme_burst"], "per_seed": [
            {k: v for k, v in e.items() if k != "runs"} for e in data["extreme_burst"]["per_seed"]]}
    return out


__all__ = ["reproduce"]
