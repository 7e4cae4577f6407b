"""``tidal bench sim-accuracy``: the simulator against the real engine on the same workload.

The real engine (default model, this CPU) replays a timed workload in real time, in process;
the simulator replays the same requests through the same scheduler with the profiled CPU cost
model (a ``tidal profile`` file) and the same KV pool. Both measure TTFT from the scheduled
arrival (a request that arrives during a step waits for it, as it would in a server), TPOT as
``(e2e - ttft) / (n - 1)`` and output throughput over the run. Two loads: a light one and one
near the capacity the simulator predicts. Prints a table of P50/P99 TTFT and TPOT and
throughput with the simulator's error, writes JSON and a PNG of the CDFs.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from tidal.common import flags as F
from tidal.common.progress import progress_bar
from tidal.common.results import command_line, write_result
from tidal.metrics import RequestRecord, summarize, tpot
from tidal.workload import RequestSpec, gamma_arrivals

PROG = "tidal bench sim-accuracy"
METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"))


def make_specs(n: int, seed: int, prompt: tuple[int, int], output: tuple[int, int]) -> list[RequestSpec]:
    """Uniform lengths, Poisson arrivals at 1 req/s (rescaled per load)."""
    rng = np.random.default_rng(seed)
    t = gamma_arrivals(rng, n, 1.0)
    return [RequestSpec(float(t[i]), int(rng.integers(prompt[0], prompt[1] + 1)),
                        int(rng.integers(output[0], output[1] + 1))) for i in range(n)]


def at_rate(specs: list[RequestSpec], rate: float) -> list[RequestSpec]:
    return [replace(s, arrival_s=s.arrival_s / rate) for s in specs]


def replay_engine(engine: Any, specs: list[RequestSpec], vocab: int, seed: int = 0, progress: bool = False,
                  desc: str = "engine") -> list[RequestRecord]:
    """Real-time replay on the engine; times are seconds from the first scheduled arrival."""
    from tidal.core.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab - 100, size=s.prompt_len).tolist() for s in specs]
    records = [RequestRecord(i, s.arrival_s, s.prompt_len, s.output_len) for i, s in enumerate(specs)]
    last: dict[int, float] = {}
    bar = progress_bar(len(specs), desc, "req", progress)
    t0 = time.monotonic()
    nxt, done = 0, 0
    while done < len(specs):
        now = time.monotonic() - t0
        while nxt < len(specs) and specs[nxt].arrival_s <= now:
            s = specs[nxt]
            engine.add_request(str(nxt), None, SamplingParams(temperature=0.0, max_tokens=s.output_len,
                                                               ignore_eos=True),
                               prompt_token_ids=prompts[nxt], arrival_time=t0 + s.arrival_s)
            records[nxt].send_s = s.arrival_s
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, specs[nxt].arrival_s - now))
            continue
        outs = engine.step()
        now = time.monotonic() - t0
        for out in outs:
            i = int(out.request_id)
            rec = records[i]
            n = len(out.outputs[0].delta_token_ids)
            if n:
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.send_s
                else:
                    rec.itl_s.extend([(now - last[i]) / n] * n)
                last[i] = now
                rec.counted_tokens += n
            if out.finished:
                rec.end_s, rec.e2e_s = now, now - rec.send_s
                rec.output_tokens = len(out.outputs[0].token_ids)
                rec.success = out.outputs[0].finish_reason == "length"
                done += 1
                bar.update(1)
    bar.close()
    return records


def simulate(specs: list[RequestSpec], engine: Any, profile: str, time_factor: float = 1.0) -> list[RequestRecord]:
    from tidal.sim.build import ClusterSpec, build_simulator

    sc = engine.config.scheduler
    spec = ClusterSpec(model="smollm2-135m", hardware="cpu", cost_model="profiled", profile=profile,
                       block_size=engine.kv_manager.block_size, num_blocks=engine.kv_manager.num_blocks,
                       max_model_len=engine.max_model_len, time_factor=time_factor,
                       scheduler=replace(sc),  # the engine's own scheduler config, copied
                       enable_prefix_caching=engine.kv_manager.enable_caching)  # a recompute re-hits its blocks
    return build_simulator(spec, specs).run().records


def sim_saturation_rate(specs: list[RequestSpec], engine: Any, profile: str, ttft_limit_s: float) -> float:
    """The highest rate (bisection) at which the simulator's P50 TTFT stays under ``ttft_limit_s``."""
    lo, hi = 0.05, 64.0
    for _ in range(14):
        mid = (lo * hi) ** 0.5
        s = summarize(simulate(at_rate(specs, mid), engine, profile))
        if s["ttft_ms"]["p50"] is not None and s["ttft_ms"]["p50"] <= ttft_limit_s * 1000:
            lo = mid
        else:
            hi = mid
    return lo


def median_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each compared figure as its median over repeated engine runs (the machine is noisy)."""
    out: dict[str, Any] = {key: {} for key, _ in METRICS}
    for key, q in METRICS:
        out[key][q] = float(np.median([r[key][q] for r in runs]))
    out["output_throughput"] = float(np.median([r["output_throughput"] for r in runs]))
    out["runs"] = [{k: r[k] for k in ("ttft_ms", "tpot_ms", "output_throughput")} for r in runs]
    return out


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for key, q in METRICS:
        a, b = real[key][q], sim[key][q]
        rows[f"{key.split('_')[0]}_{q}_ms"] = {"engine": a, "sim": b, "error": (b - a) / a if a else None}
    a, b = real["output_throughput"], sim["output_throughput"]
    rows["output_tok_s"] = {"engine": a, "sim": b, "error": (b - a) / a if a else None}
    return rows


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim-accuracy", help="the simulator (profiled CPU model) against the real engine",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="results/profile_cpu.json", help="`tidal profile` output to simulate with")
    p.add_argument("--prompt-len", default="64-512", help="uniform prompt lengths A-B")
    p.add_argument("--output-len", default="32-128", help="uniform output lengths A-B")
    p.add_argument("--loads", default="0.3,0.85", help="fractions of the simulated saturation rate")
    p.add_argument("--saturation-ttft-s", type=float, default=1.0,
                   help="saturation = the rate where the simulated P50 TTFT reaches this")
    p.add_argument("--repeats", type=int, default=1, help="engine runs per load (medians are reported)")
    F.add_engine_flags(p, omit=("engine_seed",), helps={
        "num_threads": "CPU threads for the engine (default: the profile's); must match the profile's",
        "dtype": "weights and KV dtype (default auto, as the engine resolves it); must match the profile's"})
    F.add_scheduler_flags(p, omit=("max_queued_requests",))
    F.add_workload_flags(p, only=("num_requests", "seed"), defaults={"num_requests": 60})
    F.add_output_flags(p, "results/sim_accuracy.json")
    p.set_defaults(func=run)


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition("-")
    return int(a), int(b or a)


def _plot(runs: list[dict[str, Any]], path: str) -> None:
    from tidal.common.plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for row, run in zip(axes, runs, strict=True):
        for ax, key in zip(row, ("ttft", "tpot"), strict=True):
            for who, style in (("engine", "-"), ("sim", "--")):
                vals = np.sort([v * 1000 for v in run[f"{who}_{key}_s"] if v is not None])
                if vals.size:
                    ax.step(vals, np.arange(1, vals.size + 1) / vals.size, style, where="post", label=who)
            ax.set_xlabel(f"{key.upper()} (ms)")
            ax.set_ylabel("fraction")
            ax.set_title(f"{key.upper()} at {run['rate']:.2f} req/s ({run['load']:.0%} of saturation)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from tidal.common.machine import describe, machine_info
    from tidal.engine.llm_engine import LLMEngine, dtype_name
    from tidal.engine.loader import load_checkpoint
    from tidal.engine.profiler import record_steps
    from tidal.engine.tokenizer import Tokenizer
    from tidal.sim.profiled import ProfiledCostModel

    if not os.path.isfile(args.profile):
        return _error(f"profile not found: {args.profile} (run `tidal profile` first)")
    model = ProfiledCostModel.load(args.profile)
    fit = model.fit_report()
    threads = args.num_threads or model.meta.get("threads")
    if model.meta.get("threads") not in (None, threads):
        return _error(f"the profile was taken with {model.meta['threads']} threads, the engine would run with "
                      f"{threads}: step times would not compare (pass --num-threads {model.meta['threads']} or "
                      f"profile with --num-threads {threads})")
    dtype = dtype_name(args.dtype, args.device)  # "auto" as the engine resolves it: reported, never "auto"
    if model.meta.get("dtype") not in (None, dtype):
        return _error(f"the profile was taken in {model.meta['dtype']}, the engine would run in {dtype}: step "
                      f"times would not compare (pass --dtype {model.meta['dtype']} or profile with --dtype {dtype})")
    F.engine_config(args, dtype=dtype, num_threads=threads)  # a bad flag fails before the model loads
    ckpt = load_checkpoint(args.model)
    tok = Tokenizer.from_checkpoint(ckpt)

    def build() -> LLMEngine:
        return LLMEngine(F.engine_config(args, model=ckpt.path, dtype=dtype, num_threads=threads),
                         checkpoint=ckpt, tokenizer=tok)

    engine = build()  # sets the thread count the machine line reports
    command, machine = command_line(PROG), machine_info(dtype=dtype)
    print(f"command: {command}\nmachine: {describe(machine)}")
    print(f"profile {args.profile}: fit median error {fit['median_abs_rel_err']:.1%}, R2 {fit['r2']:.4f}")
    base = make_specs(args.num_requests, args.seed, _range(args.prompt_len), _range(args.output_len))
    sat = sim_saturation_rate(base, engine, args.profile, args.saturation_ttft_s)
    print(f"simulated saturation (P50 TTFT {args.saturation_ttft_s:g} s): {sat:.2f} req/s")
    warm = make_specs(4, args.seed + 1, (32, 64), (4, 4))
    replay_engine(engine, [replace(s, arrival_s=0.0) for s in warm], ckpt.arch.vocab_size)
    runs = []
    for load in [float(x) for x in args.loads.split(",")]:
        rate = load * sat
        specs = at_rate(base, rate)
        sim_records = simulate(specs, engine, args.profile)
        sim_sum = summarize(sim_records)
        reals, ratios = [], []
        for r in range(args.repeats):
            print(f"load {load:.0%} ({rate:.2f} req/s): engine run {r + 1}/{args.repeats}, "
                  f"{len(specs)} requests over {specs[-1].arrival_s:.0f} s ...", flush=True)
            del engine
            gc.collect()
            engine = build()
            replay_engine(engine, [replace(s, arrival_s=0.0) for s in warm], ckpt.arch.vocab_size)
            steps, _ = record_steps(engine)
            gc.collect()
            gc.freeze()  # the harness's own objects stay out of the collector's way during the run
            try:
                recs = replay_engine(engine, specs, ckpt.arch.vocab_size, progress=not args.no_progress,
                                     desc=f"load {load:.0%}, run {r + 1}")
            finally:
                gc.unfreeze()
            reals.append((summarize(recs), recs))
            # total measured over total predicted execute time: the run's machine speed as the
            # queues feel it (the service rate), relative to when the profile was taken
            ratios.append(sum(t for _, t in steps) / sum(model.execute_time(c) for c, _ in steps))
        real_sum = median_summary([r for r, _ in reals])
        real_recs = reals[0][1]
        rows = compare(real_sum, sim_sum)
        # the machine's speed drifts between runs (shared host): the same simulation, with each
        # run's own measured/predicted step-time ratio, separates that drift from the model
        norm_sum = median_summary([summarize(simulate(specs, engine, args.profile, x)) for x in ratios])
        norm_rows = compare(real_sum, norm_sum)
        runs.append({"load": load, "rate": rate, "rows": rows, "engine": real_sum, "sim": sim_sum,
                     "step_time_ratio": ratios, "rows_at_measured_speed": norm_rows, "sim_at_speed": norm_sum,
                     "engine_ttft_s": [r.ttft_s for r in real_recs], "sim_ttft_s": [r.ttft_s for r in sim_records],
                     "engine_tpot_s": [tpot(r) for r in real_recs], "sim_tpot_s": [tpot(r) for r in sim_records]})
        print(f"machine speed in each engine run, total measured / predicted execute time: "
              f"{', '.join(f'{x:.3f}' for x in ratios)}")
        print(f"{'metric':<16}{'engine':>10}{'sim':>10}{'error':>9}{'sim@speed':>11}{'error':>9}")
        for name, row in rows.items():
            nr = norm_rows[name]
            print(f"{name:<16}{row['engine']:>10.1f}{row['sim']:>10.1f}{row['error']:>+9.1%}"
                  f"{nr['sim']:>11.1f}{nr['error']:>+9.1%}")
    report = {"command": command, "machine": machine, "dtype": dtype, "profile": args.profile, "fit": fit,
              "saturation_rps": sat, "runs": runs}
    plots = write_result(report, args.output, not args.no_plots, plotter=_write_plot, prog=PROG)
    print(f"wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


def _write_plot(report: dict[str, Any], json_path: str) -> list[str]:
    png = os.path.splitext(json_path)[0] + ".png"
    _plot(report["runs"], png)
    return [png]
