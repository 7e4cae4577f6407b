"""``tidal bench sim-kunserve``: KunServe's evaluation (Sec. 5.1-5.5, Fig. 13-16) in the simulator:
P50/P99 TTFT and TPOT of vLLM (recompute), vLLM + PP, InferCept-like swapping, Llumnix-like
migration and KunServe's drop, with the ablations and sensitivity rows beside them
(:mod:`tidal.experiments.kunserve_runs`), on several seeds (arrival draws).

The regime is the paper's (:mod:`tidal.experiments.kunserve_regime`): the default pool (0.9 of each
GPU) and the highest mean rate whose vLLM run keeps its time-mean KV demand at or under 60 % of
the pool (searched over the seeds' draws, printed), with the compute capacity measured beside it.
``--shrunken-pool`` adds the regime tidal ran before as a sensitivity block (bursts within 85 % of
the capacity, a pool of 2x vLLM's mean KV in use). Also: the SLO-violation curves of Fig. 13
(:mod:`tidal.experiments.kunserve_slo`), the pipeline stage gap calibrated to Sec. 5.3's bubbles
(:mod:`tidal.experiments.kunserve_pipeline_fit`), and with ``--cluster b`` (Qwen-2.5-72B, TP 4 on
H800s) the extreme burst of Fig. 16 (:mod:`tidal.experiments.kunserve_extreme`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

from tidal.common import flags as F
from tidal.common.machine import machine_info, usable_cores
from tidal.common.results import command_line, write_result
from tidal.experiments import kunserve_extreme as X
from tidal.experiments import kunserve_pipeline_fit as PF
from tidal.experiments import kunserve_regime as R
from tidal.experiments import kunserve_timelines as TL
from tidal.experiments.kunserve_regime import BURSTINESS, RATE_SHAPE, WINDOW_S, bursty_arrivals
from tidal.experiments.kunserve_runs import (
    BASELINES,
    CALIBRATED,
    CLUSTERS,
    DATASETS,
    DROP,
    GPU_MEMORY_UTILIZATION,
    GROUP_RULE,
    LOOKAHEAD_OFF,
    MIGRATE,
    SWAP,
    SYSTEMS,
    VLLM,
    VLLM_PP,
    default_blocks,
    pool_memory,
    probe_timelines,
    simulate,
    workload,
)

PROG = "tidal bench sim-kunserve"
KEYS = {"vllm": VLLM, "vllm-pp": VLLM_PP, "swap": SWAP, "migrate": MIGRATE, "drop": DROP, "no-lookahead": LOOKAHEAD_OFF,
        "group-dispatch": GROUP_RULE, "calibrated": CALIBRATED}
DEFAULT_KEYS = {"a": ",".join(KEYS), "b": "vllm,vllm-pp,swap,migrate,drop"}  # b: the paper's 72B comparison
SHRUNKEN = (VLLM, SWAP, MIGRATE, DROP)  # the systems that regime ran before
PAPER = ("KunServe: 12.7-72.2x lower P99 TTFT than vLLM, InferCept and Llumnix on BurstGPT, ShareGPT and "
         "LongBench with Qwen-2.5-14B (Sec. 5.2, Fig. 13); Qwen-2.5-72B on LongBench: 8.4-11.9x at an 18.3-22.7 % "
         "TPOT cost; 7.2-12.8 % fewer SLO violations on average; 1.5x longer under an extreme burst (Fig. 16)")


# ---------------------------------------------------------------- the runs (module level: they go to --jobs processes)
def _arrivals(ds: str, duration: float, rate: float, seed: int, arrivals: str, trace: str | None,
              extreme_s: float | None = None) -> tuple[list[Any], float | None]:
    if extreme_s is None:
        return workload(ds, duration, rate, seed, arrivals, trace), None
    times = R.arrivals(arrivals, np.random.default_rng(seed), duration, rate, trace)
    ext, start = X.extreme_times(times, duration, extreme_s)
    return workload(ds, duration, rate, seed, times=ext), start


def demand_run(cluster: str, ds: str, duration: float, rate: float, seed: int, arrivals: str,
               trace: str | None) -> dict[str, float]:
    """One probe of the demand search: vLLM at the default pool; its time-mean KV demand over the arrivals."""
    out = simulate(cluster, SYSTEMS[VLLM], _arrivals(ds, duration, rate, seed, arrivals, trace)[0], duration / 400,
                   demand_until=duration)
    return {"mean_kv_demand": out["mean_kv_demand"], "mean_kv_use": out["mean_kv_use"],
            "ttft_p99_ms": out["ttft_ms"]["p99"], "tpot_p50_ms": out["tpot_ms"]["p50"]}


def capacity_run(cluster: str, ds: str, seed: int, router: str, duration: float, probes: int) -> dict[str, Any]:
    """The compute capacity (an unlimited pool, steady arrivals; :func:`tidal.experiments.kunserve_regime.probe_capacity`)."""
    return R.probe_capacity(lambda r, d: probe_timelines(cluster, ds, seed, router, r, d),
                            CLUSTERS[cluster].initial_rate[ds], duration, probes)


def system_run(cluster: str, ds: str, duration: float, rate: float, seed: int, arrivals: str, trace: str | None,
               label: str, num_blocks: int | None = None, stage_gap_s: float = 0.0,
               extreme_s: float | None = None) -> dict[str, Any]:
    """One run of ``label``; ``extreme_s``: Fig. 16's arrivals (the first burst replayed for so long), cut
    ``DRAIN_S`` after them."""
    specs, start = _arrivals(ds, duration, rate, seed, arrivals, trace, extreme_s)
    until = extreme_s + (start or 0.0) + X.DRAIN_S if extreme_s is not None else None
    out = simulate(cluster, SYSTEMS[label], specs, duration / 400, num_blocks=num_blocks, stage_gap_s=stage_gap_s,
                   until=until, demand_until=duration)
    out["burst_start_s"] = start
    return out


# ---------------------------------------------------------------- the command
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-kunserve", help="KunServe vs vLLM (+PP), swap, migrate at the paper's scale, simulated",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="a", choices=list(CLUSTERS),
                   help="a: Qwen-2.5-14B on 8 x A800 (Sec. 5.2's main runs); b: Qwen-2.5-72B, TP 4, on 16 H800 "
                        "(its multi-GPU runs and Fig. 16)")
    p.add_argument("--datasets", default=None, help=f"of {', '.join(DATASETS)} (default: all with --cluster a, "
                                                    "longbench with b, the paper's)")
    p.add_argument("--systems", default=None, help=f"of {', '.join(KEYS)} (default: all with --cluster a; "
                                                   f"{DEFAULT_KEYS['b']} with b)")
    p.add_argument("--seeds", default="0,1,2", help="arrival draws, each a run of every system (comma list)")
    p.add_argument("--duration", type=F.positive_float, default=300.0, help="seconds of arrivals")
    p.add_argument("--rate", type=F.positive_float, default=None,
                   help="mean request rate (default: the highest whose vLLM run keeps the time-mean KV demand at "
                        f"or under {R.DEMAND_SHARE:.0%} of the pool, searched)")
    p.add_argument("--search-probes", type=F.positive_int, default=R.SEARCH_PROBES, help="demand-search runs at most")
    p.add_argument("--search-tolerance", type=F.positive_float, default=R.SEARCH_TOLERANCE,
                   help="the demand search stops when its bracket is this narrow (relative)")
    p.add_argument("--arrivals", default="gamma", choices=list(R.ARRIVALS),
                   help="gamma: a Gamma process modulated per 20 s window by Gamma(2) (BurstGPT-like); azure: the "
                        "Azure conversation hour's real arrival times rescaled to the mean rate")
    p.add_argument("--azure-trace", default=None,
                   help=f"the Azure conversation trace for --arrivals azure (default: ${R.AZURE_ENV}, else the "
                        "shared traces folder's azure2023_conv.csv)")
    p.add_argument("--probe-duration", type=F.positive_float, default=R.PROBE_DURATION_S,
                   help="seconds of steady arrivals per compute-capacity probe run")
    p.add_argument("--probes", type=F.positive_int, default=R.PROBES, help="compute-capacity probe runs per dataset")
    p.add_argument("--shrunken-pool", action=argparse.BooleanOptionalAction, default=None,
                   help="also the sensitivity block at tidal's former regime (a pool of 2x vLLM's mean KV in use; "
                        "default: on with --cluster a)")
    p.add_argument("--extreme-burst", action=argparse.BooleanOptionalAction, default=None,
                   help="also Fig. 16's extreme burst, vLLM against KunServe (default: on with --cluster b)")
    p.add_argument("--extreme-s", type=F.positive_float, default=X.EXTREME_S,
                   help="seconds of the replayed burst in the --extreme-burst runs")
    p.add_argument("--fit-gaps", default=None,
                   help="stage gaps (ms) the pipeline-cost fit tries (default: "
                        f"{','.join(f'{g * 1000:g}' for g in PF.GAP_GRID_S)})")
    p.add_argument("--jobs", type=F.positive_int, default=1,
                   help=f"simulator runs at once, each a process of its own (this machine: {usable_cores()} cores)")
    F.add_output_flags(p, "results/sim_kunserve.json")
    p.set_defaults(func=run)


def _parse(args: argparse.Namespace) -> tuple[list[str], list[str], list[int], list[float]]:
    names = [d.strip() for d in (args.datasets or ("burstgpt,sharegpt,longbench" if args.cluster == "a"
                                                   else "longbench")).split(",") if d.strip()]
    bad = [d for d in names if d not in DATASETS]
    if bad:
        raise ValueError(f"unknown dataset {bad[0]!r}; available: {', '.join(DATASETS)}")
    keys = [k.strip() for k in (args.systems or DEFAULT_KEYS[args.cluster]).split(",") if k.strip()]
    bad = [k for k in keys if k not in KEYS]
    if bad:
        raise ValueError(f"unknown system {bad[0]!r}; available: {', '.join(KEYS)}")
    if "vllm" not in keys or "drop" not in keys:
        raise ValueError("--systems needs vllm and drop (the ratios and the search are theirs)")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        gaps = [float(g) / 1000 for g in (args.fit_gaps.split(",") if args.fit_gaps else [])] or list(PF.GAP_GRID_S)
    except ValueError:
        raise ValueError("--seeds and --fit-gaps take comma lists of numbers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError("--seeds needs distinct seeds")
    if any(g < 0 for g in gaps):
        raise ValueError("--fit-gaps must be >= 0")
    return names, [KEYS[k] for k in keys], seeds, gaps


def run(args: argparse.Namespace) -> int:
    try:
        names, labels, seeds, gaps = _parse(args)
        if args.arrivals == "azure":
            args.azure_trace = R.azure_trace_path(args.azure_trace)
    except (ValueError, R.RegimeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not args.no_progress:
            print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    command = command_line(PROG)
    print(f"command: {command}")
    c = CLUSTERS[args.cluster]
    shrunken = args.cluster == "a" if args.shrunken_pool is None else args.shrunken_pool
    extreme = args.cluster == "b" if args.extreme_burst is None else args.extreme_burst
    report: dict[str, Any] = {
        "command": command, "machine": machine_info(), "paper": PAPER,
        "setup": {"cluster": c.name, "cluster_note": c.note, "model": c.model, "hardware": c.hardware,
                  "instances": c.instances, "tp": c.tp, "link": c.link, "router": "llumnix",
                  "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "seeds": seeds, "duration_s": args.duration,
                  "arrivals": (f"Gamma(burstiness {BURSTINESS}), rate x Gamma({RATE_SHAPE}) per {WINDOW_S:g} s window"
                               if args.arrivals == "gamma" else "the Azure conversation hour's arrival times, rescaled"),
                  "arrival_kind": args.arrivals, "systems": {k: SYSTEMS[k]["role"] for k in labels}},
        "datasets": {}}
    from tidal.experiments import kunserve_bench as KB

    try:
        KB.execute(args, report, names, labels, seeds, gaps, shrunken, extreme, log)
    except R.RegimeError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    report["wall_time_s"] = time.perf_counter() - t0
    timelines = TL.write_timelines(KB.seed0_view(report), os.path.splitext(args.output)[0] + "_timelines.json")
    from tidal.experiments import kunserve_plots as KP

    plots = write_result(KB.slim(report) | {"timelines_json": os.path.basename(timelines)}, args.output,
                         not args.no_plots, plotter=lambda r, p: KP.plots(report, p), prog=PROG)
    KB.print_tables(report)
    print(f"\n{PAPER}")
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {args.output}, {timelines}"
          + (f" and {len(plots)} figures" if plots else ""))
    return 0


__all__ = ["BASELINES", "KEYS", "PAPER", "SHRUNKEN", "add_parser", "bursty_arrivals", "capacity_run", "default_blocks",
           "demand_run", "pool_memory", "run", "system_run", "workload"]
