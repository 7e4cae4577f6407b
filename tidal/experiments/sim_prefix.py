"""``tidal bench sim-prefix``: prefix caching and cache-aware routing at cluster scale, in the simulator.

On a trace whose requests name their prompt blocks (Mooncake's ``hash_ids``, 512 tokens an id;
default ``../shared/traces/mooncake_synthetic.jsonl``), with Qwen-2.5-14B on 8 x A100-80G:

- **caching** (issue 51): least-outstanding routing, prefix caching off, on with the KV pools alone,
  and on with a host tier of each size in ``--host-tiers`` (GiB per instance; ``ws``: one that
  holds the trace's whole working set). Per setup: the hit rate (pools and host tiers apart) beside
  the bounds (an unbounded cache; an LRU of each instance's capacity on the requests routed to it;
  one LRU of the cluster's combined capacity), TTFT p50/p99 at the trace's own rate, and the
  capacity (the highest rate at which ``--target`` of the requests meet ``--slo``).
- **routing** (issue 52): each router of ``--routers`` with prefix caching and the host tier
  ``--routing-tier``, over a sweep of rates from light load to past where least-outstanding misses
  the SLO: TTFT p50/p99, ITL p99, attainment, hit rate, the busiest instance's work over the mean
  (busy time), and each router's capacity.

The trace is one fixed replay; a conversation workload runs once per seed of ``--seeds`` (each draws
its own conversations), and every claim (:mod:`tidal.experiments.prefix_claims`) is judged on its
per-seed ratios by the reproductions' shared rule.

A rate is the trace's arrivals rescaled (``specs_at_rate``), so every rate replays the same requests
in the same order. Prompts longer than the model's context less their output are clipped (Mooncake's
trace has prompts past 32K tokens; Qwen-2.5-14B's context is 32K). Writes one JSON, PNG plots and,
with ``--page``, a generated markdown page. ``--jobs N`` runs independent simulations in parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

from tidal import metrics as M
from tidal import workload as W
from tidal.common.machine import machine_info, usable_cores
from tidal.common.results import command_line, run_command, run_stamp, write_json
from tidal.experiments.parallel import run_all

PROG = "tidal bench sim-prefix"
DEFAULT_TRACE = "mooncake_synthetic.jsonl"
DEFAULT_CONVERSATION = "conversation:system=1000,turns_mean=5,think=10"
GIB = 1024**3
CAPACITY_HIGH = 8.0  # the capacity searches run from 1/32 to this many times the workload's own rate


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-prefix", help="prefix caching and cache-aware routing at cluster scale (simulated)",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help=f"a trace with hash_ids (default: the shared {DEFAULT_TRACE})")
    p.add_argument("--workloads", default=f"trace,{DEFAULT_CONVERSATION}",
                   help="comma-separated: trace (--trace's), and/or a conversation workload spec "
                        "(tidal.workload.conversation; its --rate is conversation starts per second)")
    p.add_argument("--conversation-rate", type=float, default=4.0,
                   help="the conversation workload's own start rate (conversations/s), its 'trace rate'")
    p.add_argument("--conversation-requests", type=int, default=3000, help="turns of the conversation workload")
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds of a conversation workload (each draws its own conversations; every claim is judged "
                        "per seed); the trace is one fixed replay")
    p.add_argument("--model", default="qwen-2.5-14b")
    p.add_argument("--hardware", default="a100-80g")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--host-tiers", default="64,256,ws",
                   help="host tiers (GiB per instance) of the caching study; ws: the trace's working set")
    p.add_argument("--routers", default="least-outstanding,cache-aware")
    p.add_argument("--routing-tier", default="256", help="the host tier (GiB per instance, or ws) of the routing study")
    p.add_argument("--rates", default=None, help="the routing sweep's rates, req/s (default: from the trace's rate)")
    p.add_argument("--slo", default="ttft=2000,tbt=100")
    p.add_argument("--target", type=float, default=0.9, help="share of requests that must meet the SLO")
    p.add_argument("--search-tolerance", type=float, default=0.05)
    p.add_argument("--num-requests", type=int, default=None, help="the trace's first N requests (default: all)")
    p.add_argument("--parts", default="caching,routing")
    p.add_argument("--jobs", type=int, default=usable_cores())
    p.add_argument("--output", default="results/sim_prefix")
    p.add_argument("--page", default=None, help="also write the generated markdown page here (docs/cache.md)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="rewrite the figures (and --page) from --output's sim_prefix.json without simulating")


# ============================================================================ one simulation (a worker process)
def simulate(cfg: dict[str, Any], specs: list[W.RequestSpec], slo: M.SLO) -> dict[str, Any]:
    from tidal.sim.build import ClusterSpec
    from tidal.sim.run import simulate as run_one

    spec = ClusterSpec(**cfg)
    decisions: list[Any] | None = [] if cfg.get("router") == "cache-aware" else None
    out = run_one(spec, specs, slo, progress=False, recorder=decisions.append if decisions is not None else None)
    busy = [i["busy_time_s"] for i in out["instances"]]
    mean = sum(busy) / len(busy) if busy else 0.0
    keep = ("completed", "failed", "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms",
            "slo_attainment", "prefix_cache", "simulated_time_s", "wall_time_s")
    res = {k: out.get(k) for k in keep}
    res["load_max_over_mean"] = max(busy) / mean if mean > 0 else None
    res["by_prompt_length"] = by_length(out["requests"], slo)
    res["errors"] = out.get("errors")
    if decisions:
        res["ttft_prediction"] = prediction_audit(decisions, out["requests"])
    return res


def prediction_audit(decisions: list[Any], requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The cache-aware router's TTFT prediction for the instance it chose, replayed from each decision's
    record (:func:`tidal.cluster.decisions.monitor_of`), against the TTFT the request then had: the
    quantiles of realized / predicted, overall and by prompt length."""
    import numpy as np

    from tidal.cluster.cache_router import predicted_ttft
    from tidal.cluster.decisions import monitor_of

    ttft = {str(r["index"]): (r["ttft_s"], r["prompt_len"]) for r in requests if r.get("ttft_s")}
    ratios: list[tuple[float, int]] = []
    for d in decisions:
        if d.kind != "dispatch" or d.choice is None or d.request_id not in ttft or d.request is None:
            continue
        live = [v.index for v in d.views if v.alive and v.role != "decode"]
        k = live.index(d.choice)
        cached = d.request.cached[k] if d.request.cached else 0
        predicted = predicted_ttft(monitor_of(d.views).instances[d.choice], d.request.prompt_len, cached)
        if predicted > 0:
            ratios.append((ttft[d.request_id][0] / predicted, ttft[d.request_id][1]))

    def q(xs: list[float]) -> dict[str, Any]:
        if not xs:
            return {"count": 0}
        p10, p50, p90 = np.percentile(xs, [10, 50, 90])
        return {"count": len(xs), "p10": float(p10), "p50": float(p50), "p90": float(p90)}

    out = {"all": q([x for x, _ in ratios])}
    for lo, hi in zip(LENGTH_EDGES, LENGTH_EDGES[1:], strict=False):
        out[f"{lo}-{hi if hi < 1 << 30 else ''}"] = q([x for x, n in ratios if lo <= n < hi])
    return out


LENGTH_EDGES = (0, 4000, 8000, 12000, 20000, 1 << 30)


def by_length(requests: list[dict[str, Any]], slo: M.SLO) -> list[dict[str, Any]]:
    """Per prompt-length band: requests, TTFT p50 and the share within the TTFT SLO (what a long prompt's
    prefill alone costs shows here)."""
    import numpy as np

    out = []
    for lo, hi in zip(LENGTH_EDGES, LENGTH_EDGES[1:], strict=False):
        band = [r for r in requests if lo <= r["prompt_len"] < hi]
        t = [r["ttft_s"] for r in band if r["ttft_s"] is not None]
        ok = [x <= slo.ttft_s for x in t] if slo.ttft_s is not None else []
        out.append({"from": lo, "to": hi if hi < 1 << 30 else None, "requests": len(band),
                    "ttft_p50_ms": 1000 * float(np.median(t)) if t else None,
                    "within_ttft_slo": sum(ok) / len(band) if band and ok else None})
    return out


def _capacity(cfg: dict[str, Any], base: list[W.RequestSpec], slo: M.SLO, target: float, low: float, high: float,
              tolerance: float) -> dict[str, Any]:
    """The capacity search of one setup, probe by probe (each probe the same requests, rescaled)."""
    search = M.CapacitySearch(low, high, target, tolerance=tolerance, max_probes=8)
    while (rate := search.next_rate()) is not None:
        r = simulate(cfg, W.specs_at_rate(base, rate, None), slo)
        search.record(rate, r["slo_attainment"] or 0.0, {"ttft_ms": r["ttft_ms"], "hit_rate": _hit(r)})
    return search.report()


def _hit(r: dict[str, Any]) -> float | None:
    pc = r.get("prefix_cache")
    return pc["hit_rate"] if pc else None


# ============================================================================ the experiment
def working_set_gib(specs: list[W.RequestSpec], cfg: dict[str, Any]) -> float:
    """The KV of every distinct full block of the trace's prompts, per instance (GiB)."""
    from tidal.sim.instance import spec_block_names
    from tidal.sim.models import get_model

    names: set[bytes] = set()
    bs = cfg["block_size"]
    for k, s in enumerate(specs):
        names.update(spec_block_names(s, bs, str(k).encode()))
    per_block = bs * get_model(cfg["model"]).kv_bytes_per_token(cfg["dtype_bytes"])
    return len(names) * per_block / cfg["instances"] / GIB


def split_workloads(text: str) -> list[str]:
    """``--workloads``' items: a piece ``key=value`` (no ``:``) continues the workload spec before it
    (``trace,conversation:system=1000,turns_mean=5`` is two workloads)."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if out and "=" in piece and ":" not in piece and out[-1] != "trace":
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def load_workloads(name: str, args: argparse.Namespace,
                   max_len: int) -> list[tuple[str, list[W.RequestSpec], float, int | None]]:
    """(label, requests, their own rate, seed) of one workload of ``--workloads``: the trace once (a fixed
    replay), a conversation workload once a seed."""
    if name == "trace":
        specs = load_trace(args, max_len)
        return [(os.path.basename(args.trace or DEFAULT_TRACE), specs,
                 W.mean_rate([s.arrival_s for s in specs]) or 1.0, None)]
    out = []
    for seed in range(max(1, args.seeds)):
        specs = W.make_requests(W.WorkloadOptions(workload=name, num_requests=args.conversation_requests,
                                                  rate=args.conversation_rate, max_input_len=max_len // 2,
                                                  max_output_len=max_len // 4, seed=seed))
        out.append((f"{name} (seed {seed})", specs, args.conversation_rate, seed))
    return out


def load_trace(args: argparse.Namespace, max_len: int) -> list[W.RequestSpec]:
    path = args.trace or os.path.join(W.default_traces_dir(), DEFAULT_TRACE)
    specs = W.make_requests(W.WorkloadOptions(trace=path, num_requests=args.num_requests,
                                              traces_dir=W.default_traces_dir()))
    out = []
    for s in specs:  # clip to the context: the prompt loses its tail (its hash ids stay, only those it covers count)
        out.append(replace(s, prompt_len=max(1, min(s.prompt_len, max_len - s.output_len))))
    if not any(s.hash_ids for s in out):
        raise W.WorkloadError(f"{path}: no request has hash_ids; the prefix study needs a trace that names its blocks")
    return out


def tier_bytes(text: str, ws_gib: float) -> int:
    return int(round(ws_gib * 1.02 + 1) * GIB) if text == "ws" else int(float(text) * GIB)


def run_experiment(args: argparse.Namespace, log) -> dict[str, Any]:
    from tidal.sim.build import ClusterSpec, resolve

    slo = M.parse_slo(args.slo)
    base_cfg = {"model": args.model, "hardware": args.hardware, "instances": args.instances, "tp": 1,
                "dtype_bytes": 2, "block_size": 16, "enable_prefix_caching": True}
    _, _, blocks, max_len = resolve(ClusterSpec(**base_cfg))
    out: dict[str, Any] = {"model": args.model, "hardware": args.hardware, "instances": args.instances,
                           "kv_blocks_per_instance": blocks, "slo": args.slo, "target": args.target, "workloads": []}
    t0 = time.perf_counter()
    for name in split_workloads(args.workloads):
        for label, specs, rate, seed in load_workloads(name, args, max_len):
            log(f"{label}: {len(specs)} requests at {rate:.2f}/s")
            w = run_workload(args, log, slo, base_cfg, label, specs, rate, t0)
            w.update({"family": name, "seed": seed})
            out["workloads"].append(w)
    from tidal.experiments.prefix_claims import claims

    out["claims"] = claims(out, args.search_tolerance)
    out["wall_time_s"] = time.perf_counter() - t0
    return out


def run_workload(args: argparse.Namespace, log, slo: M.SLO, base_cfg: dict[str, Any], label: str,
                 specs: list[W.RequestSpec], trace_rate: float, t0: float) -> dict[str, Any]:
    ws = working_set_gib(specs, base_cfg)
    log(f"  working set {ws:.0f} GiB an instance")
    out: dict[str, Any] = {"workload": label, "num_requests": len(specs), "trace_rate": trace_rate,
                           "working_set_gib_per_instance": ws, **W.length_stats(specs)}
    parts = set(args.parts.split(","))

    def done(what):
        return lambda i, r: log(f"  [{time.perf_counter() - t0:6.0f} s] {label}: {what(i)}")

    rates = ([float(x) for x in args.rates.split(",")] if args.rates
             else [round(trace_rate * f, 3) for f in (1 / 8, 1 / 4, 1 / 2, 3 / 4, 1, 3 / 2)])
    high = trace_rate * CAPACITY_HIGH
    if "caching" in parts:
        setups = [("off", {"enable_prefix_caching": False}), ("pool", {})]
        setups += [(f"host {t} GiB" if t != "ws" else f"host {tier_bytes(t, ws) // GIB} GiB (working set)",
                    {"kv_offloading_size": tier_bytes(t, ws)}) for t in args.host_tiers.split(",") if t]
        cfgs = [{**base_cfg, "router": "least-outstanding", **extra} for _, extra in setups]
        at_trace = run_all(simulate, [(c, specs, slo) for c in cfgs], args.jobs,
                           done(lambda i: f"caching {setups[i][0]}: at its own rate"))
        calls = [(c, W.specs_at_rate(specs, rate, None), slo) for c in cfgs for rate in rates]
        sweep = run_all(simulate, calls, args.jobs,
                        done(lambda i: f"caching {setups[i // len(rates)][0]} at {rates[i % len(rates)]}/s"))
        caps = run_all(_capacity, [(c, specs, slo, args.target, trace_rate / 32, high, args.search_tolerance)
                                   for c in cfgs], args.jobs, done(lambda i: f"caching {setups[i][0]}: capacity"))
        out["caching_rates"] = rates
        out["caching"] = [{"setup": name, "config": {k: v for k, v in c.items() if k in ("kv_offloading_size",
                                                                                          "enable_prefix_caching")},
                           "at_trace_rate": r, "sweep": sweep[k * len(rates):(k + 1) * len(rates)], "capacity": cap}
                          for k, ((name, _), c, r, cap) in enumerate(zip(setups, cfgs, at_trace, caps, strict=True))]
    if "routing" in parts:
        routers = [r for r in args.routers.split(",") if r]
        tier = tier_bytes(args.routing_tier, ws)
        cfgs = [{**base_cfg, "router": r, "kv_offloading_size": tier} for r in routers]
        calls = [(c, W.specs_at_rate(specs, rate, None), slo) for c in cfgs for rate in rates]
        sweep = run_all(simulate, calls, args.jobs,
                        done(lambda i: f"routing {routers[i // len(rates)]} at {rates[i % len(rates)]}/s"))
        caps = run_all(_capacity, [(c, specs, slo, args.target, trace_rate / 32, high, args.search_tolerance)
                                   for c in cfgs], args.jobs, done(lambda i: f"routing {routers[i]}: capacity"))
        out["routing"] = {"host_tier_gib": tier / GIB, "rates": rates,
                          "routers": {r: {"sweep": sweep[k * len(rates):(k + 1) * len(rates)], "capacity": caps[k]}
                                      for k, r in enumerate(routers)}}
    return out


# ============================================================================ output
def run(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        if not args.no_progress:
            print(msg, file=sys.stderr, flush=True)

    def work() -> dict[str, Any]:
        path = os.path.join(args.output, "sim_prefix.json")
        if args.replot:
            if not os.path.exists(path):
                raise ValueError(f"--replot: no {path} (run without --replot first)")
            with open(path, encoding="utf-8") as fh:
                res = json.load(fh)
        else:
            res = run_experiment(args, log)
            res.update({"command": command_line(PROG), "machine": machine_info(), **run_stamp()})
            os.makedirs(args.output, exist_ok=True)
            write_json(res, path)
        from tidal.experiments.prefix_page import write_page, write_plots

        figures = write_plots(res, args.output)
        if args.page:
            write_page(res, args.page, figures, args.output)
        return res

    def done(res: dict[str, Any]) -> int:
        from tidal.experiments.prefix_page import summary_lines

        print("\n".join(summary_lines(res)))
        print(f"wrote {args.output}" + (f" and {args.page}" if args.page else ""))
        return 0

    return run_command(PROG, work, done, (ValueError, W.WorkloadError))


__all__ = ["add_arguments", "add_parser", "run", "run_experiment", "simulate"]
