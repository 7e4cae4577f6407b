"""``tidal bench policies``: the scheduling policies side by side on the real engine.

Every policy serves the same timed workload: a mix of short and long requests with Poisson
(or Gamma) arrivals, in one process on one model. The TBT SLO is set relative to the decode
step time measured first on this machine. The benchmark reports output tokens/s, P50/P99 TBT,
TTFT, SLO attainment, goodput and the padding waste (BucketServe Eq. 2) a padded batch of each
step's requests would have. It writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.common import flags as F
from tidal.common.machine import describe, machine_info
from tidal.common.progress import progress_bar
from tidal.common.results import command_line, write_result
from tidal.config import ConfigError, parse_policy_args
from tidal.metrics import SLO, RequestRecord, summarize
from tidal.policies import policy_args_for
from tidal.workload import gamma_arrivals

DEFAULT_POLICIES = "static,continuous,bucket,memory,sla,slo-compose,bucket+memory+sla"
PROG = "tidal bench policies"


@dataclass
class Job:
    index: int
    arrival_s: float
    prompt: list[int]
    output_len: int


def make_jobs(n: int, rate: float, burstiness: float, seed: int, vocab: int, long_frac: float,
              short: tuple[int, int], long: tuple[int, int], out_short: tuple[int, int],
              out_long: tuple[int, int]) -> list[Job]:
    """Mixed short/long requests (the shape BucketServe targets); random token ids."""
    rng = np.random.default_rng(seed)
    arrivals = gamma_arrivals(rng, n, rate, burstiness)
    jobs = []
    for i in range(n):
        is_long = rng.random() < long_frac
        lo, hi = long if is_long else short
        olo, ohi = out_long if is_long else out_short
        plen = int(rng.integers(lo, hi + 1))
        jobs.append(Job(i, float(arrivals[i]), rng.integers(100, vocab - 100, size=plen).tolist(),
                        int(rng.integers(olo, ohi + 1))))
    return jobs


def run_policy(engine: Any, jobs: list[Job], progress: bool = True, desc: str = "requests"
               ) -> tuple[list[RequestRecord], dict]:
    """Replay ``jobs`` in real time on ``engine``; per-token delivery times give TTFT and TBT."""
    from tidal.core.sampling import SamplingParams
    from tidal.policies.bucket import waste_ratio

    records = {j.index: RequestRecord(j.index, j.arrival_s, len(j.prompt), j.output_len) for j in jobs}
    last_tok: dict[int, float] = {}
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    waste, caps, steps, step_times = [], [], 0, []
    bar = progress_bar(len(jobs), desc, "req", progress)
    t0 = time.monotonic()
    nxt = 0
    done = 0
    while done < len(jobs):
        now = time.monotonic() - t0
        while nxt < len(pending) and pending[nxt].arrival_s <= now:
            j = pending[nxt]
            sp = SamplingParams(temperature=0, max_tokens=j.output_len, ignore_eos=True)
            engine.add_request(str(j.index), None, sp, prompt_token_ids=j.prompt)
            records[j.index].send_s = now
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, pending[nxt].arrival_s - now)))
            continue
        outs = engine.step()
        now = time.monotonic() - t0
        res = engine.last_result
        steps += 1
        step_times.append(res.step_time_s)
        if res.composition.context_lens:
            waste.append(waste_ratio(res.composition.context_lens))
        caps.append(engine.scheduler.last_caps.max_num_seqs)
        for out in outs:
            i = int(out.request_id)
            rec = records[i]
            n_new = len(out.outputs[0].delta_token_ids)
            if n_new and rec.ttft_s is None:
                rec.ttft_s = now - rec.send_s
            elif n_new:
                rec.itl_s.append(now - last_tok[i])
            if n_new:
                last_tok[i] = now
                rec.counted_tokens += n_new
            if out.finished:
                rec.end_s = now
                rec.e2e_s = now - rec.send_s
                rec.success = out.outputs[0].finish_reason == "length"
                rec.output_tokens = len(out.outputs[0].token_ids)
                rec.prompt_tokens = len(out.prompt_token_ids)
                done += 1
                bar.update(1)
    bar.close()
    extra = {
        "steps": steps,
        "padding_waste_mean": statistics.fmean(waste) if waste else 0.0,
        "batch_cap_mean": statistics.fmean(caps) if caps else 0.0,
        "step_time_ms_p50": 1000 * statistics.median(step_times) if step_times else None,
        "num_preemptions": engine.scheduler.num_preemptions,
        "policy_state": engine.policy.state().to_dict(),
    }
    return list(records.values()), extra


def measure_decode_step(build: Any, batch: int, vocab: int) -> float:
    """Median decode step time (s) at ``batch`` running requests: the SLO's yardstick."""
    from tidal.core.sampling import SamplingParams

    engine = build("continuous")
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"w{i}", None, sp, prompt_token_ids=rng.integers(100, vocab - 100, size=96).tolist())
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        c = engine.last_result.composition
        if c.num_prefill_tokens == 0 and c.num_decode_seqs:
            times.append(engine.last_result.step_time_s)
    return statistics.median(times)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policies", help="scheduling policies side by side on the real engine",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated --batching values")
    p.add_argument("--long-frac", type=float, default=0.3, help="share of long requests")
    p.add_argument("--tbt-slo-factor", type=float, default=3.0,
                   help="TBT SLO = this x the measured decode step time at --slo-batch")
    p.add_argument("--slo-batch", type=int, default=16)
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="optional TTFT SLO")
    F.add_engine_flags(p, omit=("engine_seed",), defaults={"kv_cache_memory": "256MiB"})
    F.add_scheduler_flags(p, omit=("batching", "tbt_slo_ms", "max_queued_requests"),
                          defaults={"max_num_seqs": 32, "max_num_batched_tokens": 512})
    F.add_workload_flags(p, only=("num_requests", "rate", "burstiness", "seed"),
                         defaults={"num_requests": 48, "rate": 3.0, "burstiness": 1.0},
                         helps={"rate": "mean arrivals per second"})
    F.add_output_flags(p, "results/policies.json")
    p.set_defaults(func=run)


def _plot(results: dict[str, Any], path: str) -> None:
    from tidal.common.plots import pyplot

    plt = pyplot()

    names = list(results)
    panels = [("output tok/s", lambda r: r["summary"]["output_throughput"]),
              ("P99 TBT (ms)", lambda r: r["summary"]["itl_ms"]["p99"]),
              ("P50 TTFT (ms)", lambda r: r["summary"]["ttft_ms"]["p50"]),
              ("SLO attainment", lambda r: r["summary"]["slo_attainment"]),
              ("padding waste (Eq. 2)", lambda r: r["padding_waste_mean"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (title, get) in zip(axes, panels, strict=True):
        ax.bar(range(len(names)), [get(results[n]) or 0 for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from tidal.engine.llm_engine import LLMEngine, dtype_name
    from tidal.engine.loader import load_checkpoint
    from tidal.engine.tokenizer import Tokenizer

    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not names:
        raise ConfigError("--policies names no policy")
    dtype = dtype_name(args.dtype, args.device)  # "auto" as the engine resolves it: reported, never "auto"
    given = parse_policy_args(args.policy_args or [])
    unused = set(given) - {k for b in names for k in policy_args_for(b, given)}
    if unused:
        raise ConfigError(f"policy argument {sorted(unused)[0]}: no policy of --policies {args.policies!r} takes it")
    for b in names:  # bad flags, policy names or parameters fail before the model loads
        F.engine_config(args, dtype=dtype, batching=b, policy_args=policy_args_for(b, given),
                        tbt_slo_ms=50.0)  # a placeholder: the real SLO is measured below
    ckpt = load_checkpoint(args.model)
    tok = Tokenizer.from_checkpoint(ckpt)
    vocab = ckpt.arch.vocab_size

    def build(batching: str, tbt_slo_ms: float | None = None) -> LLMEngine:
        cfg = F.engine_config(args, model=ckpt.path, dtype=dtype, batching=batching, tbt_slo_ms=tbt_slo_ms,
                              policy_args=policy_args_for(batching, given))
        return LLMEngine(cfg, checkpoint=ckpt, tokenizer=tok)

    command = command_line(PROG)
    print(f"command: {command}")
    step = measure_decode_step(build, args.slo_batch, vocab)  # builds an engine: the threads are set
    machine = machine_info(dtype=dtype)
    print(f"machine: {describe(machine)}")
    tbt_slo_ms = args.tbt_slo_factor * step * 1000
    slo = SLO(tpot_s=tbt_slo_ms / 1000, ttft_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms else None)
    print(f"decode step at batch {args.slo_batch}: {step * 1000:.1f} ms -> TBT SLO {tbt_slo_ms:.1f} ms")
    jobs = make_jobs(args.num_requests, args.rate, args.burstiness, args.seed, vocab, args.long_frac,
                     short=(32, 128), long=(512, 1024), out_short=(32, 96), out_long=(64, 160))
    results: dict[str, Any] = {}
    for name in names:
        print(f"policy {name}:", flush=True)
        engine = build(name, tbt_slo_ms)
        records, extra = run_policy(engine, jobs, progress=not args.no_progress, desc=name)
        summary = summarize(records, slo=slo)
        results[name] = {"summary": summary, **extra, "records": [r.to_dict() for r in records]}
        del engine
    hdr = f"{'policy':<22}{'out tok/s':>10}{'TBT p50':>9}{'TBT p99':>9}{'TTFT p50':>10}{'TTFT p99':>10}" \
          f"{'attain':>8}{'goodput':>9}{'waste':>7}{'cap':>6}"
    print(hdr)
    for name, r in results.items():
        s = r["summary"]
        print(f"{name:<22}{s['output_throughput']:>10.1f}{s['itl_ms']['p50']:>9.1f}{s['itl_ms']['p99']:>9.1f}"
              f"{s['ttft_ms']['p50']:>10.0f}{s['ttft_ms']['p99']:>10.0f}{s['slo_attainment']:>8.2f}"
              f"{s['goodput']['output_throughput']:>9.1f}{r['padding_waste_mean']:>7.2f}{r['batch_cap_mean']:>6.1f}")
    base = results.get("static")
    if base:
        print("output tok/s relative to static: " + ", ".join(
            f"{n} {r['summary']['output_throughput'] / base['summary']['output_throughput']:.2f}x"
            for n, r in results.items()))
    report = {"command": command, "machine": machine, "dtype": dtype, "decode_step_ms": step * 1000,
              "tbt_slo_ms": tbt_slo_ms, "workload": {"num_requests": args.num_requests, "rate": args.rate,
                                                     "burstiness": args.burstiness, "long_frac": args.long_frac},
              "results": results}
    plots = write_result(report, args.output, not args.no_plots, plotter=_write_plot, prog=PROG)
    print(f"wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


def _write_plot(report: dict[str, Any], json_path: str) -> list[str]:
    png = os.path.splitext(json_path)[0] + ".png"
    _plot(report["results"], png)
    return [png]
