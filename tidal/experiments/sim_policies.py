"""``tidal bench sim-policies``: the batching policies at cluster scale, in the simulator, on
the papers' setups.

Scenario ``bucketserve`` (BucketServe Sec. V): Llama-2-13B on A100-40G instances, a mix of
Alpaca-like (83 in / 128 out) and LongBench-like (5.9K in, clipped to the 4K context, / 499 out)
requests. Reported: offline throughput (every request at t = 0, as in BucketServe Fig. 5a) and
the capacity at 80 % SLO attainment (Fig. 5c-f). `tidal reproduce bucketserve` runs the paper's setup against its baselines.
Scenario ``pang-sla`` (Pang et al., Table II): Llama-3-70B (tp 4) with prompts of 256.6 tokens and
outputs of 61.5 or 447.5, a 50 ms decode SLA. The paper's "static batching" is vLLM with a fixed
batch-size cap (continuous batching with ``max_num_seqs``); "dynamic" is Alg. 2 (``sla``).
Reported: the capacity (the highest rate at which 90 % of requests meet the SLA) and the
throughput at it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tidal.common import flags as F
from tidal.common.machine import machine_info, usable_cores
from tidal.common.progress import progress_bar
from tidal.common.results import command_line, write_result
from tidal.experiments.parallel import run_all
from tidal.metrics import SLO, CapacitySearch, summarize
from tidal.workload import RequestSpec, gamma_arrivals, lognormal_lengths, specs_at_rate


@dataclass
class Scenario:
    name: str
    model: str
    hardware: str
    instances: int
    tp: int
    slo: SLO
    target: float
    policies: dict[str, dict[str, Any]]  # label -> scheduler config
    workloads: dict[str, tuple[float, float, float, float]]  # label -> (in mean, in sigma, out mean, out sigma)
    mix: list[tuple[str, float]] = field(default_factory=list)  # (workload label, share) for a mixed workload
    max_input_len: int | None = None
    offline: bool = False
    paper: dict[str, str] = field(default_factory=dict)


PROG = "tidal bench sim-policies"
MAX_PROBES = 14  # capacity search probes per policy and workload

POLICIES_ALL = {
    "static": {"batching": "static"},
    "continuous": {"batching": "continuous"},
    "bucket": {"batching": "bucket"},
    "memory": {"batching": "memory"},
    "sla": {"batching": "sla", "tbt_slo_ms": 50.0},
    "slo-compose": {"batching": "slo-compose", "tbt_slo_ms": 50.0},
    "bucket+memory+sla": {"batching": "bucket+memory+sla", "tbt_slo_ms": 50.0},
}

SCENARIOS = {
    "bucketserve": Scenario(
        name="bucketserve", model="llama-2-13b", hardware="a100-40g", instances=4, tp=1,
        slo=SLO(ttft_s=5.0, tpot_s=0.1), target=0.8, policies=POLICIES_ALL,
        workloads={"alpaca": (83, 0.6, 128, 0.8), "longbench": (5900, 0.5, 499, 0.6)},
        mix=[("alpaca", 0.5), ("longbench", 0.5)], max_input_len=3500, offline=True,
        paper={"throughput": "BucketServe 3.58x UELLM, 1.31x DistServe (offline, Llama2-13B, Fig. 5a)",
               "capacity": "1.93x DistServe and 3.47x UELLM RPS at 80% attainment on Mixed (Fig. 5d)"}),
    "pang-sla": Scenario(
        name="pang-sla", model="llama-3-70b", hardware="a100-80g", instances=1, tp=4,
        slo=SLO(ttft_s=10.0, tpot_s=0.05), target=0.9,
        policies={"static (fixed cap 256)": {"batching": "continuous", "max_num_seqs": 256},
                  "sla": {"batching": "sla", "tbt_slo_ms": 50.0, "max_num_seqs": 256},
                  "memory+sla": {"batching": "memory+sla", "tbt_slo_ms": 50.0, "max_num_seqs": 256}},
        workloads={"out-61": (256.6, 0.5, 61.5, 0.6), "out-447": (256.6, 0.5, 447.5, 0.6)},
        paper={"out-61": "capacity 5.4 -> 6.6 qps (+22%), throughput 331 -> 405 tok/s (+22.4%) (Table II)",
               "out-447": "capacity 3.0 -> 3.8 qps (+27%), throughput 1322 -> 1665 tok/s (+25.9%) (Table II)"}),
}


def lengths(rng: np.random.Generator, n: int, shape: tuple[float, float, float, float]) -> tuple[np.ndarray, ...]:
    return lognormal_lengths(rng, n, shape[0], shape[1]), lognormal_lengths(rng, n, shape[2], shape[3])


def workload(sc: Scenario, label: str, n: int, seed: int) -> list[RequestSpec]:
    """``n`` requests at 1 req/s (Poisson), rescaled per probe."""
    rng = np.random.default_rng(seed)
    if label == "mixed":
        kinds = rng.choice(len(sc.mix), size=n, p=[s for _, s in sc.mix])
        ins, outs = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for k, (name, _) in enumerate(sc.mix):
            a, b = lengths(rng, n, sc.workloads[name])
            ins[kinds == k], outs[kinds == k] = a[kinds == k], b[kinds == k]
    else:
        ins, outs = lengths(rng, n, sc.workloads[label])
    if sc.max_input_len:
        ins = np.minimum(ins, sc.max_input_len)
    t = gamma_arrivals(rng, n, 1.0)
    return [RequestSpec(float(t[i]), int(ins[i]), int(outs[i])) for i in range(n)]


def run_sim(sc: Scenario, policy: dict[str, Any], specs: list[RequestSpec]) -> dict[str, Any]:
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec, build_simulator

    spec = ClusterSpec(model=sc.model, hardware=sc.hardware, instances=sc.instances, tp=sc.tp,
                       scheduler=SchedulerConfig(**policy), timeline_interval_s=math.inf)  # no timelines: unused here
    res = build_simulator(spec, specs).run()
    out = summarize(res.records, slo=sc.slo)
    out["simulated_time_s"] = res.simulated_time_s
    out["num_preemptions"] = sum(i["num_preemptions"] for i in res.instances)
    return out


def capacity(sc: Scenario, policy: dict[str, Any], specs: list[RequestSpec], low: float, high: float,
             on_probe: Callable[[], Any] | None = None
             ) -> tuple[float | None, dict[str, Any] | None, list[dict[str, Any]]]:

    search = CapacitySearch(low, high, sc.target, tolerance=0.03, max_probes=MAX_PROBES)
    best = None
    while (rate := search.next_rate()) is not None:
        s = run_sim(sc, policy, specs_at_rate(specs, rate, None))
        if on_probe is not None:
            on_probe()
        p = search.record(rate, s["slo_attainment"] or 0.0)
        if p.passed and (best is None or rate >= best[0]):
            best = (rate, s)
    return search.capacity, (best[1] if best else None), search.report()["probes"]


def policy_row(scenario: str, label: str, pname: str, num_requests: int, seed: int, bar: bool) -> dict[str, Any]:
    """One policy's row of a scenario's workload: its offline run (if the scenario has one) and its
    capacity search (a progress bar when ``bar``)."""
    sc = SCENARIOS[scenario]
    pol = sc.policies[pname]
    specs = workload(sc, label, num_requests, seed)
    row: dict[str, Any] = {"policy": pname, "config": pol}
    t0 = time.perf_counter()
    progress = progress_bar(MAX_PROBES + sc.offline, pname, "run", bar, leave=False)
    if sc.offline:
        off = run_sim(sc, pol, [replace(s, arrival_s=0.0) for s in specs])
        progress.update(1)
        row["offline_tok_s"] = off["output_throughput"]
        row["offline"] = {k: off[k] for k in ("output_throughput", "request_throughput", "duration_s",
                                              "num_preemptions")}
    cap, at, probes = capacity(sc, pol, specs, 0.05, 200.0, on_probe=progress.update)
    progress.close()
    row.update({"capacity_rps": cap, "at_capacity": at, "probes": probes, "wall_s": time.perf_counter() - t0})
    return row


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-policies", help="the batching policies at cluster scale in the simulator",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="bucketserve,pang-sla", help=f"of {', '.join(SCENARIOS)}")
    p.add_argument("--jobs", type=F.positive_int, default=usable_cores(),
                   help="policies run at once, each a process of its own (default: this machine's cores)")
    F.add_workload_flags(p, only=("num_requests", "seed"), defaults={"num_requests": 1000})
    F.add_output_flags(p, "results/sim_policies.json")
    p.set_defaults(func=run)


def _table(rows: list[dict[str, Any]], base: str) -> None:
    ref = next((r for r in rows if r["policy"] == base), None)
    print(f"(ratios: capacity / offline throughput, relative to {base})")
    print(f"{'policy':<24}{'offline tok/s':>14}{'capacity rps':>14}{'ratios':>16}{'tok/s at cap':>14}"
          f"{'TPOT p99':>10}")
    for r in rows:
        cap, off = r["capacity_rps"], r.get("offline_tok_s")
        ratio = "-"
        if ref and cap and ref["capacity_rps"]:
            ratio = f"{cap / ref['capacity_rps']:.2f}x"
        if ref and off and ref.get("offline_tok_s"):
            ratio += f" / {off / ref['offline_tok_s']:.2f}x"
        at = r.get("at_capacity") or {}
        print(f"{r['policy']:<24}{off or 0:>14.0f}{cap or 0:>14.2f}{ratio:>16}"
              f"{at.get('output_throughput') or 0:>14.0f}{(at.get('tpot_ms') or {}).get('p99') or 0:>10.1f}")


def _plot(report: dict[str, Any], path: str) -> None:
    from tidal.common.plots import pyplot

    plt = pyplot()
    panels = [(sc, wl) for sc, wls in report["scenarios"].items() for wl in wls]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (sc, wl) in zip(axes[0], panels, strict=True):
        rows = report["scenarios"][sc][wl]
        names = [r["policy"] for r in rows]
        ax.bar(range(len(rows)), [r["capacity_rps"] or 0 for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("capacity (req/s at SLO target)")
        ax.set_title(f"{sc}: {wl}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        print(f"{PROG}: error: unknown scenario {bad[0]!r}; available: {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    command = command_line(PROG)
    print(f"command: {command}")
    report: dict[str, Any] = {"command": command, "machine": machine_info(), "scenarios": {}, "paper": {}}
    t0 = time.perf_counter()
    # every policy row of every scenario and workload is independent of the others: all go to --jobs
    # processes at once (a workload's few policies alone would leave cores idle), each making its
    # workload where it runs (``workload``: exactly num_requests, the same for a seed)
    groups = [(name, label) for name in names for label in (["mixed"] if SCENARIOS[name].mix
                                                             else list(SCENARIOS[name].workloads))]
    calls = [(name, label, pname, args.num_requests, args.seed, not args.no_progress and args.jobs <= 1)
             for name, label in groups for pname in SCENARIOS[name].policies]
    print(f"{len(calls)} policy rows ({len(groups)} workloads), {args.jobs} at once", flush=True)
    done = [0]

    def finished(i: int, row: dict[str, Any]) -> None:
        done[0] += 1
        name, label, pname = calls[i][:3]
        cap = row["capacity_rps"]
        print(f"  [{done[0]}/{len(calls)}] {name} {label} {pname}: capacity "
              f"{cap if cap is None else round(cap, 3)} req/s"
              + (f", offline {row['offline_tok_s']:.0f} tok/s" if "offline_tok_s" in row else "")
              + f" ({row['wall_s']:.0f} s; {time.perf_counter() - t0:.0f} s in)", flush=True)

    rows = run_all(policy_row, calls, args.jobs, on_done=finished)
    for name, label in groups:
        sc = SCENARIOS[name]
        report["paper"][name] = sc.paper
        group = [r for c, r in zip(calls, rows, strict=True) if c[:2] == (name, label)]
        report["scenarios"].setdefault(name, {})[label] = group
        print(f"\n== {name}: {sc.model} on {sc.instances} x {sc.hardware} (tp {sc.tp}), workload {label}, "
              f"{args.num_requests} requests, SLO {sc.slo.describe()}, target {sc.target:.0%}")
        _table(group, "static" if "static" in sc.policies else next(iter(sc.policies)))
        for k, v in sc.paper.items():
            print(f"  paper ({k}): {v}")
    report["wall_time_s"] = time.perf_counter() - t0
    plots = write_result(report, args.output, not args.no_plots, plotter=_write_plot, prog=PROG)
    print(f"\nwall time {report['wall_time_s']:.0f} s; wrote {args.output}"
          + (f" and {', '.join(plots)}" if plots else ""))
    return 0


def _write_plot(report: dict[str, Any], json_path: str) -> list[str]:
    png = os.path.splitext(json_path)[0] + ".png"
    _plot(report, png)
    return [png]
