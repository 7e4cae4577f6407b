"""``tidal bench sim-kunserve``: KunServe's end-to-end comparison (Sec. 5.1-5.2, Fig. 13) in the
simulator: P50/P99 TTFT and TPOT of ``preempt`` (vLLM: recompute), ``preempt`` with swap
(InferCept-like), ``migrate`` (Llumnix-like) and ``drop`` (KunServe).

The paper's setup (Sec. 5.1, Table 2, cluster A): Qwen-2.5-14B, 8 instances of one A800-80GB
each (``a800-80g``), 200 Gbps RDMA between servers (``ib-hdr``); the dispatcher is Llumnix's load
balancing for every system (``llumnix``: free KV blocks per outstanding request; KunServe Sec. 3:
"our dispatcher incorporates the load-balancing design from Llumnix"). A merged group's pool grew
by the weights it dropped (here up to 5x an instance's pool) but its compute only by its members,
so by freeness alone it drew a burst it then queued for its prefill (burstgpt: P99 TTFT 2.96 s,
against 0.67 s once the group takes a request only while its prefill queue per member is the
shortest, :class:`tidal.cluster.router.LlumnixRouter`). ``kv-aware`` (the most free blocks) is
kept as an option. Arrivals are BurstGPT-like: the trace itself is not here, so a Gamma process
(burstiness 0.5, BurstGPT's shape in :mod:`tidal.workload`) whose rate is modulated per 20 s
window by a Gamma(2) factor (mean 1), which gives the trace's bursts of ~2x that throttle memory
(Fig. 2a), or the Azure conversation hour's times (``--arrivals azure``). The rate and the KV pool
come from :mod:`tidal.experiments.kunserve_regime` (the memory-bound regime: bursts within 85 %
of the measured compute capacity, a pool of 2x vLLM's mean KV in use).
Lengths: BurstGPT-like (642 / 262, lognormal), ShareGPT (the real length set, inputs capped at
4K as in the paper) and LongBench-like (5.9K / 499, lognormal, capped at 16K).
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
from tidal.experiments import kunserve_regime as R
from tidal.experiments import kunserve_timelines as TL
from tidal.experiments.kunserve_regime import BURSTINESS, RATE_SHAPE, WINDOW_S, bursty_arrivals
from tidal.experiments.parallel import run_all
from tidal.metrics import summarize

PROG = "tidal bench sim-kunserve"
MODEL, HARDWARE, INSTANCES, LINK = "qwen-2.5-14b", "a800-80g", 8, "ib-hdr"
MAX_NUM_SEQS = 1024  # above what the KV holds for these lengths (vLLM's 256 caps BurstGPT-like batches before the
#                     memory does: KunServe's gain is a larger batch in the grown pool, Sec. 5.2)
MAX_NUM_BATCHED_TOKENS = 2048  # chunked prefill's step budget (Sarathi-Serve; vLLM's 512 starves prefills under load)
SWAP_SPACE = 64 * 1024**3  # host memory per instance for InferCept-like swapping
INITIAL_RATE = {"burstgpt": 40.0, "sharegpt": 12.0, "longbench": 4.0}  # req/s, 8 instances: the capacity probe's first
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


def workload(dataset: str, duration_s: float, rate: float, seed: int, arrivals: str = "gamma",
             trace: str | None = None) -> list[Any]:
    """The dataset's lengths on ``arrivals`` (:func:`tidal.experiments.kunserve_regime.arrivals`:
    ``gamma`` bursts or the Azure hour's times) at mean ``rate``; ``steady``: Poisson arrivals."""
    from tidal import workload as W

    name, max_in = DATASETS[dataset]
    rng = np.random.default_rng(seed)
    times = (W.arrivals_within(rng, duration_s, rate, 1.0) if arrivals == "steady"
             else R.arrivals(arrivals, rng, duration_s, rate, trace))
    base = W.make_requests(W.WorkloadOptions(workload=name, num_requests=len(times), seed=seed,
                                             max_input_len=max_in))
    return [W.RequestSpec(float(t), s.prompt_len, s.output_len) for t, s in zip(times, base, strict=True)]


def simulate(system: dict[str, Any], specs: list[Any], timeline_interval: float, router: str = "llumnix",
             gpu_memory_utilization: float = 0.9, num_blocks: int | None = None) -> dict[str, Any]:
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec, build_simulator

    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                            preemption_mode=system["preemption_mode"])
    spec = ClusterSpec(model=MODEL, hardware=HARDWARE, instances=INSTANCES, router=router, scheduler=sched,
                       gpu_memory_utilization=gpu_memory_utilization, num_blocks=num_blocks,
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
    events = p.get("events", [])
    out["participation"] = TL.participation(events, INSTANCES)
    out["lost"] = len(specs) - out["completed"]
    out["events"] = [e for e in events if e["kind"] != "migrate"][:400]
    groups = p.get("groups") or []
    busy = sum(g["busy_time_s"] for g in groups)
    out["bubble_ratio"] = sum(g["bubble_ratio"] * g["busy_time_s"] for g in groups) / busy if busy else None
    out["timelines"] = res.timelines
    out["ttft_series"] = sorted((r.send_s, r.ttft_s) for r in res.records if r.ttft_s is not None)
    return out


def mean_usage(timelines: list[dict[str, Any]]) -> float:
    """Time-weighted mean over the instances of KV in use / pool."""
    return mean_demand([{"t": tl["t"], "kv_demand": tl["kv_usage"]} for tl in timelines])


def mean_demand(timelines: list[dict[str, Any]]) -> float:
    """Time-weighted mean over the instances of (KV in use + the queue's need) / pool, each sample
    held until the next."""
    vals = []
    for tl in timelines:
        t, d = np.asarray(tl["t"]), np.asarray(tl["kv_demand"])
        if len(t) > 1:
            vals.append(float(np.sum(d[:-1] * np.diff(t)) / (t[-1] - t[0])))
    return float(np.mean(vals)) if vals else 0.0


def probe_timelines(dataset: str, seed: int, router: str, rate: float, duration_s: float) -> list[dict[str, Any]]:
    """One capacity-probe run: vLLM, steady Poisson arrivals at ``rate``, an unlimited KV pool,
    cut at ``duration_s``; the per-instance timelines."""
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec, build_simulator

    specs = workload(dataset, duration_s, rate, seed, "steady")
    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    spec = ClusterSpec(model=MODEL, hardware=HARDWARE, instances=INSTANCES, router=router, scheduler=sched,
                       num_blocks=R.UNLIMITED_BLOCKS, kv_pressure="preempt", link=LINK,
                       timeline_interval_s=duration_s / 300)
    return build_simulator(spec, specs).run(until=duration_s).timelines


def regime(dataset: str, duration_s: float, seed: int, arrivals: str = "gamma", trace: str | None = None,
           router: str = "llumnix", rate: float | None = None, gpu_memory_utilization: float | None = None,
           probe_duration_s: float = R.PROBE_DURATION_S, probes: int = R.PROBES,
           progress: bool = True) -> dict[str, Any]:
    """The run's rate and KV pool (:mod:`tidal.experiments.kunserve_regime`): the compute capacity
    (unless ``rate`` is given), the highest mean rate whose every window stays at or under
    ``CAPACITY_SHARE`` of it, and a pool of ``POOL_OVER_MEAN`` x vLLM's mean KV in use with an
    unlimited pool (unless ``gpu_memory_utilization`` is given)."""
    def log(msg: str) -> None:
        if progress:
            print(f"  {dataset}: {msg}", flush=True)

    out: dict[str, Any] = {"arrivals": arrivals}
    if rate is None:
        probe = R.probe_capacity(lambda r, d: probe_timelines(dataset, seed, router, r, d), INITIAL_RATE[dataset],
                                 probe_duration_s, probes, log)
        cap = probe["capacity"]
        rate, peak = R.rate_under_capacity(  # the arrivals workload() draws first from the same seed
            cap, lambda r: R.arrivals(arrivals, np.random.default_rng(seed), duration_s, r, trace), duration_s)
        out.update(capacity=probe, rate_source=f"every {WINDOW_S:g} s window at most {R.CAPACITY_SHARE:.0%} of "
                   "the capacity", max_window_rate=peak, max_window_share=peak / cap)
        log(f"compute capacity {cap:.2f} req/s ({probe['definition']}); mean rate {rate:.2f} req/s, its busiest "
            f"{WINDOW_S:g} s window {peak:.2f} req/s = {peak / cap:.0%} of capacity")
    else:
        peak = float(R.window_rates(np.asarray([s.arrival_s for s in workload(dataset, duration_s, rate, seed,
                                                                                arrivals, trace)]), duration_s).max())
        out.update(capacity=None, rate_source="given (--rate)", max_window_rate=peak, max_window_share=None)
    out["rate"] = rate
    if gpu_memory_utilization is None:
        use = simulate(SYSTEMS["vLLM (preempt: recompute)"], workload(dataset, duration_s, rate, seed, arrivals, trace),
                       duration_s / 400, router, num_blocks=R.UNLIMITED_BLOCKS)
        kv = R.kv_in_use(use["timelines"], R.UNLIMITED_BLOCKS)
        blocks = R.pool_blocks(kv["mean_blocks"])
        out.update(num_blocks=blocks, unlimited_mean_blocks=kv["mean_blocks"], unlimited_peak_blocks=kv["peak_blocks"],
                   pool_source=f"{R.POOL_OVER_MEAN:g} x vLLM's mean KV in use with an unlimited pool", **pool_memory(blocks))
        log(f"KV in use with an unlimited pool: mean {kv['mean_blocks']:.0f} blocks, peak {kv['peak_blocks']:.0f} "
            f"per instance -> pool {blocks} blocks ({out['pool_gib']:.1f} GiB, weights + pool = "
            f"{out['gpu_memory_share']:.0%} of a GPU); the peak is {kv['peak_blocks'] / blocks:.0%} of it")
    else:
        out.update(num_blocks=None, gpu_memory_utilization=gpu_memory_utilization,
                   pool_source="given (--gpu-memory-utilization)")
    return out


def pool_memory(blocks: int) -> dict[str, float]:
    """A pool of ``blocks`` per instance in GiB, and weights + pool as a share of the GPU."""
    from tidal.sim.analytic import weight_bytes
    from tidal.sim.hardware import get_hardware
    from tidal.sim.models import get_model

    arch, hw = get_model(MODEL), get_hardware(HARDWARE)
    pool = blocks * 16 * arch.kv_bytes_per_token(2)
    return {"pool_gib": pool / 1024**3, "gpu_memory_share": (pool + weight_bytes(arch, 2)) / hw.memory_bytes}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-kunserve", help="KunServe vs preempt/swap/migrate at the paper's scale, simulated",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", default="burstgpt,sharegpt,longbench", help=f"of {', '.join(DATASETS)}")
    p.add_argument("--duration", type=F.positive_float, default=300.0, help="seconds of arrivals")
    p.add_argument("--rate", type=F.positive_float, default=None,
                   help="mean request rate (default: the highest whose every 20 s window stays at or under "
                        f"{R.CAPACITY_SHARE * 100:.0f}%% of the compute capacity the probe measures)")
    p.add_argument("--arrivals", default="gamma", choices=list(R.ARRIVALS),
                   help="gamma: a Gamma process modulated per 20 s window by Gamma(2) (BurstGPT-like); azure: the "
                        "Azure conversation hour's real arrival times rescaled to the mean rate")
    p.add_argument("--azure-trace", default=None,
                   help=f"the Azure conversation trace for --arrivals azure (default: ${R.AZURE_ENV}, else the "
                        "shared traces folder's azure2023_conv.csv)")
    p.add_argument("--router", default="llumnix", choices=["kv-aware", "llumnix"],
                   help="the dispatcher of every system: kv-aware (most free KV blocks) or llumnix (free KV blocks "
                        "per outstanding request, Llumnix's freeness)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of each GPU for weights and KV (default: a KV pool of "
                        f"{R.POOL_OVER_MEAN:g} x vLLM's mean KV in use, measured with an unlimited pool)")
    p.add_argument("--probe-duration", type=F.positive_float, default=R.PROBE_DURATION_S,
                   help="seconds of steady arrivals per capacity-probe run")
    p.add_argument("--probes", type=F.positive_int, default=R.PROBES, help="capacity-probe runs per dataset")
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
                                        "kv_pool": ("given (--gpu-memory-utilization)" if args.gpu_memory_utilization
                                                    else f"{R.POOL_OVER_MEAN:g} x vLLM's mean KV in use (unlimited pool)"),
                                        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                                        "swap_space_gib": SWAP_SPACE / 1024**3, "duration_s": args.duration,
                                        "arrivals": (f"Gamma(burstiness {BURSTINESS}), rate x Gamma({RATE_SHAPE}) "
                                                     f"per {WINDOW_S:g} s window" if args.arrivals == "gamma" else
                                                     "the Azure conversation hour's arrival times, rescaled"),
                                        "arrival_kind": args.arrivals, "seed": args.seed},
                              "datasets": {}}
    if args.arrivals == "azure":
        try:
            args.azure_trace = R.azure_trace_path(args.azure_trace)
        except R.RegimeError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
    # every dataset's regime first (its capacity probe and pool sizing), then every (dataset,
    # system) run: each batch of independent simulator runs goes to --jobs processes
    try:
        regimes = run_all(regime, [(ds, args.duration, args.seed, args.arrivals, args.azure_trace, args.router,
                                    args.rate, args.gpu_memory_utilization, args.probe_duration, args.probes,
                                    not args.no_progress) for ds in names], args.jobs)
    except R.RegimeError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    specs_of = {ds: workload(ds, args.duration, g["rate"], args.seed, args.arrivals, args.azure_trace)
                for ds, g in zip(names, regimes, strict=True)}
    runs = [(ds, label) for ds in names for label in SYSTEMS]
    pools = {ds: (g.get("gpu_memory_utilization") or 0.9, g["num_blocks"]) for ds, g in zip(names, regimes, strict=True)}
    outs = dict(zip(runs, run_all(simulate, [(SYSTEMS[label], specs_of[ds], args.duration / 400, args.router,
                                              *pools[ds]) for ds, label in runs],
                                  args.jobs), strict=True))
    for ds, g in zip(names, regimes, strict=True):
        specs, rate = specs_of[ds], g["rate"]
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
            part = out["participation"]
            log(f"{ds}: {label}: TTFT p50/p99 {_ms(out['ttft_ms']['p50'])} / {_ms(out['ttft_ms']['p99'])} ms, "
                f"TPOT p50/p99 {_ms(out['tpot_ms']['p50'])} / {_ms(out['tpot_ms']['p99'])} ms, "
                f"{out['num_preemptions']} preemptions, {counts}{bubble}; throttled instances {part['throttled']}, "
                f"in a drop {part['in_a_drop']}, {part['onsets_answered']}/{part['throttle_onsets']} onsets answered "
                f"by a drop; {out['lost']} lost ({out['wall_s']:.0f} s wall)")
        base = rows["vLLM (preempt: recompute)"]
        g["achieved"] = {"mean_kv_use": mean_usage(base["timelines"]), "mean_kv_demand": base["mean_kv_demand"],
                         "peak_kv_demand": max((max(tl["kv_demand"]) for tl in base["timelines"] if tl["kv_demand"]),
                                               default=0.0)}
        log(f"{ds}: vLLM's KV with this pool: mean in use {g['achieved']['mean_kv_use']:.0%}, mean demand "
            f"{g['achieved']['mean_kv_demand']:.0%}, burst peak demand {g['achieved']['peak_kv_demand']:.0%} of the pool")
        drop_p99 = rows["KunServe (drop)"]["ttft_ms"]["p99"]
        gains = {b: rows[b]["ttft_ms"]["p99"] / drop_p99 for b in BASELINES if drop_p99 and rows[b]["ttft_ms"]["p99"]}
        report["datasets"][ds] = {"rate": rate, "regime": g, "num_requests": len(specs),
                                  "mean_input": mean_in, "mean_output": mean_out, "systems": rows,
                                  "p99_ttft_gain_over": gains,
                                  "p99_ttft_gain_min_max": [min(gains.values()), max(gains.values())] if gains else None}
        _table(ds, rows)
    report["wall_time_s"] = time.perf_counter() - t0
    timelines = TL.write_timelines(report, os.path.splitext(args.output)[0] + "_timelines.json")
    plots = write_result(_slim(report) | {"timelines_json": os.path.basename(timelines)}, args.output,
                         not args.no_plots, plotter=lambda r, p: _plots(report, p), prog=PROG)
    for ds, d in report["datasets"].items():
        if d["p99_ttft_gain_min_max"]:
            lo, hi = d["p99_ttft_gain_min_max"]
            print(f"{ds}: KunServe's P99 TTFT is {lo:.1f}-{hi:.1f}x lower than the baselines' (simulated)")
    print(f"\n{PAPER}")
    print(f"wall time {report['wall_time_s']:.0f} s; wrote {args.output}, {timelines}"
          + (f" and {', '.join(plots)}" if plots else ""))
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
    """The JSON without the per-instance timelines and TTFT series (the timelines JSON and the plots have them)."""
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
    return out + TL.plot_all_instances(report, stem)  # every system's per-instance timelines with its events


__all__ = ["add_parser", "bursty_arrivals", "regime", "run", "simulate", "workload"]
