"""BucketServe (Zheng et al.) Sec. V in the simulator: Fig. 5a (offline throughput against the max
batch size), Fig. 5c-d (SLO attainment against server RPS) and Fig. 5e-f (server RPS against
client RPS), BucketServe against its two baselines.

Setup (Sec. V-A): Llama-2-13B, four A100-40G (one instance each), Alpaca (prompts of 83 tokens on
average) and a Mixed set of Alpaca and LongBench (LongBench's prompts, median 41,417 tokens, are
cut to the model's 4,096-token context, so a long prompt fills it: 4,096 less its output). The
paper gives no output lengths: here Alpaca answers average 128 tokens and LongBench summaries 256
(lognormal). Systems, each named after what it stands for:

- **UELLM-like**: UELLM couples prefill and decode and batches statically: ``static`` with
  ``static.pad`` (every step a padded rectangle, finished rows kept until the batch ends), four
  colocated instances, a fixed batch of ``max_num_seqs``; its members either the oldest waiting
  (FCFS) or, as UELLM groups them, the oldest and those nearest it in predicted length
  (``static.group=length``; the prediction is max_tokens, exact here).
- **DistServe**: disaggregated prefill and decode (two of each) as DistServe behaves: strict FCFS
  prefill with head-of-line blocking, each prompt whole in a batch of prompts (``--scheduling
  prefill-first``), its KV held on the prefill instance until a decode instance takes it (so the
  prefill instance stalls when that memory is full), swap-out to host memory on decode overflow
  (``--preemption-mode swap``).
- **BucketServe**: the same engine and layout with BucketServe's bucketed batching (``bucket``,
  Alg. 1 and Eq. 6) on the prefill instances and continuous batching on the decode ones (Sec. III).

Two engines run both disaggregated systems: ``varlen`` (variable-length attention, no padding:
vLLM's and tidal's kernels) and ``padded`` (``--pad-prefill``: a batch of prompts runs as a
rectangle of its longest, as an engine without variable-length attention does; the premise of
BucketServe's Eq. 1-4). Two layouts: the paper's 2 prefill + 2 decode on its outputs, and a
prefill-bound 1 + 3 with outputs an eighth as long, to show where a prefill-side technique can
pay. Each claim states the Amdahl bound: with the decode instances busy a fraction ``b`` of the
run, a change to the prefill side alone gains at most ``1 / b``.

SLO (the paper names none): TTFT <= 5 s and TPOT <= 100 ms. Fig. 5c-f are sweeps of the client's
rate (seed 0); the capacity the claims read is a bisection on the client's rate for the highest
at which 80 % of the requests meet the SLO (the server RPS there), on each of three seeds (each its
own lengths and arrivals), the search's final bracket its resolution. Fig. 6 (the latency
breakdown and the bucketing overhead, :mod:`tidal.experiments.bucketserve_overhead`): BucketServe
at three client rates per dataset, its prefill instances' bucket policy timed on this CPU.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

import numpy as np

from tidal.common.machine import usable_cores
from tidal.config import SchedulerConfig
from tidal.experiments.parallel import run_all
from tidal.experiments.reproduce import (
    MARGIN_PAST_BRACKET,
    Claim,
    Progress,
    Report,
    beats,
    capacity_from_sweep,
    claims_range,
    fmt_ratio,
    ratio,
    runs_real,
    server_rps,
    vs_paper,
)
from tidal.metrics import SLO, CapacitySearch, summarize
from tidal.workload import RequestSpec, gamma_arrivals, lognormal_lengths

CONTEXT = 4096  # Llama-2's context: LongBench prompts are cut to it
SLO_ = SLO(ttft_s=5.0, tpot_s=0.1)
TARGET = 0.8
BUDGET = 4096  # max_num_batched_tokens on every instance
COMMON = {"model": "llama-2-13b", "hardware": "a100-40g", "instances": 4}
SWAP = 64 << 30  # host bytes per instance for swapped-out KV (DistServe swaps decode KV to host memory)
ENGINES = ("varlen", "padded")
SHORT = 8  # the prefill-bound layout's outputs are this many times shorter
SEEDS = (0, 1, 2)
QUICK_SEEDS = (0,)  # --quick: one seed (the tests check the runs, not the verdicts)
MARGIN = 0.02  # a ratio must clear 1 + this on every seed (reproduce.MARGIN's 2 %)
SEARCH = {"alpaca": (1.0, 64.0), "mixed": (0.1, 8.0)}  # client-rate range of the capacity search
MIN_STEPS = 20  # Fig. 6b: a bucket count's time per step is read over at least this many steps
FIG6_RATES = {"alpaca": (8.0, 16.0, 32.0), "mixed": (0.5, 1.0, 2.0)}  # Fig. 6a's RPS (the paper names 32)


def systems(batch: int, engine: str = "varlen", prefill_instances: int = 2) -> dict[str, dict[str, Any]]:
    """The three systems at a max batch size of ``batch`` (ClusterSpec keyword arguments); the two
    disaggregated ones on ``engine`` (varlen | padded) with ``prefill_instances`` of the four."""
    pd = {**COMMON, "mode": "disaggregate", "prefill_instances": prefill_instances, "swap_space": SWAP}
    distserve = dict(batching="continuous", max_num_seqs=batch, max_num_batched_tokens=BUDGET,
                     scheduling="prefill-first", preemption_mode="swap", pad_prefill=engine == "padded")
    return {
        "UELLM-like (padded static)": {**COMMON, "scheduler": SchedulerConfig(
            batching="static", max_num_seqs=batch, max_num_batched_tokens=BUDGET, policy_args={"static.pad": True})},
        "UELLM-like (padded static, length-grouped)": {**COMMON, "scheduler": SchedulerConfig(
            batching="static", max_num_seqs=batch, max_num_batched_tokens=BUDGET,
            policy_args={"static.pad": True, "static.group": "length"})},
        "DistServe (P/D, FCFS whole prefills, swap)": {**pd, "scheduler": SchedulerConfig(**distserve)},
        "BucketServe (P/D, bucket)": {**pd, "prefill_batching": "bucket", "scheduler": SchedulerConfig(
            **distserve, policy_args={"bucket.l_max": CONTEXT})},
    }


UELLM, UELLM_GROUPED, DIST, BUCKET = list(systems(1))
STATIC = (UELLM, UELLM_GROUPED)  # they pad by themselves: one run each, on no engine choice


def run_busy(kw: dict[str, Any], specs: list[RequestSpec], slo: SLO | None = None) -> dict[str, Any]:
    """``run_sim`` plus the mean busy fraction of the prefill and of the decode instances."""
    from tidal.sim.build import ClusterSpec, build_simulator

    res = build_simulator(ClusterSpec(**kw), list(specs)).run()
    out = summarize(res.records, slo=slo)
    span = res.simulated_time_s or 1.0
    for role in ("prefill", "decode"):
        insts = [i for i in res.instances if i["role"] == role]
        out[f"{role}_busy"] = sum(i["busy_time_s"] for i in insts) / len(insts) / span if insts else None
    out["num_preemptions"] = sum(i["num_preemptions"] for i in res.instances)
    return out


def workload(dataset: str, n: int, seed: int, rate: float | None) -> list[RequestSpec]:
    """``n`` requests of ``dataset`` (alpaca | mixed), Poisson at ``rate`` (None: all at t = 0)."""
    rng = np.random.default_rng(seed)
    a_in, a_out = lognormal_lengths(rng, n, 83, 0.6), lognormal_lengths(rng, n, 128, 0.6)
    l_out = np.minimum(lognormal_lengths(rng, n, 256, 0.5), 1024)
    l_in = np.minimum(lognormal_lengths(rng, n, 41417, 0.8), CONTEXT - l_out)
    long = rng.random(n) < 0.5 if dataset == "mixed" else np.zeros(n, dtype=bool)
    ins, outs = np.where(long, l_in, a_in), np.where(long, l_out, a_out)
    t = np.zeros(n) if rate is None else gamma_arrivals(rng, n, rate)
    return [RequestSpec(float(t[i]), int(ins[i]), int(outs[i])) for i in range(n)]


# the real engine at small scale: the default model on this CPU, one instance, a mixed offline batch
REAL_SYSTEMS = {UELLM: ("static", {"static.pad": True}), "BucketServe (bucket)": ("bucket", {})}


def real_offline(n: int, batch: int, seed: int, progress: Progress, repeats: int = 3) -> dict[str, Any]:
    """Fig. 5a's claim on the real engine: every request at t = 0, half Alpaca-like (prompts 32-128,
    outputs 16-64) and half long (prompts 512-1024, outputs 32-96), padded static batching that
    computes its padding against bucketed batching, both at max batch ``batch``; output tok/s, the
    median of ``repeats`` runs, the two systems taking turns (a shared CPU's noise falls on both)."""
    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    from tidal.engine.loader import load_checkpoint
    from tidal.experiments.policies import Job, run_policy
    from tidal.metrics import summarize

    ckpt = load_checkpoint(None)
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        lo, hi, olo, ohi = (512, 1024, 32, 96) if i % 2 else (32, 128, 16, 64)
        jobs.append(Job(i, 0.0, rng.integers(100, ckpt.arch.vocab_size - 100, size=int(rng.integers(lo, hi + 1))).tolist(),
                        int(rng.integers(olo, ohi + 1))))
    rng.shuffle(jobs)  # arrival order mixes the two kinds, as a mixed trace does
    out: dict[str, Any] = {"num_requests": n, "max_batch": batch, "model": os.path.basename(ckpt.path),
                           "repeats": repeats}
    engines = {name: LLMEngine(EngineConfig.from_kwargs(model=ckpt.path, batching=batching, policy_args=policy_args,
                                                        max_num_seqs=batch, max_num_batched_tokens=2048,
                                                        kv_cache_memory="512MiB", enable_prefix_caching=False),
                                 checkpoint=ckpt)  # no cache: a repeat must compute what the first did
               for name, (batching, policy_args) in REAL_SYSTEMS.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for r in range(repeats):
        for name, engine in engines.items():
            padded = engine.runner.padded_tokens_computed
            records, extra = run_policy(engine, jobs, progress=False, desc=name)
            sm = summarize(records)
            runs[name].append({"tok_s": sm["output_throughput"], "duration_s": sm["duration_s"], "steps": extra["steps"],
                               "padded_tokens_computed": engine.runner.padded_tokens_computed - padded})
            progress(f"real engine, max batch {batch}, run {r + 1}/{repeats}: {name}: {sm['output_throughput']:.1f} tok/s")
    for name, rs in runs.items():
        out[name] = {"tok_s": float(np.median([x["tok_s"] for x in rs])), "runs": rs,
                     "padded_tokens_computed": rs[0]["padded_tokens_computed"]}
    out["dtype"] = str(next(iter(engines.values())).dtype).removeprefix("torch.")
    return out


def key(name: str, engine: str | None = None) -> str:
    """A system's key in the data: the UELLM-like baseline pads by itself; the disaggregated ones
    run on either engine."""
    return name if name in STATIC or engine is None else f"{name} / {engine}"


def each(batch: int, prefill_instances: int = 2):
    for engine in ENGINES:
        for name, kw in systems(batch, engine, prefill_instances).items():
            if name not in STATIC or engine == ENGINES[0]:
                yield key(name, engine), kw


def capacity_search(kw: dict[str, Any], base: list[RequestSpec], low: float, high: float, quick: bool
                    ) -> dict[str, Any]:
    """The highest client rate at which ``TARGET`` of the requests meet the SLO (bisection), the
    server RPS there, and the final bracket (hi / lo - 1: the search's resolution)."""
    search = CapacitySearch(low, high, TARGET, tolerance=0.1 if quick else 0.05, max_probes=4 if quick else 8)
    server: dict[float, float] = {}
    while (rate := search.next_rate()) is not None:
        s = run_busy(kw, [replace(x, arrival_s=x.arrival_s / rate) for x in base], SLO_)
        server[rate] = server_rps(s)
        search.record(rate, s["slo_attainment"] or 0.0)
    lo, hi = search.bracket
    return {"capacity_client_rps": lo, "capacity_server_rps": server.get(lo) if lo is not None else None,
            "first_failing_rps": hi, "bracket": (hi / lo - 1.0) if lo and hi and hi > lo else 0.0,
            "note": search.note, "probes": [{"rate": p.rate, "attainment": p.attainment} for p in search.probes]}


def sweep_capacity(points: list[dict[str, Any]]) -> dict[str, Any]:
    """A capacity read off a sweep (``capacity_from_sweep``), its resolution the relative step between
    the two swept points around the crossing (the whole grid's widest step when it never crosses)."""
    pts = sorted(points, key=lambda p: p["server_rps"])
    cap = capacity_from_sweep([(p["server_rps"], p["attainment"]) for p in pts], TARGET)
    steps = [b["server_rps"] / a["server_rps"] - 1 for a, b in zip(pts, pts[1:], strict=False) if a["server_rps"] > 0]
    around = [b["server_rps"] / a["server_rps"] - 1 for a, b in zip(pts, pts[1:], strict=False)
              if cap is not None and a["server_rps"] > 0 and a["server_rps"] <= cap <= b["server_rps"]]
    return {"capacity_server_rps": cap, "bracket": max(around or steps or [0.0])}


def _sweep_point(kw: dict[str, Any], specs: list[RequestSpec], rate: float) -> dict[str, Any]:
    s = run_busy(kw, specs, SLO_)
    return {"client_rps": rate, "server_rps": server_rps(s), "attainment": s["slo_attainment"] or 0.0,
            "decode_busy": s["decode_busy"]}


def _offline_point(kw: dict[str, Any], specs: list[RequestSpec], batch: int) -> dict[str, Any]:
    s = run_busy(kw, specs)
    return {"max_batch": batch, "tok_s": s["output_throughput"], "duration_s": s["duration_s"],
            "prefill_busy": s["prefill_busy"], "decode_busy": s["decode_busy"]}


def reproduce(args: argparse.Namespace, progress: Progress) -> Report:
    from tidal.experiments.bucketserve_overhead import breakdown_run

    quick = args.quick
    seeds = QUICK_SEEDS if quick else SEEDS
    jobs = 1 if quick else usable_cores()
    n_off = 160 if quick else 600
    batches = [16, 64] if quick else [8, 16, 32, 64]
    n_on = 120 if quick else 500
    rates = {"alpaca": [4, 16, 32] if quick else [2, 4, 8, 16, 24, 32, 48],
             "mixed": [0.5, 1.5, 3] if quick else [0.25, 0.5, 1, 1.5, 2, 3, 4]}
    datasets = ["mixed"] if quick else ["alpaca", "mixed"]
    data: dict[str, Any] = {"seeds": list(seeds), "offline": {}, "offline_seeds": {}, "prefill_bound": {},
                            "online": {}, "capacity": {}, "fig6": {}}

    # Fig. 5a: offline throughput (every request at t = 0) against the max batch size (seed 0), and
    # at the largest batch on every seed (the claims)
    calls, keys = [], []
    for seed in seeds:
        specs = workload("mixed", n_off, seed, None)
        for b in batches if seed == seeds[0] else batches[-1:]:
            for name, kw in each(b):
                calls.append((kw, specs, b))
                keys.append((seed, b, name))
    progress(f"offline: {len(calls)} runs")
    for (seed, b, name), r in zip(keys, run_all(_offline_point, calls, jobs), strict=True):
        if seed == seeds[0]:
            data["offline"].setdefault(name, []).append(r)
        if b == batches[-1]:
            data["offline_seeds"].setdefault(name, []).append(r)

    # the same offline run on a prefill-bound layout: 1 prefill + 3 decode, outputs SHORT x shorter
    calls, keys = [], []
    for ds in datasets:
        for seed in seeds:
            # 600 requests even when quick (a run is seconds): with fewer, Alg. 1 keeps one bucket (low load)
            specs = [replace(x, output_len=max(1, x.output_len // SHORT)) for x in workload(ds, 600, seed, None)]
            for name, kw in each(batches[-1], prefill_instances=1):
                if name not in STATIC:
                    calls.append((kw, specs))
                    keys.append((ds, seed, name))
    progress(f"prefill-bound 1 + 3: {len(calls)} runs")
    for (ds, seed, name), s in zip(keys, run_all(run_busy, calls, jobs), strict=True):
        data["prefill_bound"].setdefault(ds, {}).setdefault(name, []).append(
            {"seed": seed, "tok_s": s["output_throughput"], "prefill_busy": s["prefill_busy"],
             "decode_busy": s["decode_busy"]})

    # Fig. 5c-f: SLO attainment and server RPS against the client's rate (seed 0's sweep)
    calls, keys = [], []
    for ds in datasets:
        base = workload(ds, n_on, 1, 1.0)
        for name, kw in each(64):
            for r in rates[ds]:
                calls.append((kw, [replace(x, arrival_s=x.arrival_s / r) for x in base], r))
                keys.append((ds, name))
    progress(f"Fig. 5c-f sweeps: {len(calls)} runs")
    for (ds, name), pt in zip(keys, run_all(_sweep_point, calls, jobs), strict=True):
        data["online"].setdefault(ds, {}).setdefault(name, {"points": []})["points"].append(pt)
    for by in data["online"].values():
        for v in by.values():
            v["capacity_server_rps"] = capacity_from_sweep([(p["server_rps"], p["attainment"]) for p in v["points"]],
                                                           TARGET)

    # the claims' capacity: a bisection on the client's rate, every system, every seed (--quick: read
    # off seed 0's sweep, its bracketing step the resolution)
    calls, keys = [], []
    for ds in datasets if not quick else []:
        for seed in seeds:
            base = workload(ds, n_on, seed + 1, 1.0)
            for name, kw in each(64):
                calls.append((kw, base, *SEARCH[ds], quick))
                keys.append((ds, seed, name))
    progress(f"capacity searches: {len(calls)}")
    for (ds, seed, name), c in zip(keys, run_all(capacity_search, calls, jobs), strict=True):
        data["capacity"].setdefault(ds, {}).setdefault(name, []).append({"seed": seed, **c})
    if quick:
        for ds, by in data["online"].items():
            for name, v in by.items():
                data["capacity"].setdefault(ds, {})[name] = [{"seed": seeds[0], **sweep_capacity(v["points"])}]

    # Fig. 6: BucketServe's latency breakdown and bucketing overhead at three client rates, every seed
    calls, keys = [], []
    for ds in datasets:
        kw = systems(64)[BUCKET]
        for seed in seeds:
            base = workload(ds, n_on, seed + 1, 1.0)
            for r in FIG6_RATES[ds][1:2] if quick else FIG6_RATES[ds]:
                calls.append((kw, [replace(x, arrival_s=x.arrival_s / r) for x in base]))
                keys.append((ds, seed, r))
    progress(f"Fig. 6: {len(calls)} timed runs")
    for (ds, seed, r), got in zip(keys, run_all(breakdown_run, calls, jobs), strict=True):
        per = data["fig6"].setdefault(ds, {"seeds": []})["seeds"]
        if not per or per[-1]["seed"] != seed:
            per.append({"seed": seed, "runs": []})
        per[-1]["runs"].append({"client_rps": r, **got})

    if runs_real(args):
        data["real_offline"] = real_offline(12 if quick else 24, 8, 2, progress, 1 if quick else 3)

    report = Report("bucketserve", "BucketServe (Zheng et al.): bucketed batching against UELLM and DistServe",
                    __doc__.split("\n\n", 1)[1].strip(), quick, data)
    report.claims = claims(data, batches[-1])
    data["readme_line"] = readme_line(report.claims, data.get("real_offline"))
    if not args.no_plots:
        report.figures = plot(data, args.output)
    return report


def _point(data: dict[str, Any], name: str, batch: int) -> dict[str, Any]:
    return next(p for p in data["offline"][name] if p["max_batch"] == batch)


def bound(decode_busy: float | None) -> str:
    """Amdahl's bound on a prefill-side change, from the baseline's decode instances' busy share."""
    return "n/a" if not decode_busy else f"{1 / decode_busy:.2f}x (decode busy {decode_busy:.0%})"


def _real(data: dict[str, Any]) -> str:
    """The real-engine cell of the offline claim, or why it was not run."""
    r = data.get("real_offline")
    if r is None:
        return "not run (--quick skips the real engine; --real runs it)"
    bu, ue = r["BucketServe (bucket)"], r[UELLM]
    reps = r.get("repeats", 1)
    per = "" if reps == 1 else (" (median of " + f"{reps} runs taking turns; per run " + ", ".join(
        f"{a['tok_s'] / b['tok_s']:.2f}x" for a, b in zip(bu["runs"], ue["runs"], strict=True)) + ")")
    return (f"{fmt_ratio(ratio(bu['tok_s'], ue['tok_s']))}{per} ({bu['tok_s']:.0f} vs {ue['tok_s']:.0f} tok/s; "
            f"{r['model']} on this CPU, {r['dtype']}, {r['num_requests']} mixed requests, max batch "
            f"{r['max_batch']}, one instance; the padded baseline computed {ue['padded_tokens_computed']} padding "
            f"tokens) (direction holds: {'yes' if beats(bu['tok_s'], ue['tok_s']) else '**no**'})")


def _per(xs: list[float | None]) -> str:
    return " / ".join("none" if x is None else f"{x:.1f}" for x in xs)


def claims(data: dict[str, Any], batch: int) -> list[Claim]:
    off = data["offline_seeds"]
    bu, ue, ug = (([p["tok_s"] for p in off[n]]) for n in (key(BUCKET, "varlen"), UELLM, UELLM_GROUPED))
    out = [
        Claim("offline throughput: BucketServe over UELLM (Fig. 5a, high load)", "3.58x",
              f"{_per(bu)} vs {_per(ue)} tok/s over FCFS batches, {_per(ug)} over length-grouped ones, per seed (max "
              f"batch {batch})", False,
              "UELLM-like here is padded static batching on the same cost model, its batches either FCFS or "
              "grouped by predicted length as UELLM groups them (the prediction is the request's max_tokens, "
              "exact in the simulator: an upper bound on UELLM's profiler); the padding and the "
              "run-to-completion batches cost what the roofline says, without UELLM's profiling errors "
              "or its HF-style kernels, and the GPUs are modelled, not measured. Absolute rates are low for every "
              "system: Llama-2-13B on a 40 GB A100 leaves a KV pool of ~10.4K tokens, so an instance holds "
              "only two or three 4K-token LongBench requests at once. Ratio per seed: BucketServe over the better "
              "UELLM-like batching. The real run is one instance (no P/D on two cores): bucketed continuous "
              "batching against padded static batching that really computes its padding", real=_real(data),
              per_seed=[b / max(u, g) for b, u, g in zip(bu, ue, ug, strict=True)], margin=MARGIN),
    ]
    per_e = {e: [b["tok_s"] / d["tok_s"] for b, d in zip(off[key(BUCKET, e)], off[key(DIST, e)], strict=True)]
             for e in ENGINES}
    out.append(Claim(
        "offline throughput: BucketServe over DistServe (Fig. 5a)", "1.31x",
        "; ".join(f"{e}: {', '.join(f'{r:.2f}x' for r in per_e[e])} per seed (bound "
                  f"{bound(off[key(DIST, e)][0]['decode_busy'])}, seed 0)" for e in ENGINES), False,
        "DistServe as it behaves (strict FCFS whole prefills, KV held on the prefill instance until a decode "
        "instance takes it, swap-out on decode overflow) on the same engine as BucketServe. The paper's mixed "
        "set on 2 + 2 instances is decode-bound (the bound column): a prefill-side technique cannot pay "
        "there, padded or not. Ratio per seed: the lower of the two engines'",
        per_seed=[min(v) for v in zip(*per_e.values(), strict=True)], margin=MARGIN))
    for ds, pb in data["prefill_bound"].items():
        per = {e: [b["tok_s"] / d["tok_s"] for b, d in zip(pb[key(BUCKET, e)], pb[key(DIST, e)], strict=True)]
               for e in ENGINES}
        out.append(Claim(f"where bucketing pays: a prefill-bound 1 + 3 layout, {ds}, outputs / {SHORT} (offline)",
                         "(not in the paper: its mechanism)",
                         "; ".join(f"{e}: {', '.join(f'{r:.2f}x' for r in per[e])} per seed (bound "
                                   f"{bound(pb[key(DIST, e)][0]['decode_busy'])}, seed 0)" for e in ENGINES), False,
                         "the prefill instance is the bottleneck here (busy ~100 %); on the padded engine bucketing's "
                         "homogeneous batches compute less padding, which is throughput; on the varlen engine there "
                         "is no padding to save and FCFS whole prefills are as good as buckets. Ratio per seed: the "
                         "padded engine's", per_seed=per["padded"], margin=MARGIN))
    paper_cap = {"alpaca": ("1.37x DistServe, 1.975x UELLM", "Fig. 5c"), "mixed": ("1.93x DistServe, 3.47x UELLM", "Fig. 5d")}
    for ds, by in data["capacity"].items():
        cap = {n: [c["capacity_server_rps"] for c in v] for n, v in by.items()}
        for base, label in ((DIST, "DistServe"), (UELLM, "UELLM")):
            engines = ENGINES if base == DIST else ("varlen",)
            per_e, tol = {}, 0.0
            for e in engines:
                b, d = by[key(BUCKET, e)], by[key(base, e)]
                per_e[e] = [x["capacity_server_rps"] / y["capacity_server_rps"]
                            if x["capacity_server_rps"] and y["capacity_server_rps"] else None
                            for x, y in zip(b, d, strict=True)]
                tol = max(tol, *(x["bracket"] for x in b), *(y["bracket"] for y in d))
            per = [min(v) if None not in v else None for v in zip(*per_e.values(), strict=True)]
            sim = "; ".join(f"{e}: {_per(cap[key(BUCKET, e)])} vs {_per(cap[key(base, e)])} req/s per seed"
                            for e in engines) + f"; searches' widest bracket {tol:.1%}"
            out.append(Claim(f"capacity at 80 % SLO attainment, {ds} ({paper_cap[ds][1]}): BucketServe over {label}",
                             paper_cap[ds][0], sim, False,
                             "the SLO values are ours (the paper names none); capacity is a bisection on the client "
                             "rate (the server RPS at it); P/D layout fixed at 2 + 2 instances for both disaggregated "
                             "systems, decode-bound near capacity, so a prefill-side technique has little to gain. "
                             "Ratio per seed: the lower of the engines'",
                             per_seed=[r for r in per if r is not None], margin=tol + MARGIN_PAST_BRACKET,
                             tolerance=tol))
    out += _fig6_claims(data.get("fig6", {}))
    return out


def readme_line(cs: list[Claim], real: dict[str, Any] | None) -> str:
    """The README's BucketServe line, every figure from this run's claims (``data.readme_line``), each
    beside the paper's with how it stands against it."""
    def rng(prefix: str, contains: str = "", paper: tuple[float, float] | None = None) -> str:
        r = claims_range(cs, prefix, contains)
        if r is None:
            return "not run"
        lo, hi, slo, shi, k, m = r
        med = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
        seeds = f"{slo:.2f}x" if f"{slo:.2f}" == f"{shi:.2f}" else f"{slo:.2f}-{shi:.2f}x"
        one = [c.verdict for c in cs if c.claim.startswith(prefix) and contains in c.claim and c.per_seed]
        out = f"{med} (seeds {seeds}; " + (one[0] if m == 1 else f"{k} of {m} hold")
        if paper is not None:
            p = f"{paper[0]:.2f}x" if paper[0] == paper[1] else f"{paper[0]:.2f}-{paper[1]:.2f}x"
            out += f"; {vs_paper(lo, hi, *paper)} {p}"
        return out + ")"

    cap = "capacity at 80 % SLO attainment"
    out = f"offline throughput {rng('offline throughput: BucketServe over UELLM', '', (3.58, 3.58))} a padded " \
          "static batch's, simulated"
    if real is not None:
        bu, ue = real["BucketServe (bucket)"]["tok_s"], real[UELLM]["tok_s"]
        reps = real.get("repeats", 1)
        out += f", {bu / ue:.2f}x on the real engine ({'one run' if reps == 1 else f'median of {reps} runs'})"
    out += (f"; capacity over UELLM-like {rng(cap + ', alpaca', 'over UELLM', (1.975, 1.975))} on Alpaca, "
            f"{rng(cap + ', mixed', 'over UELLM', (3.47, 3.47))} on Mixed. Over DistServe: "
            f"{rng('where bucketing pays')} where prefill binds on an engine that pads (not in the paper); on "
            f"the paper's decode-bound 2 + 2 layout {rng('offline throughput: BucketServe over DistServe', '', (1.31, 1.31))}"
            f" offline, {rng(cap, 'over DistServe', (1.37, 1.93))} in capacity")
    return out + "."


def _dshare(r: dict[str, Any]) -> float:
    return r["decode_s"] / max(r["prefill_s"] + r["decode_s"], 1e-12)


def _fig6_claims(fig6: dict[str, Any]) -> list[Claim]:
    out = []
    for ds, f in fig6.items():
        seeds = f["seeds"]
        # "approximately 90 % ... under typical workloads"; at the highest rate (the paper's 32 RPS) requests
        # queue for prefill: the claim is read at every rate below the highest, the lowest ratio of them
        typical = [min(_dshare(r) for r in sorted(s["runs"], key=lambda r: r["client_rps"])[:-1] or s["runs"])
                   for s in seeds]
        out.append(Claim(
            f"Fig. 6a ({ds}): decode is most of a request's execution time", "decode ~90 % of the execution time; "
            "at 32 RPS queueing for prefill lengthens the prefill part",
            "; ".join(f"at {rate:g} req/s: decode " + " / ".join(f"{_dshare(x['runs'][i]):.0%}" for x in seeds)
                      for i, rate in enumerate(r["client_rps"] for r in seeds[0]["runs"]))
            + " per seed", False,
            "prefill is the request's TTFT (its queueing included), decode the rest of its end-to-end latency; "
            "ratio per seed: decode over prefill time, the lowest at the rates below the highest (the paper's "
            "'typical workloads'; at the highest, its 32 RPS, requests queue for prefill)",
            per_seed=[x / (1 - x) for x in typical if x < 1],
            margin=MARGIN))
        frac = [max(r["overhead_s_per_request"] / max(r["prefill_s"] + r["decode_s"], 1e-12) for r in s["runs"])
                for s in seeds]
        out.append(Claim(
            f"Fig. 6a ({ds}): bucketing overhead under 1 % of the execution time", "under 1 % of the total execution time",
            f"largest over the rates, per seed: {' / '.join(f'{x:.4%}' for x in frac)} (bucket policy's CPU time per "
            f"request, this 2-core shared CPU, over the request's simulated time)", False,
            "the bucket policy is the pure code the engine runs, timed in this process on a shared CPU (a "
            "pessimistic host); ratio per seed: 1 % over the measured share", per_seed=[0.01 / x for x in frac if x > 0],
            margin=MARGIN))
        worst = []
        for s in seeds:
            w = 0.0
            for r in s["runs"]:
                counted = [v["median_s"] for v in r["by_buckets"].values() if v["steps"] >= MIN_STEPS]
                per_step = max(counted, default=0.0)
                w = max(w, per_step / max(r["prefill_step_s"], 1e-12))
            worst.append(w)
        ks = sorted({int(k) for s in seeds for r in s["runs"] for k in r["by_buckets"]})
        # the claim is about growth: with one bucket count of MIN_STEPS steps or more there is none to judge
        judged = {int(k) for s in seeds for r in s["runs"] for k, v in r["by_buckets"].items() if v["steps"] >= MIN_STEPS}
        out.append(Claim(
            f"Fig. 6b ({ds}): bucketing time per step stays small as the buckets grow",
            "overhead stable as the number of buckets increases",
            f"{ks[0] if ks else 0}-{ks[-1] if ks else 0} buckets seen ({len(judged)} bucket count(s) with {MIN_STEPS} "
            f"steps or more); the largest median time per step at any such count over a prefill step's simulated "
            f"time: {' / '.join(f'{x:.3%}' for x in worst)} per seed", False,
            "the median per bucket count (a shared CPU's stalls are in the tail; the tail is in the JSON); ratio per "
            "seed: 1 % of a prefill step over the largest median bucketing time per step at any bucket count"
            + ("" if len(judged) >= 2 else "; n/a: the load never grew the buckets past one count, so how the time "
               "grows with them is not observed here"),
            per_seed=[0.01 / x for x in worst if x > 0], margin=MARGIN, **({} if len(judged) >= 2 else {"verdict": "n/a"})))
    return out


def plot(data: dict[str, Any], out_dir: str) -> list[str]:
    from tidal.common.plots import pyplot

    plt = pyplot()
    files = []
    fig, ax = plt.subplots(figsize=(5, 3.6))
    names = list(data["offline"])
    batches = [p["max_batch"] for p in data["offline"][names[0]]]
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar(np.arange(len(batches)) + i * w, [p["tok_s"] for p in data["offline"][n]], w, label=n)
    ax.set_xticks(np.arange(len(batches)) + 0.4 - w / 2, [str(b) for b in batches])
    ax.set_xlabel("max batch size")
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Fig. 5a: offline throughput (Mixed)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append("bucketserve_fig5a.png")
    fig.savefig(os.path.join(out_dir, files[-1]), dpi=100)
    plt.close(fig)
    if data["prefill_bound"]:
        sets = list(data["prefill_bound"])
        names = list(data["prefill_bound"][sets[0]])
        fig, ax = plt.subplots(figsize=(6, 3.6))
        w = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar(np.arange(len(sets)) + i * w, [float(np.median([x["tok_s"] for x in data["prefill_bound"][d][n]]))
                                                  for d in sets], w, label=n)
        ax.set_xticks(np.arange(len(sets)) + 0.4 - w / 2, sets)
        ax.set_ylabel("throughput (tokens/s)")
        ax.set_title(f"prefill-bound 1 + 3 layout, outputs / {SHORT}: bucketing pays on a padded engine", fontsize=9)
        ax.legend(fontsize=6)
        fig.tight_layout()
        files.append("bucketserve_prefill_bound.png")
        fig.savefig(os.path.join(out_dir, files[-1]), dpi=100)
        plt.close(fig)
    for ds, systems_ in data["online"].items():
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for n, v in systems_.items():
            a1.plot([p["server_rps"] for p in v["points"]], [100 * p["attainment"] for p in v["points"]], "o-", label=n)
            a2.plot([p["client_rps"] for p in v["points"]], [p["server_rps"] for p in v["points"]], "o-", label=n)
        a1.axhline(100 * TARGET, color="gray", ls=":")
        a1.set_xlabel("server RPS")
        a1.set_ylabel("SLO attainment (%)")
        a1.set_title(f"Fig. 5{'c' if ds == 'alpaca' else 'd'}: {ds}", fontsize=9)
        hi = max(p["client_rps"] for v in systems_.values() for p in v["points"])
        a2.plot([0, hi], [0, hi], "k--", lw=0.8, label="y = x")
        a2.set_xlabel("client RPS")
        a2.set_ylabel("server RPS")
        a2.set_title(f"Fig. 5{'e' if ds == 'alpaca' else 'f'}: {ds}", fontsize=9)
        a1.legend(fontsize=7)
        a2.legend(fontsize=7)
        fig.tight_layout()
        files.append(f"bucketserve_fig5_{ds}.png")
        fig.savefig(os.path.join(out_dir, files[-1]), dpi=100)
        plt.close(fig)
    if data.get("fig6"):
        from tidal.experiments.bucketserve_overhead import plot_fig6

        files.append("bucketserve_fig6.png")
        plot_fig6(data["fig6"], os.path.join(out_dir, files[-1]))
    return files
