"""``tidal bench sim-dynaserve``: DynaServe's evaluation (Sec. 6) in the simulator.

The paper's setup (Sec. 6.1): Qwen-2.5-14B with one A100-80G per instance, Qwen-2.5-32B with two
and Qwen-2.5-72B with four (tensor parallel); two instances in all three systems: **PD Coloc.**
(both colocated, chunked prefill; the paper tunes the chunk between 256 and 2048, here 256, 512
and 2048, the best one per workload counts), **PD Disagg.** (1 prefill + 1 decode instance: the
paper's 1P1D, 2P2D and 4P4D GPUs) and **DynaServe** (one alpha/beta pair, ``--mode split``,
SLO-aware local batching ``slo-compose``, Alg. 2). Where each request's two micro-requests run:

- ``dynaserve-load``: **the paper's placement** (Sec. 1: "any instance can process any
  micro-request"; Sec. 3.1: the scheduler "selects a placement plan (micro-request to executor)
  that minimizes load imbalance and maximizes throughput"): Alg. 1 runs on both orientations of
  the pair and the one with the least predicted max(T_alpha, T_beta) wins; no TTFT target (Alg. 1
  has none; the SLO it keeps is the local scheduler's TBT);
- ``dynaserve``: fixed roles (instance 0 is every request's alpha; Sec. 6.1's "1 GPU each for
  r^alpha and r^beta" read literally);
- ``dynaserve-place``: tidal's idea, labelled as such: load placement with the ``--ttft-p50-ms``
  bound as a constraint of Alg. 1's search (:class:`tidal.cluster.split.SplitParams`);
- ``dynaserve-noslo``: load placement with vLLM's chunked prefill (2,048) instead of Alg. 2: Fig.
  11's ablation "without SLO-aware batching".

``coloc-slo`` (colocated with ``slo-compose``) separates DynaServe's local scheduler from its
splits. DynaServe streams each request's KV from its first chunk (Sec. 4.3), so beta holds a copy
of what alpha still attends to for all of alpha's decoding; ``dynaserve-lead`` starts 64 tokens
before the split point; ``dynaserve-kv`` adds our KV-aware execution predictor
(``--split-kv-aware``). ``slo-compose`` runs as DynaServe describes it: its table starts from an
offline profile (the cost model on a grid) and is refined with every step; it aims at 80 % of the
SLO (the table predicts means), and less by what its decodes have already waited (``catch_up``: a
hand-off that landed mid-step). Poisson arrivals (Sec. 6.1); workloads: BurstGPT, Azure Code,
arXiv summarization, Mini Reasoning (Fig. 8-9) and the hybrid of BurstGPT and Azure Code half
and half (Table 2).

**Seeds** (``--seeds N``): each seed draws its own requests and arrivals (and the step tails'
stream); every system's capacity is searched on every seed, and the ratios are per seed.

**Serving capacity**, two definitions, each its own search over the same probes:

- **the paper's** (Sec. 6.3, "the maximum sustainable QPS under SLO constraints ... allowing only
  1% of requests to violate the TBT SLO"): the highest rate at which at least 99 % of the
  requests keep the 99th percentile of their own gaps between tokens within ``--tbt-slo-ms``,
  while the system sustains the rate: its queue does not grow (the median TTFT of the last
  quarter of the arrivals is at most twice the first quarter's plus 1 s; a queue that grows, of
  prefills, hand-offs or admissions waiting for KV, fails it). No bound on the TTFT itself, as in
  the paper.
- **TTFT-guarded** (tidal's, the top-level fields): the same attainment, with a gap over 10 x the
  SLO also failing a request (a stall the percentile of a long output would hide), and the
  system keeps up only while the median TTFT is at most ``--ttft-p50-ms`` (2 s: Sarathi-Serve's
  "median scheduling delay" bound), so a saturated prefill instance does not pass on its decodes
  alone while its queue grows.

Each probe offers ``--window`` seconds of Poisson arrivals (at most ``--num-requests``), long
enough for queues to form once the instances' seats are full (a short burst fits in them and
never queues). A probe that does not keep up counts as attainment 0 for
:class:`tidal.metrics.CapacitySearch`; each search records its final bracket (its resolution).
**Goodput**: output tokens per second of the requests that met the TBT SLO, at the capacity and the
highest over the rates that kept up (Fig. 8). A split probe also records each instance's mean
running sequences and where the decode tokens ran (:mod:`tidal.experiments.dynaserve_stats`).
``--step-jitter fitted`` gives the steps the tails fitted to the paper's Table 1 baselines
(:mod:`tidal.sim.jitter`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal import workload as W
from tidal.common import flags as F
from tidal.common.machine import machine_info, usable_cores
from tidal.common.results import command_line, write_result
from tidal.experiments.dynaserve_stats import (
    GROWTH_FACTOR,
    GROWTH_SLACK_S,
    attains,
    bracket,
    cap_ratio,
    emission_ratio,
    instance_loads,
    queue_growth,
    split_tokens,
    sustained,
)
from tidal.experiments.parallel import run_all
from tidal.metrics import CapacitySearch, summarize

PROG = "tidal bench sim-dynaserve"
MODELS = {"qwen-2.5-14b": 1, "qwen-2.5-32b": 2, "qwen-2.5-72b": 4}  # tensor parallel per instance (Sec. 6.1)
WORKLOADS: dict[str, dict[str, Any]] = {
    "burstgpt": {"workload": "burstgpt", "burstiness": 1.0},  # the shape, Poisson arrivals
    "azure-code": {"workload": "azure-code"},
    "arxiv": {"workload": "arxiv-lengths", "max_input_len": 16384},
    "mini-reasoning": {"workload": "dynaserve-219-1467"},  # Sec. 2.4's shape of Mini Reasoning
    # Table 2: half BurstGPT, half Azure Code, with the paper's ~66 output tokens a request
    "hybrid": {"workload": "mix:burstgpt-dynaserve=0.5,azure-code=0.5"},
    "hybrid-262": {"workload": "mix:burstgpt=0.5,azure-code=0.5"},  # BurstGPT's own outputs (262): ~145 a request
}
PLACEMENTS = ("fixed", "load", "load-ttft")  # split: where a request's alpha and beta run (module docstring)


@dataclass(frozen=True)
class System:
    mode: str
    batching: str
    chunk: int  # max_num_batched_tokens
    kv_aware: bool = False  # split: the planner's predictor obeys the KV pool (our addition)
    stream_lead: int | None = None  # split: push KV only from this many tokens before s (None: Sec. 4.3)
    placement: str = "fixed"  # split: one of PLACEMENTS

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got {self.placement!r}")


SYSTEMS = {
    "coloc-256": System("colocate", "continuous", 256),
    "coloc-512": System("colocate", "continuous", 512),
    "coloc-2048": System("colocate", "continuous", 2048),
    "coloc-slo": System("colocate", "slo-compose", 2048),
    "disagg": System("disaggregate", "continuous", 2048),
    "dynaserve": System("split", "slo-compose", 2048),
    "dynaserve-load": System("split", "slo-compose", 2048, placement="load"),
    "dynaserve-lead": System("split", "slo-compose", 2048, stream_lead=64),
    "dynaserve-kv": System("split", "slo-compose", 2048, kv_aware=True, stream_lead=64),
    "dynaserve-place": System("split", "slo-compose", 2048, placement="load-ttft"),
    "dynaserve-noslo": System("split", "continuous", 2048, placement="load"),
}
DEFAULT_SYSTEMS = ("coloc-256", "coloc-512", "coloc-2048", "disagg", "dynaserve-load", "dynaserve", "dynaserve-place")
COLOC = ("coloc-256", "coloc-512", "coloc-2048")  # PD Coloc. is the best of its tuned chunks
TABLE1_CHUNK = "coloc-2048"  # Table 1's (and vLLM's default) chunk: the other reading of "tuned"
DYNA = ("dynaserve-load", "dynaserve", "dynaserve-lead", "dynaserve-kv", "dynaserve-place", "dynaserve-noslo")
HEADLINE = "dynaserve-load"  # the paper's placement: the claims' DynaServe
PAPER = {
    "capacity": "DynaServe 1.15-3.07x PD Coloc., 1.09-1.67x PD Disagg. (Sec. 1, Fig. 9; 14B: on average 2.37x "
                "and 1.37x, Sec. 6.3)",
    "goodput": "up to 1.91x PD Coloc. and 1.61x PD Disagg. (Fig. 8)",
    "hybrid": "capacity 4.6 / 5.9 / 7.4 rps and goodput 316 / 399 / 474 tok/s for PD Coloc. / PD Disagg. / "
              "DynaServe (Table 2, 14B)",
}


def cluster_spec(model: str, system: System, tbt_s: float, ttft_p50_s: float, stream_lead: int | None = None,
                 local_scale: float = 0.8, catch_up: bool = True, seed_profile: bool = True,
                 step_jitter: str = "off", seed: int = 0, length_mode: str = "max-tokens") -> Any:
    """The two instances of ``system`` serving ``model`` (Sec. 6.1), as a simulator spec."""
    from tidal.cluster.split import SplitParams
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec

    slo = system.batching == "slo-compose"
    args = {"slo-compose.slo_scale": local_scale, "slo-compose.catch_up": catch_up} if slo else {}
    sched = SchedulerConfig(batching=system.batching, max_num_batched_tokens=system.chunk, max_num_seqs=256,
                            tbt_slo_ms=tbt_s * 1000.0, policy_args=args)
    split = None
    if system.placement != "fixed":  # Alg. 1 on both orientations; the TTFT target only for load-ttft
        split = SplitParams(flip_roles=True, ttft_target_s=ttft_p50_s if system.placement == "load-ttft" else None)
    is_split = system.mode == "split"
    return ClusterSpec(model=model, hardware="a100-80g", instances=2, tp=MODELS[model], mode=system.mode,
                       prefill_instances=1 if system.mode == "disaggregate" else 0, scheduler=sched,
                       kv_stream_lead=(stream_lead if stream_lead is not None else system.stream_lead)
                       if is_split else None, seed_profile=slo and seed_profile,
                       split_kv_aware=system.kv_aware, step_jitter=step_jitter, jitter_seed=seed, split=split,
                       split_length=length_mode if is_split else "max-tokens")


def run_probe(model: str, system: System, specs: list[W.RequestSpec], tbt_s: float, ttft_p50_s: float,
              stream_lead: int | None, local_scale: float = 0.8, catch_up: bool = True,
              seed_profile: bool = True, step_jitter: str = "off", seed: int = 0,
              length_mode: str = "max-tokens", keep_records: bool = False) -> dict[str, Any]:
    from tidal.sim.build import build_simulator
    from tidal.sim.split import summarize_splits

    spec = cluster_spec(model, system, tbt_s, ttft_p50_s, stream_lead, local_scale, catch_up, seed_profile,
                        step_jitter, seed, length_mode)
    res = build_simulator(spec, specs).run()
    s = summarize(res.records)
    good = [r for r in res.records if attains(r, tbt_s)]
    dur = s["duration_s"] or 1.0
    kept_up = s["ttft_ms"]["p50"] is not None and s["ttft_ms"]["p50"] <= ttft_p50_s * 1000.0
    paper_good = [r for r in res.records if attains(r, tbt_s, stall=False)]
    first_q, last_q = queue_growth(res.records)
    out = {"attainment": len(good) / len(res.records), "kept_up": kept_up,
           "paper_attainment": len(paper_good) / len(res.records), "paper_kept_up": sustained(res.records),
           "ttft_first_quarter_ms": None if first_q is None else first_q * 1e3,
           "ttft_last_quarter_ms": None if last_q is None else last_q * 1e3,
           "emission_ratio": emission_ratio(res.records, specs), "paper_goodput_tok_s": sum(r.output_tokens for r in paper_good) / dur,
           "goodput_tok_s": sum(r.output_tokens for r in good) / dur,
           "throughput_tok_s": s["output_throughput"], "completed": s["completed"],
           "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
           "tbt_p50_ms": s["itl_ms"]["p50"], "tbt_p99_ms": s["itl_ms"]["p99"], "tbt_max_ms": s["itl_ms"]["max"],
           "preemptions": sum(i["num_preemptions"] for i in res.instances),
           "busy_s": [i["busy_time_s"] for i in res.instances],
           "instances": instance_loads(res.timelines, res.instances, res.simulated_time_s)}
    if res.splits:
        sp = summarize_splits(res.splits)
        out["splits"] = {k: sp[k] for k in ("handoffs", "inside_prompt", "at_prompt_end", "inside_output",
                                            "whole_on_alpha", "whole_on_beta", "finished_on_alpha",
                                            "kv_bytes_total", "exposed_vs_whole")}
        out["splits"]["phi_p50"] = sp["phi"]["p50"]
        out["splits"]["exposed_ms_p99"] = sp["exposed_transfer_ms"]["p99"]
        out["splits"]["tokens"] = split_tokens(res.splits, specs, len(res.instances))
    if keep_records:
        out["records"] = res.records
    return out


DEFINITIONS = ("ttft", "paper")  # the TTFT-guarded capacity and the paper's (Sec. 6.3)


def _verdict(p: dict[str, Any], definition: str) -> float:
    """A probe's attainment under a capacity definition (0 when the system did not keep up)."""
    if definition == "paper":
        return p["paper_attainment"] if p["paper_kept_up"] else 0.0
    return p["attainment"] if p["kept_up"] else 0.0


def capacity(model: str, system: System, base: list[W.RequestSpec], args: argparse.Namespace, label: str,
             seed: int | None = None) -> dict[str, Any]:
    """Both capacities (:data:`DEFINITIONS`), each its own search over the same probes (a rate probed
    once is reused), on one seed's requests ``base`` (the step tails' stream: ``seed``, default
    ``args.seed``). The TTFT-guarded one's fields are at the top level; the paper's under ``paper``;
    each with its search's final bracket (``first_failing_rps``, ``bracket``: hi / lo - 1)."""
    seed = args.seed if seed is None else seed
    probes: dict[float, dict[str, Any]] = {}
    found: dict[str, dict[str, Any]] = {}
    for definition in DEFINITIONS:
        search = CapacitySearch(args.rate_low, args.rate_high, args.target, tolerance=args.tolerance,
                                max_probes=args.max_probes)
        while (rate := search.next_rate()) is not None:
            if rate not in probes:
                t0 = time.perf_counter()
                specs = W.specs_at_rate(base, rate, args.window)
                p = run_probe(model, system, specs, args.tbt_slo_ms / 1000.0,
                              args.ttft_p50_ms / 1000.0, args.kv_stream_lead, args.local_slo_scale,
                              not args.no_catch_up, not args.no_seed_profile, args.step_jitter, seed)
                p["rate"] = rate
                p["num_requests"] = len(specs)
                probes[rate] = p
                if not args.no_progress:
                    print(f"  {label:<52} rate {rate:7.3f}: {100 * p['attainment']:5.1f}% attain"
                          f"{'' if p['kept_up'] else ' (behind)'}, paper {100 * p['paper_attainment']:5.1f}%"
                          f"{'' if p['paper_kept_up'] else ' (behind)'}, goodput "
                          f"{p['goodput_tok_s']:7.0f} tok/s, TBT p99 {p['tbt_p99_ms'] or 0:6.1f} ms, TTFT p50 "
                          f"{p['ttft_p50_ms'] or 0:7.0f} ms ({time.perf_counter() - t0:.1f} s)", flush=True)
            search.record(rate, _verdict(probes[rate], definition))
        cap = search.capacity
        hi = search.bracket[1]
        at = probes.get(cap) if cap is not None else None
        gp = "paper_goodput_tok_s" if definition == "paper" else "goodput_tok_s"
        kept = "paper_kept_up" if definition == "paper" else "kept_up"
        found[definition] = {"capacity_rps": cap, "first_failing_rps": hi, "bracket": bracket(cap, hi),
                             "note": search.note, "goodput_at_capacity": at[gp] if at else None,
                             "max_goodput": max((p[gp] for p in probes.values() if p[kept]), default=None),
                             "at_capacity": at}
    return {**found["ttft"], "seed": seed, "paper": found["paper"], "probes": [probes[r] for r in sorted(probes)]}


def _view(row: dict[str, Any], definition: str) -> dict[str, Any]:
    return row["paper"] if definition == "paper" else row


def tuned_coloc(rows: dict[str, list[dict[str, Any]]], key: str = "capacity_rps", definition: str = "paper"
                ) -> str | None:
    """The workload's tuned PD Coloc. (Sec. 6.1: "chunk sizes tuned between 256-2048 for each
    workload"): the chunk whose median ``key`` over the seeds is highest, one chunk for every seed."""
    best: tuple[float, str] | None = None
    for n in COLOC:
        if n not in rows:
            continue
        v = float(np.median([_view(r, definition)[key] or 0.0 for r in rows[n]]))
        if best is None or v > best[0]:
            best = (v, n)
    return best[1] if best else None


def seed_ratios(rows: dict[str, list[dict[str, Any]]], dyna_name: str = HEADLINE, definition: str = "paper",
                rate_low: float = 0.25, rate_high: float | None = None) -> dict[str, Any]:
    """``dyna_name`` over each baseline, one ratio a seed: capacity (``rate_low``: a side that met no
    rate is below it, so its ratio is a bound) and the highest goodput; baselines ``coloc`` (the tuned
    chunk), ``coloc_2048`` (Table 1's), ``disagg`` and ``best`` (goodput: the better of tuned PD Coloc.
    and PD Disagg., seed by seed). ``tolerance`` is the widest bracket of the searches a ratio
    reads (a capacity ratio cannot be told apart inside it)."""
    dyna = rows.get(dyna_name)
    if not dyna:
        return {}
    out: dict[str, Any] = {"definition": definition}
    coloc = tuned_coloc(rows, "capacity_rps", definition)
    bases = {"coloc": coloc, "coloc_2048": TABLE1_CHUNK if TABLE1_CHUNK in rows else None,
             "disagg": "disagg" if "disagg" in rows else None}
    cap: dict[str, Any] = {}
    for label, name in bases.items():
        if name is None:
            continue
        ratios, bounds, tol = [], [], 0.0
        for d, b in zip(dyna, rows[name], strict=True):
            dv, bv = _view(d, definition), _view(b, definition)
            r, bound = cap_ratio(dv["capacity_rps"], bv["capacity_rps"], rate_low)
            bound = bound or (rate_high is not None and max(dv["capacity_rps"] or 0, bv["capacity_rps"] or 0) >= rate_high)
            ratios.append(r)
            bounds.append(bound)
            tol = max(tol, dv.get("bracket", 0.0) or 0.0, bv.get("bracket", 0.0) or 0.0)
        cap[label] = {"system": name, "per_seed": ratios, "bound": bounds, "tolerance": tol,
                      "technique": [_view(d, definition)["capacity_rps"] for d in dyna],
                      "baseline": [_view(b, definition)["capacity_rps"] for b in rows[name]]}
    out["capacity_rps"] = cap
    good: dict[str, Any] = {}
    coloc_g = tuned_coloc(rows, "max_goodput", definition)
    for label, name in {"coloc": coloc_g, "disagg": bases["disagg"], "best": "best"}.items():
        if name is None:
            continue
        tech, base = [], []
        for i, d in enumerate(dyna):
            tech.append(_view(d, definition)["max_goodput"])
            if name == "best":
                vals = [_view(rows[n][i], definition)["max_goodput"] or 0.0 for n in (coloc_g, "disagg") if n in rows]
                base.append(max(vals, default=0.0) or None)
            else:
                base.append(_view(rows[name][i], definition)["max_goodput"])
        ratios = [t / b if t and b else None for t, b in zip(tech, base, strict=True)]
        good[label] = {"system": name, "per_seed": ratios, "technique": tech, "baseline": base, "tolerance": 0.0}
    out["max_goodput"] = good
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-dynaserve", help="DynaServe (split) vs colocation vs P/D in the simulator (Sec. 6)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen-2.5-14b", help=f"of {', '.join(MODELS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--seeds", type=F.positive_int, default=1,
                   help="seeds per cell (--seed, --seed + 1, ...): each its own requests, arrivals and step tails")
    p.add_argument("--tbt-slo-ms", type=float, default=100.0, help="the TBT SLO (Sec. 6.1: 100 ms)")
    p.add_argument("--ttft-p50-ms", type=float, default=2000.0,
                   help="a rate is sustained only while the median TTFT stays within this (Sarathi-Serve: 2 s)")
    p.add_argument("--target", type=float, default=0.99, help="share of requests that must meet the SLOs")
    p.add_argument("--rate-low", type=float, default=0.25)
    p.add_argument("--rate-high", type=float, default=32.0)
    p.add_argument("--tolerance", type=float, default=0.04, help="capacity search stops at hi/lo <= 1 + this")
    p.add_argument("--max-probes", type=int, default=10)
    p.add_argument("--window", type=float, default=240.0,
                   help="seconds of arrivals per probe (at most --num-requests): long enough for queues to form "
                        "once the instances' seats (max_num_seqs 256 each) are full")
    p.add_argument("--local-slo-scale", type=float, default=0.8,
                   help="slo-compose aims at this share of the TBT SLO (its profile table predicts means; at 1.0 "
                        "steps land just past the SLO)")
    p.add_argument("--no-catch-up", action="store_true",
                   help="slo-compose without catch_up (a step aims at the SLO less the longest wait of its decodes)")
    p.add_argument("--no-seed-profile", action="store_true",
                   help="slo-compose's table starts empty instead of from an offline profile of the cost model")
    p.add_argument("--kv-stream-lead", type=int, default=None,
                   help="every DynaServe system: alpha starts pushing a request's KV this many tokens before its "
                        "split point (default: dynaserve from its first chunk, Sec. 4.3; dynaserve-lead 64 before)")
    p.add_argument("--step-jitter", choices=("off", "fitted"), default="off",
                   help="step-time tails (tidal.sim.jitter): off, the mean model; fitted, the testbed (tails and "
                        "prefill attention) calibrated to the paper's Table 1 baselines (`tidal bench calibrate-jitter`)")
    p.add_argument("--jobs", type=F.positive_int, default=1,
                   help=f"capacity searches at once, each a process of its own (this machine: {usable_cores()} cores)")
    F.add_workload_flags(p, only=("num_requests", "seed"), defaults={"num_requests": 2000})
    F.add_output_flags(p, "results/sim_dynaserve.json")
    p.set_defaults(func=run)


def _names(text: str, known: dict[str, Any], what: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown {what} {bad[0] if bad else text!r}; available: {', '.join(known)}")
    return names


def _table(rows: dict[str, list[dict[str, Any]]]) -> None:
    print(f"  {'system':<16}{'seed':>5}{'capacity (TTFT-guarded)':>24}{'paper capacity':>16}{'bracket':>9}"
          f"{'max goodput':>13}{'TBT p99':>9}{'TTFT p50':>10}")
    for name, per_seed in rows.items():
        for r in per_seed:
            p = r["paper"]
            at = p["at_capacity"] or {}
            print(f"  {name:<16}{r['seed']:>5}{r['capacity_rps'] or 0:>24.3f}{p['capacity_rps'] or 0:>16.3f}"
                  f"{100 * p['bracket']:>8.1f}%{p['max_goodput'] or 0:>13.0f}{at.get('tbt_p99_ms') or 0:>9.1f}"
                  f"{at.get('ttft_p50_ms') or 0:>10.0f}")


def _fmt(xs: list[float | None]) -> str:
    return ", ".join("-" if x is None else f"{x:.2f}x" for x in xs)


def run(args: argparse.Namespace) -> int:
    try:
        models = _names(args.models, MODELS, "model")
        workloads = _names(args.workloads, WORKLOADS, "workload")
        systems = _names(args.systems, SYSTEMS, "system")
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    command = command_line(PROG)
    print(f"command: {command}", flush=True)
    seeds = [args.seed + k for k in range(args.seeds)]
    report: dict[str, Any] = {
        "command": command, "machine": machine_info(), "paper": PAPER,
        "setup": {"hardware": "a100-80g", "instances": 2, "tp": {m: MODELS[m] for m in models},
                  "tbt_slo_ms": args.tbt_slo_ms, "ttft_p50_ms": args.ttft_p50_ms, "target": args.target,
                  "num_requests": args.num_requests, "window_s": args.window, "seed": args.seed, "seeds": seeds,
                  "rate_low": args.rate_low, "rate_high": args.rate_high, "tolerance": args.tolerance,
                  "max_probes": args.max_probes, "kv_stream_lead": args.kv_stream_lead,
                  "local_slo_scale": args.local_slo_scale, "catch_up": not args.no_catch_up,
                  "seed_profile": not args.no_seed_profile, "step_jitter": args.step_jitter,
                  "sustained": {"growth_factor": GROWTH_FACTOR, "slack_s": GROWTH_SLACK_S},
                  "systems": {n: vars(SYSTEMS[n]) for n in systems}, "workloads": {w: WORKLOADS[w] for w in workloads}},
        "results": {}, "ratios": {}, "ratios_paper": {}}
    t0 = time.perf_counter()
    for model in models:
        for k in ("results", "ratios", "ratios_paper"):
            report[k][model] = {}
        for wl in workloads:
            bases = {s: W.make_requests(W.WorkloadOptions(num_requests=args.num_requests, rate=1.0, seed=s,
                                                          **WORKLOADS[wl])) for s in seeds}
            stats = W.length_stats(bases[seeds[0]])
            print(f"\n== {model} (tp {MODELS[model]}) x 2 instances, {wl}: {len(bases[seeds[0]])} requests, input "
                  f"mean {stats['input_mean']:.0f}, output mean {stats['output_mean']:.0f}; seeds {seeds}", flush=True)
            # every (system, seed) search is independent of the others': --jobs of them at once
            calls = [(model, SYSTEMS[name], bases[s], args, f"{model} {wl} {name} s{s}", s)
                     for name in systems for s in seeds]
            found = run_all(capacity, calls, args.jobs)
            rows = {name: found[i * len(seeds):(i + 1) * len(seeds)] for i, name in enumerate(systems)}
            for name in systems:
                print(f"  -> {name}: paper capacity {[r['paper']['capacity_rps'] for r in rows[name]]} req/s", flush=True)
            report["results"][model][wl] = {"workload": stats, "seeds": seeds, "systems": rows}
            report["ratios"][model][wl] = {d: seed_ratios(rows, d, "ttft", args.rate_low, args.rate_high) for d in DYNA if d in rows}
            report["ratios_paper"][model][wl] = {d: seed_ratios(rows, d, "paper", args.rate_low, args.rate_high)
                                                 for d in DYNA if d in rows}
            _table(rows)
            for title, rs in (("TTFT-guarded", report["ratios"][model][wl]),
                              ("paper's (p99 TBT only)", report["ratios_paper"][model][wl])):
                for d, r in rs.items():
                    rc = r["capacity_rps"]
                    print(f"  {d} capacity, {title}, per seed: " + "; ".join(
                        f"{v['system']} {_fmt(v['per_seed'])}" for v in rc.values()), flush=True)
    report["wall_time_s"] = time.perf_counter() - t0
    for k, v in PAPER.items():
        print(f"paper ({k}): {v}")
    plots = write_result(report, args.output, not args.no_plots, plotter=_plots, prog=PROG)
    print(f"\nwall time {report['wall_time_s']:.0f} s; wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


def _plots(report: dict[str, Any], json_path: str) -> list[str]:
    """Per cell: each system's paper capacity (the median over the seeds, the range as a bar) and its
    goodput against the offered rate (Fig. 8's axes; the first seed's probes that kept up)."""
    from matplotlib.ticker import NullFormatter

    from tidal.common.plots import pyplot

    plt = pyplot()
    stem = os.path.splitext(json_path)[0]
    panels = [(m, w) for m, ws in report["results"].items() for w in ws]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7.5), squeeze=False)
    for col, (m, w) in enumerate(panels):
        rows = report["results"][m][w]["systems"]
        names = list(rows)
        caps = [[r["paper"]["capacity_rps"] or 0.0 for r in rows[n]] for n in names]
        med = [float(np.median(c)) for c in caps]
        ax = axes[0][col]
        ax.bar(range(len(names)), med, yerr=[[m_ - min(c) for m_, c in zip(med, caps, strict=True)],
                                             [max(c) - m_ for m_, c in zip(med, caps, strict=True)]],
               color=["tab:red" if n.startswith("dynaserve") else "tab:gray" if n == "disagg" else "tab:blue"
                      for n in names], capsize=3)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("paper capacity (req/s; median, range over seeds)")
        ax.set_title(f"{m.replace('qwen-2.5-', '')}: {w}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax = axes[1][col]
        for n in names:
            ps = [p for p in rows[n][0]["probes"] if p["paper_kept_up"]]
            ax.plot([p["rate"] for p in ps], [p["paper_goodput_tok_s"] for p in ps], marker=".", label=n,
                    linewidth=1.6 if n.startswith("dynaserve") else 0.9)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("goodput (tok/s, first seed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Simulated DynaServe vs PD colocation vs PD disaggregation (A100-80G, P99 TBT <= "
                 f"{report['setup']['tbt_slo_ms']:g} ms)", fontsize=10)
    fig.tight_layout()
    path = f"{stem}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


__all__ = ["DYNA", "HEADLINE", "SYSTEMS", "WORKLOADS", "add_parser", "attains", "capacity", "cluster_spec",
           "emission_ratio", "queue_growth", "run", "run_probe", "seed_ratios", "sustained", "tuned_coloc"]
