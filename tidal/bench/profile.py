"""``tidal profile``: time the real engine's step over a grid of batch shapes and fit the
simulator's profiled cost model to it (the measuring is :mod:`tidal.engine.profiler`, the fit is
:class:`tidal.sim.profiled.ProfiledCostModel`; this command joins the two), and fit KunServe Eq.
1's alpha, beta, gamma per decoder layer (:func:`tidal.engine.profiler.profile_eq1`)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from tidal.common import flags as F
from tidal.common.progress import progress_lines
from tidal.common.results import write_json
from tidal.engine import profiler


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time the engine's step over a grid of batch shapes (for the simulator)")
    p.add_argument("--quick", action="store_true", help="a handful of grid points (smoke test)")
    p.add_argument("--no-live", action="store_true", help="grid points only, no steps of a live serving run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (the median is kept)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per point")
    F.add_engine_flags(p, aliases={"num_threads": ["--threads"]}, defaults={"kv_cache_memory": "2GiB"},
                       helps={"num_threads": "CPU threads (default: all cores); one thread is far steadier on a "
                                             "shared machine",
                              "kv_cache_memory": "KV pool; the largest grid point needs ~1.6GiB in bf16"})
    F.add_output_flags(p, "results/profile_cpu.json", plots=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tidal.config import ConfigError, EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    from tidal.sim.profiled import ProfiledCostModel

    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    cfg = EngineConfig.from_kwargs(**F.engine_kwargs(args))
    engine = LLMEngine(cfg)
    grid = profiler.default_grid(args.quick)
    t0 = time.monotonic()
    grid_lines = progress_lines(None, not args.no_progress, every_s=10.0)
    live_lines = []  # started with the first live run, so its time-left estimate is its own

    def progress(done: int, total: int, sample: dict[str, Any]) -> None:
        if sample.get("live"):
            if not live_lines:
                live_lines.append(progress_lines(total, not args.no_progress))
            live_lines[0].report(done, f"live serving run: {sample['steps']} steps")
            return
        grid_lines.total = total
        grid_lines.report(done, f"grid runs (pass {sample['pass'] + 1}), last {sample['time_s'] * 1000:.1f} ms")

    dtype = str(engine.dtype).removeprefix("torch.")
    print(f"profiling {engine.checkpoint.path} ({dtype}, {torch.get_num_threads()} threads, "
          f"{len(grid)} points x {args.warmup}+{args.repeats} runs)", flush=True)
    live = () if args.no_live else (((8, 4.0),) if args.quick else profiler.LIVE_RUNS)
    data = profiler.profile_engine(engine, grid, repeats=args.repeats, warmup=args.warmup, progress=progress,
                                   live_runs=live, eq1=profiler.eq1_grid(args.quick))
    data["elapsed_s"] = round(time.monotonic() - t0, 1)
    out = args.output
    write_json(data, out)
    try:
        rep = ProfiledCostModel.from_profile(data).fit_report()
        fit = (f"fit R2 {rep['r2']:.4f}, median |rel err| {rep['median_abs_rel_err']:.1%}, "
               f"p90 {rep['p90_abs_rel_err']:.1%}")
        n_live = sum(1 for s in data["samples"] if s.get("source") == "live")
        if n_live:
            fit += f" ({n_live} of the samples are steps of live serving)"
    except ValueError as e:
        fit = f"no fit ({e})"
    ov = data["overhead"]
    noisy = sum(max(s["times_s"]) > 1.5 * min(s["times_s"]) for s in data["samples"] if "times_s" in s)
    if noisy:
        print(f"warning: {noisy} samples vary by more than 1.5x between runs (is something else using "
              "the CPU?)", flush=True)
    print(f"wrote {out}: {len(data['samples'])} samples ({len(data['skipped'])} skipped) in {data['elapsed_s']:.0f}s; "
          f"{fit}; overhead {ov['per_step_s'] * 1e3:.2f} ms + {ov['per_seq_s'] * 1e6:.1f} us/seq", flush=True)
    e = data["eq1"]  # KunServe Eq. 1, for `tidal serve --kv-pressure drop --profile`
    print(f"Eq. 1 per decoder layer ({len(e['points'])} points, R2 {e['r2']:.4f}): alpha {e['alpha']:.4g} s/pair, "
          f"beta {e['beta']:.4g} s/token, gamma {e['gamma']:.4g} s/chunk", flush=True)
    return 0
