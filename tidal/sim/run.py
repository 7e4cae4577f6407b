"""``tidal sim``: simulate a cluster serving a workload; print and save the bench's summary.

The driver (argument parsing, wall clock, progress bar, files) is here; everything it runs is
the pure simulator. The JSON has the keys of ``tidal bench serve`` plus ``simulated_time_s``,
``wall_time_s`` and ``speedup`` (simulated seconds per wall second); PNGs are written beside it.
``--instances``, ``--mode``, ``--prefill-instances`` and ``--router`` are ``tidal serve``'s own
flags; disaggregated, the JSON has ``handoffs`` (count, pending, wait / link queue / transfer
times) and each instance's timeline carries its role.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from typing import Any

from tidal import metrics as M
from tidal import workload as W
from tidal.cluster.decisions import Decision
from tidal.cluster.split import SplitParams
from tidal.common import flags as F
from tidal.common.machine import machine_info
from tidal.common.progress import progress_bar
from tidal.common.results import command_line, run_command, run_stamp, write_result
from tidal.config import ConfigError
from tidal.sim.build import (
    COST_MODELS,
    ClusterSpec,
    build_simulator,
    check_policy_args,
    handoff_config,
    pressure_link,
    resolve,
    split_params,
    swap_warning,
)
from tidal.sim.pd import Handoff, summarize_handoffs
from tidal.sim.split import SplitTransfer, summarize_splits

PROG = "tidal sim"
DEFAULT_OUTPUT = "results/sim.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tidal.cluster.dispatch import MODES
    from tidal.cluster.handoff import DEFAULT_LAYERS_PER_CHUNK, DEFAULT_TOKENS_PER_CHUNK
    from tidal.sim.hardware import HARDWARE
    from tidal.sim.links import LINK_NAMES
    from tidal.sim.models import MODELS
    from tidal.sim.split import LENGTH_MODES

    g = p.add_argument_group("cluster")
    g.add_argument("--hardware", default="a100-80g", help=f"per-GPU hardware: {', '.join(HARDWARE)}")
    g.add_argument("--tp", type=F.positive_int, default=1, help="GPUs per instance (tensor parallel)")
    g.add_argument("--cost-model", default=None, choices=list(COST_MODELS),
                   help="analytic (roofline) or profiled (needs --profile); default: profiled if --profile")
    g.add_argument("--profile", default=None, help="profile file written by `tidal profile`")
    g.add_argument("--num-blocks", type=F.positive_int, default=None,
                   help="KV blocks per instance (overrides memory)")
    g.add_argument("--timeline-points", type=F.positive_int, default=2000, help="samples per instance timeline")
    g.add_argument("--link", default=None, choices=list(LINK_NAMES),
                   help="link KV hand-offs travel on (--mode disaggregate; default: nvlink on a GPU, BucketServe's "
                        "one-node testbed), or KV migrations, exchanges, activations and restored layers "
                        "(--kv-pressure migrate/drop; default ib-hdr, KunServe's 200 Gbps); shm on the cpu")
    F.add_pressure_flags(p, defaults={"kv_pressure": None}, helps={
        "kv_pressure": "what a throttled instance (its queue's KV does not fit) does: preempt (the scheduler's "
                       "--preemption-mode alone), migrate (Llumnix-like: requests move with their KV to spare "
                       "instances), drop (KunServe: groups drop replicated layers and run as pipelines); "
                       "default: no handler (preempt, without the throttle log)"})
    g.add_argument("--no-lookahead", action="store_true",
                   help="--kv-pressure drop: token-count microbatches instead of KunServe's cost-balanced lookahead")
    g.add_argument("--kv-layers-per-chunk", type=int, default=DEFAULT_LAYERS_PER_CHUNK,
                   help="layers per KV chunk of a hand-off (0: all; the runtime's default)")
    g.add_argument("--kv-tokens-per-chunk", type=int, default=DEFAULT_TOKENS_PER_CHUNK,
                   help="tokens per KV chunk of a hand-off (0: all the request's)")
    s = p.add_argument_group("split (--mode split: DynaServe micro-requests, instances 2k alpha / 2k+1 beta)")
    s.add_argument("--split-probes", type=F.positive_int, default=None, help="Alg. 1's K, probes per request (6)")
    s.add_argument("--split-epsilon-ms", type=float, default=None,
                   help="Alg. 1's tolerance on |T_alpha - T_beta| in ms (20)")
    s.add_argument("--split-margin", type=int, default=None, help="tokens added to the predicted output (20)")
    s.add_argument("--split-length", default=None, choices=list(LENGTH_MODES),
                   help="what the planner knows of each output: max-tokens (the request's max_tokens caps the "
                        "history's prediction, as in the runtime; default), predict (no cap), oracle (the true length)")
    s.add_argument("--split-kv-aware", action="store_true",
                   help="the planner's execution predictor also obeys each instance's KV pool (our addition: a "
                        "beta that holds the long tails of its requests runs out of KV long before it runs out of time)")
    s.add_argument("--kv-stream-lead", type=int, default=None,
                   help="alpha starts pushing a request's KV only this many tokens before its split point (default: "
                        "from its first chunk, Sec. 4.3); beta then holds the KV for less time")
    g.add_argument("--seed-profile", action="store_true",
                   help="slo-compose's profile table starts from the cost model on a grid (an offline profile)")
    g.add_argument("--step-jitter", choices=("off", "fitted"), default="off",
                   help="step-time tails (tidal.sim.jitter): off, the cost model's means; fitted, the testbed "
                        "fitted to DynaServe's Table 1 baselines: host time per sequence, mixed-step interference, "
                        "1P1D's blocking KV receive and its prefill attention (`tidal bench calibrate-jitter`)")
    g.add_argument("--jitter-seed", type=int, default=0, help="the tails' own random stream")
    s.add_argument("--kv-stream-tokens", type=F.positive_int, default=16,
                   help="alpha pushes a request's KV to beta each time this many tokens are computed (Sec. 4.3)")
    F.add_cluster_flags(p, only=("instances", "mode", "prefill_instances", "prefill_batching", "router",
                                 "split_placement"),
                        choices={"mode": MODES},
                        helps={"mode": "colocate; disaggregate (BucketServe P/D); split (DynaServe: every request split "
                                       "at a token on a pair of instances)"})
    F.add_engine_flags(
        p, only=("model", "dtype", "max_model_len", "kv_cache_memory", "gpu_memory_utilization", "block_size",
                 "swap_space", "enable_prefix_caching", "kv_offloading_size"),
        defaults={"model": "llama-3-8b"},
        helps={"model": f"model shape: {', '.join(MODELS)}",
               "dtype": "weights and KV dtype of the simulated instances; auto: the profile's with --profile, "
                        "else bfloat16 (native on every simulated device)",
               "kv_cache_memory": "KV budget per instance, e.g. 512MiB (default: --gpu-memory-utilization)",
               "swap_space": "host memory per instance for swapped-out KV with --preemption-mode swap "
                             "(default 4GiB, vLLM's)"},
        title="model and KV memory (as the engine's flags)")
    F.add_scheduler_flags(p, omit=("max_queued_requests",))  # the simulated instances never refuse a request
    F.add_workload_flags(p, helps={"num_requests": "number of requests (default 1000 unless --duration "
                                                   "or --trace)"})
    F.add_slo_flags(p, defaults={"search_low": 0.1, "search_high": 64.0, "search_tolerance": 0.05,
                                 "max_probes": 10})
    F.add_output_flags(p, DEFAULT_OUTPUT)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate a cluster (same scheduler code, cost-model clock)",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


# ============================================================================ building
def sim_dtype(args: argparse.Namespace) -> str:
    """The simulated instances' dtype: ``auto`` is the profile's (the dtype its step times were
    measured in) with ``--profile``, else bfloat16, native on every simulated GPU and on the modelled CPU."""
    if args.dtype != "auto":
        return args.dtype
    if args.profile:
        try:
            with open(args.profile, encoding="utf-8") as f:
                measured = json.load(f).get("dtype")
        except (OSError, ValueError, AttributeError):  # the cost model says what is wrong with the file
            measured = None
        return measured or "bfloat16"
    return "bfloat16"


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster the flags describe; the scheduler and cache flags are read as the engine reads them."""
    cache = F.cache_config(args)
    if args.max_model_len is not None and args.max_model_len <= 0:
        raise ConfigError(f"max_model_len must be > 0, got {args.max_model_len}")
    cost = args.cost_model or ("profiled" if args.profile else "analytic")
    layout = F.cluster_layout(args)
    if args.kv_layers_per_chunk < 0 or args.kv_tokens_per_chunk < 0:
        raise ConfigError("--kv-layers-per-chunk and --kv-tokens-per-chunk must be >= 0 (0: all in one chunk)")
    if args.link and layout.mode == "colocate" and args.kv_pressure not in ("migrate", "drop", "auto"):
        raise ConfigError("--link needs --mode disaggregate or split, or --kv-pressure migrate/drop/auto")
    split_flags = {"max_probes": args.split_probes, "margin": args.split_margin,
                   "epsilon_s": None if args.split_epsilon_ms is None else args.split_epsilon_ms / 1000.0}
    split_flags = {k: v for k, v in split_flags.items() if v is not None}
    if not layout.split and (split_flags or args.split_length or args.kv_stream_lead is not None
                             or args.split_kv_aware):
        raise ConfigError("--split-* flags need --mode split")
    placement = F.split_placement(args)  # --split-placement (an error without --mode split)
    if args.no_lookahead and args.kv_pressure != "drop":
        raise ConfigError("--no-lookahead needs --kv-pressure drop")
    return ClusterSpec(
        model=args.model, hardware=args.hardware, instances=layout.instances, tp=args.tp,
        dtype_bytes=4 if sim_dtype(args) == "float32" else 2, block_size=cache.block_size, router=args.router,
        cost_model=cost, profile=args.profile, scheduler=F.scheduler_config(args),
        gpu_memory_utilization=cache.gpu_memory_utilization, kv_cache_memory=cache.kv_cache_memory,
        num_blocks=args.num_blocks, swap_space=int(cache.swap_space), max_model_len=args.max_model_len,
        enable_prefix_caching=cache.enable_prefix_caching, kv_offloading_size=int(cache.kv_offloading_size),
        mode=layout.mode, prefill_instances=layout.prefill_instances, prefill_batching=args.prefill_batching,
        link=args.link, layers_per_chunk=args.kv_layers_per_chunk, tokens_per_chunk=args.kv_tokens_per_chunk,
        split=SplitParams(**split_flags, flip_roles=placement == "load") if layout.split else None,
        split_length=args.split_length or "max-tokens",
        kv_stream_tokens=args.kv_stream_tokens, kv_stream_lead=args.kv_stream_lead, seed_profile=args.seed_profile,
        kv_pressure=args.kv_pressure, lookahead=not args.no_lookahead, split_kv_aware=args.split_kv_aware,
        step_jitter=args.step_jitter, jitter_seed=args.jitter_seed)


def check_roles(spec: ClusterSpec) -> None:
    """Each role's policy and the policy arguments, and the link, before any simulation runs."""
    check_policy_args(spec)
    if spec.layout.disaggregated or spec.layout.split:
        arch, hw, _, _ = resolve(spec)
        handoff_config(spec, arch, hw)


def workload(args: argparse.Namespace, rate: float | None) -> list[W.RequestSpec]:
    num = args.num_requests
    if num is None and args.duration is None and not args.trace:
        num = 1000
    specs = W.make_requests(F.workload_options(args, rate=rate, num_requests=num))
    if args.trace and args.duration is not None:
        specs = [s for s in specs if s.arrival_s < args.duration]
    if not specs:
        raise W.WorkloadError("the workload has no requests (check --duration / --num-requests)")
    return specs


def simulate(spec: ClusterSpec, specs: list[W.RequestSpec], slo: M.SLO, desc: str = "sim",
             progress: bool = True, timeline_points: int = 2000,
             recorder: Callable[[Decision], None] | None = None) -> dict[str, Any]:
    """One simulation's summary; ``recorder`` takes every dispatch decision with its inputs."""
    horizon = max(s.arrival_s for s in specs)
    spec = replace(spec, timeline_interval_s=horizon / timeline_points if horizon > 0 else 0.0)
    sim = build_simulator(spec, specs, recorder=recorder)
    bar = progress_bar(round(horizon, 1), desc, "sim-s", progress,
                       bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} sim-s [{elapsed}<{remaining}]")
    t0 = time.perf_counter()
    try:
        res = sim.run(progress=bar.advance_to)
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    summary = M.summarize(res.records, slo=slo)
    by_request = {h.index: h for h in res.handoffs}
    splits = {t.index: t for t in res.splits}
    summary.update({
        "preemptions": preemptions(res.instances),
        "simulated_time_s": res.simulated_time_s, "wall_time_s": wall,
        "speedup": res.simulated_time_s / wall if wall > 0 else None, "num_events": res.num_events,
        "instances": res.instances, "timelines": res.timelines,
        "requests": [_record(r, res.routed[i], by_request.get(i), splits.get(i)) for i, r in enumerate(res.records)],
    })
    if any(i.get("prefix_queries") for i in res.instances):
        summary["prefix_cache"] = prefix_cache_summary(spec, specs, res.instances, res.routed, res.records)
    if res.mode == "split":
        summary["splits"] = summarize_splits(res.splits)
        summary["split_load"] = res.split_load
    if res.pressure is not None:
        summary["kv_pressure"] = res.pressure
    if res.mode == "disaggregate":
        summary["handoffs"] = summarize_handoffs(res.handoffs, res.max_pending_handoffs)
        summary["handoff_timeline"] = res.handoff_timeline
    return summary


def prefix_cache_summary(spec: ClusterSpec, specs: list[W.RequestSpec], instances: list[dict[str, Any]],
                         routed: list[int], records: list[M.RequestRecord] | None = None) -> dict[str, Any]:
    """The run's hits (pool and host tier apart) beside what the traffic allows: an unbounded cache;
    an LRU of each instance's capacity on the requests routed to it, in their order (what its cache
    could hit, as routed); and one LRU of the cluster's combined capacity (what routing could reach
    without a shared store). Capacities: the pool, and the pool plus the host tier where there is one.

    The requests go in the order they arrived (``records``' send times: a conversation's later
    turns arrive when the run says; dropped turns never did), each named as the simulator names it
    (:func:`tidal.sim.instance.spec_block_names`): a conversation turn's answer blocks too, those
    its run computes (:func:`_computed_names`), which enter a bound's cache with the turn (the next
    turn, the only one to hold them, comes later)."""
    from tidal.metrics.prefix import cache_summary, prefix_bounds

    out = cache_summary(instances)
    bs = spec.block_size
    order: list[int] = list(range(len(specs)))
    if records is not None:
        order = sorted((k for k in order if records[k].error != "dropped"),
                       key=lambda k: (specs[k].arrival_s if records[k].send_s is None else records[k].send_s, k))
    named = {k: (_computed_names(specs[k], bs, str(k).encode()), specs[k].prompt_len) for k in order}
    names = [named[k] for k in order]
    tiers = {"pool": [i["num_blocks"] for i in instances]}
    if spec.kv_offloading_size:
        tiers["pool_and_host"] = [i["num_blocks"] + i.get("num_host_blocks", 0) for i in instances]
    out["unbounded_hit_rate"] = prefix_bounds(names, bs)["unbounded_hit_rate"]
    total = sum(n for _, n in names)
    per_instance = [[named[j] for j in order if routed[j] == k] for k in range(len(instances))]
    out["unbounded_hit_rate_as_routed"] = sum(
        prefix_bounds(mine, bs)["unbounded_hit_rate"] * sum(n for _, n in mine) for mine in per_instance) / total \
        if total else 0.0
    for tier, caps in tiers.items():
        cluster = prefix_bounds(names, bs, [sum(caps)])
        out[f"lru_hit_rate_{tier}_combined"] = cluster["lru_hit_rate"][str(sum(caps))]
        as_routed = 0.0
        for mine, cap in zip(per_instance, caps, strict=True):
            as_routed += prefix_bounds(mine, bs, [cap])["lru_hit_rate"][str(cap)] * sum(n for _, n in mine)
        out[f"lru_hit_rate_{tier}_as_routed"] = as_routed / total if total else 0.0
        out[f"{tier}_blocks"] = sum(caps)
    return out


def _computed_names(s: W.RequestSpec, block_size: int, unique: bytes) -> list[bytes]:
    """The names of the blocks a request's run leaves named: its prompt's, and a conversation
    turn's answer but for its last token (sampled, never fed back: its KV is never computed)."""
    from tidal.sim.instance import spec_block_names

    names = spec_block_names(s, block_size, unique)
    return names[:(s.prompt_len + s.output_len - 1) // block_size] if s.answer_segments else names
def rate_meaning(args: argparse.Namespace) -> str:
    """What a probe's rate is, in words (the capacity search's report and summary say it)."""
    if not args.trace:
        return (f"the mean rate of {args.workload}'s arrivals"
                + (f" over --duration {args.duration:g} s" if args.duration is not None else ""))
    if args.duration is None:
        return "the whole trace's mean arrival rate (its gaps' pattern kept, rescaled)"
    return (f"the mean arrival rate of the requests replayed: the trace's first rate x {args.duration:g} s arrivals, "
            f"rescaled to that rate within the {args.duration:g} s window (their gaps' pattern kept)")


def preemptions(instances: list[dict[str, Any]]) -> dict[str, int]:
    """Every instance's preemptions by what they did: swapped out, or recomputed; ``swap_fallbacks``:
    those that wanted to swap (``--preemption-mode swap``) and recomputed, the host pool full."""
    total = sum(i.get("num_preemptions", 0) for i in instances)
    swap = sum(i.get("num_swap_preemptions", 0) for i in instances)
    return {"total": total, "swap": swap, "recompute": total - swap,
            "swap_fallbacks": sum(i.get("num_swap_fallbacks", 0) for i in instances)}


def _record(r: M.RequestRecord, instance: int, handoff: Handoff | None = None,
            split: SplitTransfer | None = None) -> dict[str, Any]:
    # no per-token gaps: millions of them for a long run; the summary keeps their distribution
    d = {f.name: getattr(r, f.name) for f in fields(r) if f.name != "itl_s"}
    d["tpot_s"], d["queue_s"] = r.tpot_s, r.queue_s
    d["instance"] = instance
    if handoff is not None:
        d["decode_instance"] = handoff.dst
        d["handoff_ms"] = None if not handoff.landed else 1000 * (handoff.end_s - handoff.ready_s)
    if split is not None:  # where it was split, how much KV moved, how long the tail took
        d.update({"pair": [split.alpha, split.beta], "split": split.split, "phi": split.phi,
                  "predicted_output": split.predicted_output, "split_probes": split.probes,
                  "cold_start": split.cold_start, "kv_bytes": split.nbytes, "kv_chunks": split.num_chunks,
                  "handoff_ms": None if split.landed_s is None or split.paused_s is None
                  else 1000 * (split.landed_s - split.paused_s)})
    return d


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    slo = M.parse_slo(args.slo)
    spec = cluster_spec(args)
    arch, hw, blocks, max_len = resolve(spec)  # fail on a bad model/hardware/memory before the workload
    check_roles(spec)
    swap_warn = swap_warning(spec)
    if swap_warn:
        print(f"{PROG}: warning: {swap_warn}", file=sys.stderr)
    F.check_capacity_flags(args)
    if args.capacity_search:  # one base workload (at 1 req/s, or the whole trace at its times) rescaled per probe
        if args.num_requests is None and args.duration is not None and not args.trace:
            args.num_requests = int(args.search_high * args.duration * 1.5) + 16
        if args.trace:  # each probe takes the window its rate brings (window_at_rate), not the trace's first D s
            specs = W.make_requests(F.workload_options(args, rate=None, duration_s=None))
        else:
            specs = workload(args, 1.0)
    else:
        specs = workload(args, args.rate)
    layout = spec.layout
    info = {"model": spec.model, "hardware": spec.hardware, "instances": spec.instances, "tp": spec.tp,
            "dtype": sim_dtype(args),
            "kv_blocks_per_instance": blocks, "block_size": spec.block_size, "max_model_len": max_len,
            "cost_model": spec.cost_model, "router": spec.router, "batching": spec.scheduler.batching,
            "scheduling": spec.scheduler.scheduling,
            "mode": layout.mode, "prefill_instances": layout.prefill_instances, "roles": layout.roles()}
    if layout.disaggregated:
        hc = handoff_config(spec, arch, hw)
        info.update({"prefill_batching": spec.role_scheduler("prefill").batching, "link": hc.link.to_dict(),
                     "kv_layers_per_chunk": hc.layers_per_chunk, "kv_tokens_per_chunk": hc.tokens_per_chunk})
    if layout.split:
        hc = handoff_config(spec, arch, hw)
        info.update({"pairs": layout.pairs(), "split_params": asdict(split_params(spec, blocks * spec.block_size)),
                     "split_length": spec.split_length, "link": hc.link.to_dict(),
                     "kv_layers_per_chunk": hc.layers_per_chunk, "kv_stream_tokens": spec.kv_stream_tokens})
    if swap_warn:
        info["swap_warning"] = swap_warn
    if spec.kv_pressure in ("migrate", "drop", "auto"):
        info["pressure_link"] = pressure_link(spec, hw).to_dict()
    search_report = None
    if args.capacity_search:
        search = F.capacity_search(args)
        at_rate_of = W.window_at_rate if args.trace else W.specs_at_rate
        while (rate := search.next_rate()) is not None:
            at_rate = at_rate_of(specs, rate, args.duration)
            out = simulate(spec, at_rate, slo, f"rate {rate:.3g}", not args.no_progress, args.timeline_points)
            search.record(rate, out["slo_attainment"] or 0.0, {k: out[k] for k in ("ttft_ms", "tpot_ms")})
            print(f"  rate {rate:8.3g} req/s: attainment {100 * (out['slo_attainment'] or 0):5.1f}%", file=sys.stderr)
        search_report = {**search.report(), "rate_means": rate_meaning(args)}
        rate = search.capacity or args.search_low
        specs = at_rate_of(specs, rate, args.duration)
    result = simulate(spec, specs, slo, "sim", not args.no_progress, args.timeline_points)
    result["instance_stats"] = result["instances"]  # per instance (info's "instances" is their number)
    result.update(info)
    result["workload"] = {"name": args.workload or "trace", "trace": args.trace, "num_requests": len(specs),
                          "rate": args.rate, **W.length_stats(specs)}
    if search_report is not None:
        result["capacity_search"] = search_report
    result["machine"] = machine_info()
    result["command"] = command_line(PROG)
    result.update(run_stamp())  # date and tidal's commit: `tidal bench report` reads them
    return result


def format_summary(r: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    mode = r.get("mode", "colocate")
    if mode == "split":
        batching = (f"split on {r['instances'] // 2} pair(s) ({r['batching']}), K={r['split_params']['max_probes']}, "
                    f"link {r['link']['name']}")
    elif mode == "disaggregate":
        batching = (f"disaggregated {r['prefill_instances']} prefill ({r['prefill_batching']}) + "
                    f"{r['instances'] - r['prefill_instances']} decode ({r['batching']}), link {r['link']['name']}")
    else:
        batching = r["batching"]
    if r.get("scheduling", "chunked") != "chunked":
        batching += f" ({r['scheduling']} steps)"
    lines = [f"{r['model']} ({r['dtype']}) on {r['instances']} x {r['hardware']} (tp {r['tp']}), {batching}, "
             f"router {r['router']}, cost model {r['cost_model']}, {r['kv_blocks_per_instance']} KV blocks/instance",
             f"requests: {r['num_requests']} ({r['completed']} completed, {r['failed']} failed)"
             + (f"; errors: {r['errors']}" if r.get("errors") else ""),
             f"throughput: {f(r['request_throughput'], '.2f')} req/s, {f(r['output_throughput'])} output tok/s",
             f"TTFT ms p50/p90/p99: {f(r['ttft_ms']['p50'])} / {f(r['ttft_ms']['p90'])} / {f(r['ttft_ms']['p99'])}",
             f"TPOT ms p50/p90/p99: {f(r['tpot_ms']['p50'])} / {f(r['tpot_ms']['p90'])} / {f(r['tpot_ms']['p99'])}",
             f"SLO attainment: {f(None if r['slo_attainment'] is None else 100 * r['slo_attainment'])}%"
             f"  goodput {f(r['goodput']['request_throughput'], '.2f')} req/s",
             f"simulated {r['simulated_time_s']:.1f} s in {r['wall_time_s']:.2f} s wall: "
             f"{f(r['speedup'], '.0f')}x faster than real time ({r['num_events']} events)"]
    pre = r.get("preemptions")
    if pre and pre["total"]:
        lines.append(f"preemptions: {pre['total']} ({pre['swap']} swapped out, {pre['recompute']} recomputed"
                     + (f", {pre['swap_fallbacks']} of them wanted to swap but the swap space was full"
                        if pre["swap_fallbacks"] else "") + ")")
    if r.get("swap_warning"):
        lines.append(f"warning: {r['swap_warning']}")
    kp = r.get("kv_pressure")
    if kp:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(kp["counts"].items())) or "no throttle"
        lines.append(f"kv pressure ({kp['mode']}): {counts}"
                     + (f"; {kp['migrated']} migrated" if "migrated" in kp else "")
                     + (f"; {len(kp['groups'])} pipeline groups, {kp['exchange_bytes'] / 1e9:.1f} GB exchanged"
                        if "groups" in kp else ""))
    h = r.get("handoffs")
    if h:
        lines.append(f"hand-offs: {h['landed']} landed of {h['count']} ({h['pending_at_end']} pending and "
                     f"{h['in_flight_at_end']} in flight at the end, at most {h['max_pending']} pending); "
                     f"ms p50/p99 wait {f(h['wait_ms']['p50'], '.2f')} / {f(h['wait_ms']['p99'], '.2f')}, "
                     f"transfer {f(h['transfer_ms']['p50'], '.2f')} / {f(h['transfer_ms']['p99'], '.2f')}, "
                     f"first token to landing {f(h['total_ms']['p50'], '.2f')} / {f(h['total_ms']['p99'], '.2f')}")
    sp = r.get("splits")
    if sp:
        lines.append(f"splits: {sp['handoffs']} handed off of {sp['count']} ({sp['inside_prompt']} inside the prompt, "
                     f"{sp['at_prompt_end']} at its end, {sp['inside_output']} inside the output; whole on alpha "
                     f"{sp['whole_on_alpha']}, on beta {sp['whole_on_beta']}); phi p50 {f(sp['phi']['p50'], '.2f')}; "
                     f"KV moved {sp['kv_bytes_total'] / 1e9:.2f} GB; exposed transfer p50/p99 "
                     f"{f(sp['exposed_transfer_ms']['p50'], '.2f')} / {f(sp['exposed_transfer_ms']['p99'], '.2f')} ms "
                     f"({f(None if sp['exposed_vs_whole'] is None else 100 * sp['exposed_vs_whole'])}% of sending "
                     f"it after the pause)")
    pc = r.get("prefix_cache")
    if pc:
        host = "pool_and_host_blocks" in pc
        lines.append(f"prefix cache: {100 * pc['hit_rate']:.1f}% of prompt tokens hit ({100 * pc['pool_hit_rate']:.1f}% "
                     f"in the pools, {100 * pc['host_hit_rate']:.1f}% in the host tiers); bounds: unbounded "
                     f"{100 * pc['unbounded_hit_rate']:.1f}% (as routed {100 * pc['unbounded_hit_rate_as_routed']:.1f}%); an LRU of each instance's pool on its requests "
                     f"{100 * pc['lru_hit_rate_pool_as_routed']:.1f}%"
                     + (f" (with its host tier {100 * pc['lru_hit_rate_pool_and_host_as_routed']:.1f}%)" if host else "")
                     + f"; one LRU of all pools {100 * pc['lru_hit_rate_pool_combined']:.1f}%"
                     + (f" (with the host tiers {100 * pc['lru_hit_rate_pool_and_host_combined']:.1f}%)" if host else ""))
    wl = r.get("workload") or {}
    if wl.get("span_s"):
        lines.append(f"workload: {wl['num_requests']} requests arriving over {wl['span_s']:.1f} s, a mean "
                     f"{f(wl.get('mean_rate'), '.3g')} req/s")
    cs = r.get("capacity_search")
    if cs:
        lines.append(f"capacity at {cs['target_attainment']:.0%} attainment: {f(cs['capacity_rps'], '.3g')} req/s"
                     + (f" ({cs['rate_means']})" if cs.get("rate_means") else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from tidal.sim.plots import write_sim_plots

    def work() -> tuple[dict[str, Any], list[str]]:
        result = run_sim(args)
        return result, write_result(result, args.output, not args.no_plots, plotter=write_sim_plots, prog=PROG)

    def done(out: tuple[dict[str, Any], list[str]]) -> int:
        result, plots = out
        print(format_summary(result))
        print(f"wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
        return 0

    return run_command(PROG, work, done, (ConfigError, ValueError))  # WorkloadError, SLOError, bad names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["add_arguments", "add_parser", "cluster_spec", "format_summary", "run", "run_sim", "simulate"]
