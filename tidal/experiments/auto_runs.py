"""One simulator run of ``tidal bench sim-auto`` and what is kept of it (module-level, so that
``--jobs`` can run them in processes of their own).

The cluster is KunServe's (Sec. 5.1, cluster A; :mod:`tidal.experiments.sim_kunserve`'s constants):
Qwen-2.5-14B on 8 A800-80GB instances, 200 Gb/s RDMA between them, the default KV pool (0.9 of each
GPU), chunked prefill of 2,048 tokens, Llumnix's dispatcher, 64 GiB of host memory per instance for
swapped-out KV. The systems differ only in ``--kv-pressure`` (and the preemption mode):
``recompute`` (vLLM), ``swap`` (InferCept-like), ``migrate`` (Llumnix-like), ``drop`` (KunServe) and
``auto`` (tidal: each throttle onset chooses one of the four).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tidal.experiments import kunserve_regime as R
from tidal.experiments.auto_trace import Phase, phase_of
from tidal.experiments.kunserve_runs import (
    CLUSTERS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    SWAP_SPACE,
    mean_demand,
)
from tidal.metrics import SLO, summarize
from tidal.workload import RequestSpec

ROUTER = "llumnix"
_A = CLUSTERS["a"]  # KunServe's cluster A: the 14B model on 8 A800s, one a GPU (the paper's setup)
MODEL, HARDWARE, INSTANCES, LINK = _A.model, _A.hardware, _A.instances, _A.link
SYSTEMS: dict[str, dict[str, str]] = {
    "recompute": {"kv_pressure": "preempt", "preemption_mode": "recompute", "label": "vLLM (preempt: recompute)"},
    "swap": {"kv_pressure": "preempt", "preemption_mode": "swap", "label": "InferCept-like (preempt: swap)"},
    "migrate": {"kv_pressure": "migrate", "preemption_mode": "recompute", "label": "Llumnix-like (migrate)"},
    "drop": {"kv_pressure": "drop", "preemption_mode": "recompute", "label": "KunServe (drop)"},
    "auto": {"kv_pressure": "auto", "preemption_mode": "recompute", "label": "tidal auto (chooses per onset)"},
    # a labelled ablation (ours), added after the page showed auto's 1.25x rows following drop's pipeline
    # groups: auto choosing among the three responses that leave the instances' layout as it is
    "auto-nodrop": {"kv_pressure": "auto", "preemption_mode": "recompute", "techniques": "recompute,swap,migrate",
                    "label": "ablation (ours): tidal auto without drop",
                    "why": "auto choosing among recompute, swap and migrate; added after this page showed auto's rows "
                           "at 1.25x following drop's pipeline groups"},
    # a labelled ablation (ours), added after the page showed drop's groups outlasting their episodes: auto
    # that undoes its groups once KunServe's own limit signal fires (Sec. 4.4's autoscale) and takes no drop
    # until the cluster's KV demand is back under the restore threshold (AutoParams.undo_at_limit)
    "auto-limit": {"kv_pressure": "auto", "preemption_mode": "recompute", "undo_at_limit": "1",
                   "label": "ablation (ours): tidal auto, drops undone at KunServe's limit signal",
                   "why": "auto with all four responses that, once KunServe's own limit signal fires (Sec. 4.4's "
                          "autoscale: KV use still rising over 10 s after a drop), restores its groups even while "
                          "throttled (what the members cannot hold recomputes) and takes no drop until the cluster's "
                          "KV demand is back under the restore threshold; added after this page showed drop's groups "
                          "outlasting their episodes"},
}
# a bound (ours), not a system anyone can run: auto's machinery with every onset's response pinned to
# each phase's best fixed response on that seed, known only after the fixed runs (what a choice made
# per phase gives when it takes each phase's best, the layouts' carry-over from phase to phase included)
BOUNDS: dict[str, dict[str, str]] = {
    "hindsight": {"kv_pressure": "auto", "preemption_mode": "recompute",
                  "label": "bound (ours): each phase's best fixed response, pinned after the fact",
                  "why": "auto's machinery with every onset in a phase taking that phase's best fixed response on "
                         "the same seed (chosen from the fixed runs, so only after them; not a policy anyone can "
                         "run): what choosing each phase's best response gives, its carry-over into the next phase "
                         "included"}}
FIXED = ("recompute", "swap", "migrate", "drop")
ABLATIONS = ("auto-nodrop", "auto-limit")
# our choice, set before any run: a request meets its SLO with its first token within 10 s (a 15K-token
# prompt alone takes ~2 s here) and at most 200 ms a token after it
SLO_DEF = SLO(ttft_s=10.0, tpot_s=0.2)


def slim(s: dict[str, Any]) -> dict[str, Any]:
    """What the page reads of a summary."""
    def g(d: dict[str, Any], k: str) -> float | None:
        return (d or {}).get(k)
    return {"requests": s["num_requests"], "completed": s["completed"], "lost": s["failed"],
            "ttft_p50_ms": g(s["ttft_ms"], "p50"), "ttft_p99_ms": g(s["ttft_ms"], "p99"),
            "tpot_p50_ms": g(s["tpot_ms"], "p50"), "tpot_p99_ms": g(s["tpot_ms"], "p99"),
            "goodput_tok_s": s["goodput"]["output_throughput"], "slo_attainment": s["slo_attainment"]}


def run_span(records: Sequence[Any]) -> tuple[float, float] | None:
    """The run's span: the first arrival and the last response's end (None: nothing ended)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    return (min(r.arrival_s for r in records), max(ends)) if ends else None


def service_rate(records: Sequence[Any]) -> float | None:
    """Output tokens over the run's span (the first arrival to the last response's end): what the
    cluster served per second, whatever the latencies (a layout that serves fewer falls behind)."""
    span = run_span(records)
    if span is None or span[1] <= span[0]:
        return None
    return sum(r.output_tokens for r in records) / (span[1] - span[0])


def pipeline_groups(groups: Sequence[dict[str, Any]], end_s: float | None) -> list[list[Any]]:
    """Each pipeline group a run formed (KunServe's drops), compact: [stages, formed (s), ended (s; the
    run's last response when it never split), its stages' idle share (Sec. 5.3's bubbles)]."""
    out = []
    for g in groups:
        ended = g.get("ended_s")
        ended = end_s if ended is None else ended
        bubble = g.get("bubble_ratio")
        out.append([len(g["group"]), round(g["formed_s"], 3), None if ended is None else round(ended, 3),
                    None if bubble is None else round(bubble, 4)])
    return out


def simulate(system: str, specs: Sequence[RequestSpec], phases: Sequence[Phase] | None = None,
             timeline_interval: float = 1.0, keep_timelines: bool = False, audit: bool = False,
             pinned: Sequence[tuple[float, str]] = ()) -> dict[str, Any]:
    """``system`` on ``specs``: its whole-run and per-phase summaries, its KV demand, its pressure
    events' counts and, for ``auto``, every choice as (time, instance, choice). ``audit``: every
    throttle onset's predictions beside what happened (:mod:`tidal.sim.auto_audit`; not in ``drop``
    runs, where ``auto``'s own drops are the drop rows). ``pinned``: a bound's schedule of responses
    (``AutoParams.pinned``; ``system`` one of :data:`BOUNDS`)."""
    from tidal.cluster.pressure import AutoParams
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec, build_simulator

    cfg = SYSTEMS[system] if system in SYSTEMS else BOUNDS[system]
    auto = cfg["kv_pressure"] == "auto"
    knobs: dict[str, Any] = {}  # an ablation's AutoParams (none: the defaults)
    if "techniques" in cfg:
        knobs["techniques"] = tuple(cfg["techniques"].split(","))
    if "undo_at_limit" in cfg:
        knobs["undo_at_limit"] = True
    if pinned:
        knobs["pinned"] = tuple((float(t), r) for t, r in pinned)
    params = AutoParams(**knobs) if knobs else None
    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                            preemption_mode=cfg["preemption_mode"])
    spec = ClusterSpec(model=MODEL, hardware=HARDWARE, instances=INSTANCES, router=ROUTER, scheduler=sched,
                       swap_space=SWAP_SPACE if system == "swap" or auto else 0, kv_pressure=cfg["kv_pressure"],
                       link=LINK, timeline_interval_s=timeline_interval, auto_params=params,
                       audit_auto=audit and cfg["kv_pressure"] != "drop")
    t0 = time.perf_counter()
    res = build_simulator(spec, list(specs)).run()
    out: dict[str, Any] = {"system": system, "wall_s": time.perf_counter() - t0, "whole": slim(summarize(res.records,
                                                                                                       slo=SLO_DEF))}
    if phases:
        by: dict[str, list] = {p.name: [] for p in phases}
        for r, s in zip(res.records, specs, strict=True):
            by[phase_of(list(phases), s.arrival_s)].append(r)
        out["phases"] = {p.name: slim(summarize(by[p.name], duration_s=p.end_s - p.start_s, slo=SLO_DEF))
                         for p in phases}
    span = run_span(res.records)
    out["service_tok_s"] = service_rate(res.records)
    out["mean_kv_demand"] = mean_demand(res.timelines)
    out["num_preemptions"] = sum(i["num_preemptions"] for i in res.instances)
    p = res.pressure or {}
    out["pressure_counts"] = p.get("counts", {})
    if span is not None:
        out["span_s"] = [round(span[0], 3), round(span[1], 3)]
    if p.get("groups"):
        out["groups"] = pipeline_groups(p["groups"], None if span is None else span[1])
    if auto:
        out["techniques"] = (p.get("auto_params") or {}).get("techniques")
        out["choice_counts"] = p.get("choice_counts", {})
        out["choices"] = [[round(c["time"], 3), c["index"], c["choice"]] for c in p.get("choices", [])]
        out["choice_reasons"] = [c["reason"] for c in p.get("choices", [])][:40]
        # undo_at_limit: when KunServe's limit signal put auto off drops, and when that ended
        if (p.get("auto_params") or {}).get("undo_at_limit"):
            out["limits"] = [[e["kind"], round(e["time"], 3)] for e in p.get("events", ())
                             if e["kind"] in ("limit", "limit-over")]
    if "audit" in p:  # compact: [onset, instance, response used, its predicted s, realized s]
        out["audit"] = [[a["time"], a["index"], a["response"], a["predicted_s"].get(a["response"]), a["realized_s"]]
                        for a in p["audit"]]
    if keep_timelines:
        out["timelines"] = res.timelines
    return out


def probe(specs: Sequence[RequestSpec], rate: float, duration_s: float) -> dict[str, Any]:
    """The rate search's run: the ``recompute`` baseline alone on one phase (or dataset)."""
    r = simulate("recompute", specs, timeline_interval=duration_s / 300, keep_timelines=True)
    ok, growth = R.keeps_up(r["timelines"], rate, duration_s)
    return {"mean_kv_demand": r["mean_kv_demand"], "keeps_up": ok, "queue_growth": growth,
            "ttft_p99_ms": r["whole"]["ttft_p99_ms"]}


__all__ = ["ABLATIONS", "BOUNDS", "FIXED", "ROUTER", "SLO_DEF", "SYSTEMS", "pipeline_groups", "probe", "run_span", "service_rate",
           "simulate", "slim"]
