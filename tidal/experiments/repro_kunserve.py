"""KunServe (Sec. 5.1-5.3, Fig. 13) in the simulator: P99 TTFT of dropping layers (KunServe)
against vLLM's recompute preemption, InferCept-like swapping and Llumnix-like migration under
bursty memory pressure; and the lookahead microbatches' effect on pipeline bubbles.

It runs :mod:`tidal.experiments.sim_kunserve` (``tidal bench sim-kunserve``: Qwen-2.5-14B on 8 x
A800-80G, 200 Gbps RDMA, Llumnix's load balancing, Gamma bursts per 20 s window) in the
memory-bound regime of Sec. 2.2 (:mod:`tidal.experiments.kunserve_regime`: a compute-capacity
probe with an unlimited pool, every burst window at or under 85 % of it, a pool of 2x vLLM's mean
KV in use) and reads the claims off its JSON. ``--quick``: LongBench-like lengths only, 60 s of
arrivals, a shorter capacity probe (30 s runs, 3 of them).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from tidal.common.machine import usable_cores
from tidal.experiments import sim_kunserve as K
from tidal.experiments.reproduce import Claim, Progress, Report, beats, fmt_ratio, run_bench, runs_real

REAL = ("not run here: the paper's model (14B) does not fit this 2-core CPU; the same policies on 2 real "
        "CPU instances of the default model run without --quick (or with --real)")
REAL_BUBBLES = "not measured on the real engine (its pipeline runs microbatches, its bubbles are not timed)"
DROP, LOOKAHEAD_OFF = "KunServe (drop)", "KunServe w/o lookahead"
WHY = ("the analytic A100-class cost model (calibrated to Vidur's A100 profiles) stands in for the A800s; "
       "BurstGPT's bursts are a modulated Gamma process (or the Azure conversation hour's times), not the "
       "trace; vLLM's, InferCept's and Llumnix's code is not run: tidal's own preempt / swap / migrate policies "
       "stand for them; the regime is the paper's premise made explicit (bursts within 85 % of the measured "
       "compute capacity, a pool of 2x the mean KV in use), not the paper's own scaled trace")

# the InferCept-like baseline on the real engine: a CPU's "host memory" is the DRAM its KV is in already
WHY_REAL_SWAP = ("real: on a CPU a swap is a copy within the same DRAM (the KV pool and the swap space are both "
                 "RAM), done in milliseconds beside decode steps of tens to hundreds of ms, where the paper's "
                 "GPUs swap across PCIe; so swapping costs far less here relative to a step than on the paper's "
                 "A800s, and drop can at best tie it")


def _bench_argv(args: argparse.Namespace) -> list[str]:
    argv = ["bench", "sim-kunserve"]
    if args.no_progress:  # otherwise the bench's own lines (one per run) show the progress
        argv.append("--no-progress")
    if args.no_plots:
        argv.append("--no-plots")
    if args.quick:
        argv += ["--datasets", "longbench", "--duration", "60", "--probe-duration", "30", "--probes", "3"]
    else:  # the full run's simulator runs on every core
        argv += ["--jobs", str(usable_cores())]
    return argv


def reproduce(args: argparse.Namespace, log: Progress) -> Report:
    data = run_bench(K.add_parser, _bench_argv(args), os.path.join(args.output, "kunserve_sim.json"), log)
    setup = data["setup"]
    report = Report(
        "kunserve", "KunServe: drop layers instead of preempting under memory pressure (Fig. 13)",
        f"Simulated: {setup['model']} on {setup['instances']} x {setup['hardware']}, {setup['link']} between "
        f"them, {setup['router']} dispatch (Llumnix's freeness for every system; a KunServe group, whose pool "
        f"grew by the weights it dropped but whose compute only by its members, takes a new request only while "
        f"its prefill queue per member is the shortest), {setup['arrivals']}, {setup['duration_s']:g} s of "
        f"arrivals per dataset ({', '.join(data['datasets'])}); the same requests for every system. Runs "
        f"`tidal bench sim-kunserve` (its JSON: `kunserve_sim.json`).",
        args.quick, data=_slim(data), figures=[os.path.basename(p) for p in data.get("plots", [])])
    if runs_real(args):
        from tidal.experiments import kunserve_real

        with tempfile.TemporaryDirectory(prefix="tidal-kunserve-real-") as tmp:  # each run's records: not kept
            # the memory-bound regime first: the capacity probe, the rate under it, the pool from the mean in use
            setup, regime = kunserve_real.resolve(kunserve_real.RealSetup(), os.path.join(tmp, "run"), log)
            rows = kunserve_real.run(list(kunserve_real.SYSTEMS), setup, os.path.join(tmp, "run"), log)
        report.data["real"] = {"setup": setup.__dict__, "regime": regime, "engine_flags": setup.engine_flags(),
                               "rows": {r["system"]: {k: v for k, v in r.items() if k not in ("timeline", "events")}
                                        | {"num_events": len(r["events"]),
                                           "event_kinds": sorted({e.get("kind", "") for e in r["events"]})}
                                        for r in rows}}
    for ds, d in data["datasets"].items():
        report.claims += _claims(ds, d, report.data.get("real"))
    return report


def _real_cell(real: dict[str, Any] | None, base: str) -> str:
    """The real column of a P99 TTFT claim: the same four policies on 2 CPU instances, or why not."""
    if real is None:
        return REAL
    rows, st = real["rows"], real["setup"]
    drop, b = rows[DROP], rows[base]
    gain = b["ttft_p99_ms"] / drop["ttft_p99_ms"] if drop["ttft_p99_ms"] else None
    g = real.get("regime") or {}
    cap = (f"; busiest {st['window_s']:g} s window {g['max_window_rate']:.2f} req/s = {g['max_window_share']:.0%} of "
           f"the measured {g['capacity']:.2f} req/s capacity" if g.get("capacity") else "")
    pool = ""
    if g.get("num_blocks"):
        floor = g["num_blocks"] == g.get("floor_blocks") and g["num_blocks"] > round(2 * g["unlimited_mean_blocks"])
        pool = (f" = {g['num_blocks']} blocks, " + (f"the floor of one longest request (2x vLLM's mean in use, "
                f"{g['unlimited_mean_blocks']:.0f} blocks, is less)" if floor else "2x vLLM's mean in use")
                + f"; vLLM's peak with a large pool is {g['unlimited_peak_blocks'] / g['num_blocks']:.0%} of it")
    return (f"{_ms(drop['ttft_p99_ms'])} vs {_ms(b['ttft_p99_ms'])}: {fmt_ratio(gain)} lower; goodput "
            f"{drop['goodput_tok_s']:.0f} vs {b['goodput_tok_s']:.0f} tok/s (2 CPU instances of the default model, "
            f"{st['num_requests']} {st['workload']}-shaped requests at {st['rate']:g} req/s, burstiness "
            f"{st['burstiness']:g}{cap}; KV {_mib(st['kv_cache_memory'])} each{pool}; one run of 24 requests on a "
            f"2-core machine: noisy) (direction holds: {'yes' if beats(b['ttft_p99_ms'], drop['ttft_p99_ms']) else '**no**'})")


def _real_events(real: dict[str, Any]) -> str:
    """The real drop run's pressure events and losses, for the participation claim."""
    d = real["rows"][DROP]
    return (f"{d['num_events']} pressure events (throttle, drop, exchange, restore) on 2 CPU instances; "
            f"{d['num_requests'] - d['completed']} of {d['num_requests']} requests lost")


def _mib(size: str) -> str:
    from tidal.config import parse_size

    return f"{parse_size(size) / 1024**2:.1f} MiB"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f} ms"


def _claims(ds: str, d: dict[str, Any], real: dict[str, Any] | None = None) -> list[Claim]:
    rows = d["systems"]
    drop = rows[DROP]
    out = []
    where = regime_text(d)
    for base in K.BASELINES:
        b = rows[base]
        gain = d["p99_ttft_gain_over"].get(base)
        out.append(Claim(
            f"{ds}: P99 TTFT, KunServe (drop) below {base}",
            "12.7-72.2x lower P99 TTFT than vLLM, InferCept and Llumnix (Sec. 5.2, Fig. 13)",
            f"{_ms(drop['ttft_ms']['p99'])} vs {_ms(b['ttft_ms']['p99'])}: {fmt_ratio(gain)} lower at "
            f"{d['rate']:.2f} req/s ({d['num_requests']} requests{where})",
            beats(b["ttft_ms"]["p99"], drop["ttft_ms"]["p99"]),
            f"{WHY}; {WHY_REAL_SWAP}" if real is not None and "swap" in base and real["setup"]["workload"] == ds else WHY,
            _real_cell(real, base) if real is None or real["setup"]["workload"] == ds else
            f"the real run has {real['setup']['workload']}'s shape: see the {real['setup']['workload']} rows"))
    p = drop["participation"]
    out.append(Claim(
        f"{ds}: every throttled instance takes part in a drop, no request lost",
        "the drop plan frees the queued demand of every throttled instance at once (Sec. 4.1, Fig. 6); "
        "requests are rescheduled, none dropped (Sec. 3)",
        f"throttled {p['throttled'] or 'none'}, in a drop {p['in_a_drop'] or 'none'}, never in one "
        f"{p['throttled_never_in_a_drop'] or 'none'}; {p['onsets_answered']} of {p['throttle_onsets']} throttle onsets "
        f"answered by a drop ({len(p['drops'])} drops); {drop['lost']} of {d['num_requests']} requests lost",
        bool(p["throttled"]) and not p["throttled_never_in_a_drop"] and drop["lost"] == 0,
        "the controller makes one plan at a time: an onset while another drop's exchange runs is answered only if "
        "the instance is still (or again) throttled when it ends (within 10 s here); one in a group that cannot "
        "grow (every layer held once) gets the autoscale signal instead (Sec. 4.4)",
        REAL if real is None else _real_events(real)))
    if LOOKAHEAD_OFF in rows:
        on, off = drop.get("bubble_ratio"), rows[LOOKAHEAD_OFF].get("bubble_ratio")
        sim = ("no pipeline ran (no drop)" if on is None or off is None
               else f"bubbles {on:.1%} with lookahead vs {off:.1%} with token-count microbatches")
        out.append(Claim(
            f"{ds}: lookahead microbatches cut pipeline bubbles", "lookahead balances microbatches by the "
            "chunk cost model, fewer bubbles than token-count splitting (Sec. 4.4, 5.3, Fig. 11)", sim,
            on is not None and off is not None and beats(off, on),
            "bubbles are read from the simulated pipeline's stage times (cost model), not measured kernels",
            REAL_BUBBLES))
    return out


def regime_text(d: dict[str, Any]) -> str:
    """How the rate and the pool were chosen, for the claim's cell (empty when the JSON has no regime)."""
    g = d.get("regime") or {}
    out = ""
    cap = g.get("capacity")
    if cap:
        out += (f"; busiest 20 s window {g['max_window_rate']:.1f} req/s = {g['max_window_share']:.0%} of the "
                f"{cap['capacity']:.1f} req/s compute capacity")
    if g.get("num_blocks"):
        ach = g.get("achieved") or {}
        out += (f"; KV pool {g['num_blocks']} blocks ({g['pool_gib']:.1f} GiB) = 2x vLLM's mean in use, which "
                f"peaks at {g['unlimited_peak_blocks'] / g['num_blocks']:.0%} of it"
                + (f"; with it vLLM's mean KV use {ach['mean_kv_use']:.0%}" if ach else ""))
    return out


def _slim(data: dict[str, Any]) -> dict[str, Any]:
    """The numbers the table uses (the bench's own JSON, next to this one, has the rest)."""
    keep = ("ttft_ms", "tpot_ms", "num_preemptions", "bubble_ratio", "completed", "failed", "lost", "mean_kv_demand",
            "participation")
    return {"setup": data["setup"], "datasets": {
        ds: {"rate": d["rate"], "num_requests": d["num_requests"], "p99_ttft_gain_over": d["p99_ttft_gain_over"],
             "regime": d.get("regime"),
             "systems": {k: {kk: v.get(kk) for kk in keep} for k, v in d["systems"].items()}}
        for ds, d in data["datasets"].items()}}
