"""``tidal bench sim-kunserve``: KunServe's end-to-end comparison (Sec. 5.1-5.2, Fig. 13) in the
simulator: P50/P99 TTFT and TPOT of ``preempt`` (vLLM: recompute), ``preempt`` with swap
(InferCept-like), ``migrate`` (Llumnix-like) and ``drop`` (KunServe).

The paper's setup (Sec. 5.1, Table 2, cluster A): Qwen-2.5-14B, 8 instances of one A800-80GB
each (``a800-80g``), 200 Gbps RDMA between servers (``ib-hdr``); the dispatcher is Llumnix's load
balancing for every system (``llumnix``: free KV blocks per outstanding request; KunServe Sec. 3:
"our dispatcher incorporates the load-balancing design from Llumnix"). ``kv-aware`` (the most
free blocks) is kept as an option: it sends a merged group, whose pool grew by the weights it
dropped but whose compute did not, more than it can prefill. Arrivals are BurstGPT-like: the trace
itself is not here, so a Gamma process (burstiness 0.5, BurstGPT's shape in
:mod:`tidal.workload`) whose rate is modulated per 20 s window by a Gamma(2) factor (mean 1),
which gives the trace's bursts of ~2x that throttle memory (Fig. 2a). The mean rate is scaled,
as the paper scales BurstGPT, so that the *average* KV demand -- in use plus queued, Llumnix's
count (Sec. 2.2) -- of vLLM (``preempt``) over the run is about 50%, below 60% (Sec. 5.1).
Lengths: BurstGPT-like (642 / 262, lognormal), ShareGPT (the real length set, inputs capped at
4K as in the paper) and LongBench-like (5.9K / 499, lognormal, capped at 16K).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import numpy as np

from tidal.common import flags as F
from tidal.common.machine import machine_info, usable_cores
from tidal.common.results import command_line, write_result
from tidal.experiments.parallel import run_all
from tidal.metrics import summarize

PROG = "tidal bench sim-kunserve"
MODEL, HARDWARE, INSTANCES, LINK = "qwen-2.5-14b", "a800-80g", 8, "ib-hdr"
MAX_NUM_SEQS = 1024  # above what the KV holds for these lengths (vLLM's 256 caps BurstGPT-like batches before the
#                     memory does: KunServe's gain is a larger batch in the grown pool, Sec. 5.2)
MAX_NUM_BATCHED_TOKENS = 2048  # chunked prefill's step budget (Sarathi-Serve; vLLM's 512 starves prefills under load)
SWAP_SPACE = 64 * 1024**3  # host memory per instance for InferCept-like swapping
WINDOW_S, RATE_SHAPE, BURSTINESS = 20.0, 2.0, 0.5
TARGET_DEMAND = 0.5
PROBES = 6
INITIAL_RATE = {"burstgpt": 60.0, "sharegpt": 16.0, "longbench": 5.0}  # req/s, 8 instances
SYSTEMS: dict[str, dict[str, Any]] = {
    "vLLM (preempt: recompute)": {"kv_pressure": "preempt", "preemption_mode": "recompute"},
    "InferCept-like (preempt: swap)": {"kv_pressure": "preempt", "preemption_mode": "swap"},
    "Llumnix-like (migrate)": {"kv_pressure": "migrate", "preemption_mode": "recompute"},
    "KunServe (drop)": {"kv_pressure": "drop", "preemption_mode": "recompute"},
    # Sec. 5.3's ablation: token-count microbatches instead of the lookahead (not a baseline of the ratios)
    "KunServe w/o lookahead": {"kv_pressure": "drop", "preemption_mode": "recompute", "lookahead": False},
}
BASELINES = ("vLLM (preempt: recompute)", "InferCept-like (preempt: swap)", "Llumnix-like (migrate)")
DATASETS = {  # name -> (tidal.workload name, input cap)
    "burstgpt": ("burstgpt", 16384),
    "sharegpt": ("sharegpt-lengths", 4096),
    "longbench": ("longbench", 16384),
}
PAPER = ("KunServe: 12.7-72.2x lower P99 TTFT than vLLM, InferCept and Llumnix on BurstGPT, ShareGPT and "
         "LongBench with Qwen-2.5-14B (Sec. 5.2, Fig. 13); 'up to 72.2x' in the abstract")


def bursty_arrivals(rng: np.random.Generator, duration_s: float, rate: float) -> np.ndarray:
    """A Gamma process (shape ``BURSTINESS``) whose rate is ``rate`` times a Gamma(``RATE_SHAPE``)
    factor of mean 1, drawn per ``WINDOW_S`` window (the rate pattern is the same at any ``rate``:
    the factors are drawn first)."""
    windows = math.ceil(duration_s / WINDOW_S)
    factors = rng.gamma(RATE_SHAPE, 1.0 / RATE_SHAPE, size=windows)
    gaps = rng.gamma(BURSTINESS, 1.0 / BURSTINESS, size=int(duration_s * rate * 4) + 64)  # unit-rate gaps
    out, t, k = [], 0.0, 0
    while k < len(gaps):  # time runs at the window's rate: a unit gap lasts 1 / (rate * factor) s
        w = int(t // WINDOW_S)
        if w >= windows:
            break
        r = rate * max(factors[w], 1e-3)
        step = gaps[k] / r
        if t + step > (w + 1) * WINDOW_S:  # the gap crosses into the next window: spend the rest there
            gaps[k] -= ((w + 1) * WINDOW_S - t) * r
            t = (w + 1) * WINDOW_S
            continue
        t += step
        k += 1
        if t < duration_s:
            out.append(t)
    return np.asarray(out)


def workload(dataset: str, duration_s: float, rate: float, seed: int) -> list[Any]:
    from tidal import workload as W

    name, max_in = DATASETS[dataset]
    rng = np.random.default_rng(seed)
    arrivals = bursty_arrivals(rng, duration_s, rate)
    base = W.make_requests(W.WorkloadOptions(workload=name, num_requests=len(arrivals), seed=seed,
                                             max_input_len=max_in))
    return [W.RequestSpec(float(t), s.prompt_len, s.output_len) for t, s in zip(arrivals, base, strict=True)]


def simulate(system: dict[str, Any], specs: list[Any], timeline_interval: float, router: str = "llumnix",
             gpu_memory_utilization: float = 0.9) -> dict[str, Any]:
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec, build_simulator

    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                            preemption_mode=system["preemption_mode"])
    spec = ClusterSpec(model=MODEL, hardware=HARDWARE, instances=INSTANCES, router=router, scheduler=sched,
                       gpu_memory_utilization=gpu_memory_utilization,
                       swap_space=SWAP_SPACE if system["preemption_mode"] == "swap" else 0,
                       kv_pressure=system["kv_pressure"], link=LINK, timeline_interval_s=timeline_interval,
                       lookahead=system.get("lookahead", True))
    t0 = time.perf_counter()
    res = build_simulator(spec, specs).run()
    out = summarize(res.records)
    out["wall_s"] = time.perf_counter() - t0
    out["simulated_time_s"] = res.simulated_time_s
    out["num_preemptions"] = sum(i["num_preemptions"] for i in res.instances)
    out["mean_kv_demand"] = mean_demand(res.timelines)
    p = res.pressure or {}
    out["pressure"] = {k: v for k, v in p.items() if k != "events"}
    out["events"] = [e for e in p.get("events", []) if e["kind"] != "migrate"][:400]
    groups = p.get("groups") or []
    busy = sum(g["busy_time_s"] for g in groups)
    out["bubble_ratio"] = sum(g["bubble_ratio"] * g["busy_time_s"] for g in groups) / busy if busy else None
    out["timelines"] = res.timelines
    out["ttft_series"] = sorted((r.send_s, r.ttft_s) for r in res.records if r.ttft_s is not None)
    return out


def mean_demand(timelines: list[dict[str, Any]]) -> float:
    """Time-weighted mean over the instances of (KV in use + the queue's need) / pool, each sample
    held until the next."""
    vals = []
    for tl in timelines:
        t, d = np.asarray(tl["t"]), np.asarray(tl["kv_demand"])
        if len(t) > 1:
            vals.append(float(np.sum(d[:-1] * np.diff(t)) / (t[-1] - t[0])))
    return float(np.mean(vals)) if vals else 0.0


def calibrate(dataset: str, duration_s: float, seed: int, progress: bool = True, router: str = "llumnix",
              gpu_memory_utilization: float = 0.9) -> tuple[float, float]:
    """The mean rate at which vLLM's average KV demand is ``TARGET_DEMAND`` +- 0.05: scaled by
    target / demand (at most 2x a probe) until bracketed, then bisected; at most ``PROBES`` runs."""
    rate, demand = INITIAL_RATE[dataset], 0.0
    lo = hi = None
    base = SYSTEMS["vLLM (preempt: recompute)"]
    best = (math.inf, rate, demand)
    for probe in range(PROBES):
        demand = simulate(base, workload(dataset, duration_s, rate, seed), duration_s / 200, router,
                          gpu_memory_utilization)["mean_kv_demand"]
        if progress:
            print(f"  calibrate {dataset}: rate {rate:.2f} req/s -> vLLM's mean KV demand {demand:.1%} "
                  f"(probe {probe + 1})", flush=True)
        best = min(best, (abs(demand - TARGET_DEMAND), rate, demand))
        if abs(demand - TARGET_DEMAND) <= 0.05:
            break
        if demand > TARGET_DEMAND:
            hi = rate
        else:
            lo = rate
        if lo is not None and hi is not None:
            rate = (lo + hi) / 2
        else:  # demand grows faster than the rate near saturation: damp the step
            rate *= min(2.0, max(0.5, (TARGET_DEMAND / max(demand, 1e-3)) ** 0.5))
    return best[1], best[2]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-kunserve", help="KunServe vs preempt/swap/migrate at the paper's scale, simulated",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="burstgpt,sharegpt,longbench", help=f"of {', '.join(DATASETS)}")
    p.add_argument("--duration", type=F.positive_float, default=300.0, help="seconds of arrivals")
    p.add_argument("--rate", type=F.positive_float, default=None,
                   help="mean request rate (default: calibrated to ~50%% average KV demand per dataset)")
    p.add_argument("--router", default="llumnix", choices=["kv-aware", "llumnix"],
                   help="the dispatcher of every system: kv-aware (most free KV blocks) or llumnix (free KV blocks "
                        "per outstanding request, Llumnix's freeness)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each GPU for weights and KV (lower: a smaller KV pool, a memory-bound run)")
    p.add_argument("--jobs", type=F.positive_int, default=1,
                   help=f"simulator runs at once, each a process of its own (this machine: {usable_cores()} cores)")
    F.add_workload_flags(p, only=("seed",))
    F.add_output_flags(p, "results/sim_kunserve.json")
    p.set_defaults(func=run)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def run(args: argparse.Namespace) -> int:
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    bad = [d for d in names if d not in DATASETS]
    if bad:
        print(f"{PROG}: error: unknown dataset {bad[0]!r}; available: {', '.join(DATASETS)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if not args.no_progress:
            print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    command = command_line(PROG)
    print(f"command: {command}")
    report: dict[str, Any] = {"command": command, "machine": machine_info(), "paper": PAPER,
                              "setup": {"model": MODEL, "hardware": HARDWARE, "instances": INSTANCES, "link": LINK,
                                        "router": args.router, "max_num_seqs": MAX_NUM_SEQS,
                                        "gpu_memory_utilization": args.gpu_memory_utilization,
                                        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                                        "swap_space_gib": SWAP_SPACE / 1024**3, "duration_s": args.duration,
                                        "arrivals": f"Gamma(burstiness {BURSTINESS}), rate x Gamma({RATE_SHAPE}) "
                                                    f"per {WINDOW_S:g} s window", "seed": args.seed},
                              "datasets": {}}
    # every dataset's rate first (its own calibration runs), then every (dataset, system) run: each
    # batch of independent simulator runs goes to --jobs processes
    if args.rate is not None:
        rates = [(args.rate, None)] * len(names)
    else:
        rates = run_all(calibrate, [(ds, args.duration, args.seed, not args.no_progress, args.router,
                                     args.gpu_memory_utilization) for ds in names], args.jobs)
    specs_of = {ds: workload(ds, args.duration, rate, args.seed) for ds, (rate, _) in zip(names, rates, strict=True)}
    runs = [(ds, label) for ds in names for label in SYSTEMS]
    outs = dict(zip(runs, run_all(simulate, [(SYSTEMS[label], specs_of[ds], args.duration / 400, args.router,
                                              args.gpu_memory_utilization) for ds, label in runs],
                                  args.jobs), strict=True))
    for ds, (rate, demand) in zip(names, rates, strict=True):
        specs = specs_of[ds]
        mean_in = float(np.mean([s.prompt_len for s in specs]))
        mean_out = float(np.mean([s.output_len for s in specs]))
        log(f"{ds}: {len(specs)} requests at {rate:.2f} req/s mean (input {mean_in:.0f}, output {mean_out:.0f})")
        rows: dict[str, Any] = {}
        for label in SYSTEMS:
            out = outs[(ds, label)]
            rows[label] = out
            counts = {k: v for k, v in out["pressure"].get("counts", {}).items() if k in ("throttle", "migrate", "drop",
                                                                                           "restore", "autoscale")}
            bubble = f", bubbles {out['bubble_ratio']:.1%}" if out["bubble_ratio"] is not None else ""
            log(f"{ds}: {label}: TTFT p50/p99 {_ms(out['ttft_ms']['p50'])} / {_ms(out['ttft_ms']['p99'])} ms, "
                f"TPOT p50/p99 {_ms(out['tpot_ms']['p50'])} / {_ms(out['tpot_ms']['p99'])} ms, "
                f"{out['num_preemptions']} preemptions, {counts}{bubble} "
                f"({out['wall_s']:.0f} s wall)")
        drop_p99 = rows["KunServe (drop)"]["ttft_ms"]["p99"]
        gains = {b: rows[b]["ttft_ms"]["p99"] / drop_p99 for b in BASELINES if drop_p99 and rows[b]["ttft_ms"]["p99"]}
        report["datasets"][ds] = {"rate": rate, "calibrated_demand": demand, "num_requests": len(specs),
                                  "mean_input": mean_in, "mean_output": mean_out, "systems": rows,
                                  "p99_ttft_gain_over": gains,
                                  "p99_ttft_gain_min_max": [min(gains.values()), max(gains.values())] if gains else None}
        _table(ds, rows)
    report["wall_time_s"] = time.perf_counter() - t0
    plots = write_result(_slim(report), args.output, not args.no_plots, plotter=lambda r, p: _plots(report, p),
                         prog=PROG)
    for ds, d in report["datasets"].items():
        if d["p99_ttft_gain_min_max"]:
            lo, hi = d["p99_ttft_gain_min_max"]
            print(f"{ds}: KunServe's P99 TTFT is {lo:.1f}-{hi:.1f}x lower than the baselines' (simulated)")
    print(f"\n{PAPER}")
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


def _table(ds: str, rows: dict[str, Any]) -> None:
    drop = rows["KunServe (drop)"]["ttft_ms"]["p99"]
    print(f"\n== {ds}")
    print(f"{'system':<32}{'TTFT p50':>10}{'TTFT p99':>11}{'TPOT p50':>10}{'TPOT p99':>10}{'p99 / drop':>12}"
          f"{'preempt':>9}{'bubbles':>9}")
    for label, r in rows.items():
        t, o = r["ttft_ms"], r["tpot_ms"]
        ratio = f"{t['p99'] / drop:.1f}x" if drop and t["p99"] else "-"
        bubble = "-" if r["bubble_ratio"] is None else f"{r['bubble_ratio']:.1%}"
        print(f"{label:<32}{_ms(t['p50']):>10}{_ms(t['p99']):>11}{_ms(o['p50']):>10}{_ms(o['p99']):>10}{ratio:>12}"
              f"{r['num_preemptions']:>9}{bubble:>9}")


def _slim(report: dict[str, Any]) -> dict[str, Any]:
    """The JSON without the per-instance timelines and TTFT series (kept for the plots only)."""
    out = {**report, "datasets": {}}
    for ds, d in report["datasets"].items():
        out["datasets"][ds] = {**d, "systems": {k: {kk: vv for kk, vv in v.items() if kk not in ("timelines",
                                                                                              "ttft_series")}
                                                for k, v in d["systems"].items()}}
    return out


def _plots(report: dict[str, Any], json_path: str) -> list[str]:
    from tidal.common.plots import pyplot
    from tidal.sim.plots import mark_events

    plt = pyplot()
    stem = os.path.splitext(json_path)[0]
    dss = list(report["datasets"])
    fig, axes = plt.subplots(2, len(dss), figsize=(6 * len(dss), 7.5), squeeze=False)
    for j, ds in enumerate(dss):
        systems = report["datasets"][ds]["systems"]
        ax = axes[0][j]
        labels = list(systems)
        p50 = [systems[k]["ttft_ms"]["p50"] or 0 for k in labels]
        p99 = [systems[k]["ttft_ms"]["p99"] or 0 for k in labels]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, p50, 0.4, label="P50")
        ax.bar(x + 0.2, p99, 0.4, label="P99")
        ax.set_yscale("log")
        ax.set_xticks(x, [lb.split(" (")[0] for lb in labels], rotation=20, fontsize=8)
        ax.set_ylabel("TTFT (ms)")
        ax.set_title(f"{ds}: {report['datasets'][ds]['rate']:.2f} req/s mean")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        ax = axes[1][j]  # Fig. 12's second column: TTFT over time, with KunServe's events
        for label, r in systems.items():
            s = np.asarray(r["ttft_series"])
            if len(s):
                w = max(1, len(s) // 100)
                ax.plot(s[w - 1:, 0], np.convolve(s[:, 1] * 1000, np.ones(w) / w, "valid"), linewidth=0.9,
                        label=label.split(" (")[0])
        ax.set_yscale("log")
        ax.set_xlabel("arrival (s)")
        ax.set_ylabel(f"TTFT (ms), mean of {max(1, len(s) // 100)} arrivals")
        mark_events([ax], [e for e in systems["KunServe (drop)"]["events"] if e["kind"] in ("drop", "restore")])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{MODEL} on {INSTANCES} x {HARDWARE}, {LINK}: TTFT under KV pressure (simulated)")
    fig.tight_layout()
    png = f"{stem}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    out = [png]
    from tidal.sim.plots import plot_instance_timelines

    for ds in dss:  # KunServe's per-instance timelines with its events, per dataset
        r = report["datasets"][ds]["systems"]["KunServe (drop)"]
        out.append(plot_instance_timelines(r["timelines"], f"{stem}_{ds}_drop_instances.png",
                                           f"KunServe (drop), {ds}", r["events"]))
    return out


__all__ = ["add_parser", "bursty_arrivals", "run", "workload"]
