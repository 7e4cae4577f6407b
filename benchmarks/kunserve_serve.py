"""KunServe on this CPU: 2 real instances with a KV budget small enough to throttle, under bursts.

Each policy for memory pressure is a ``tidal serve --instances 2 --kv-pressure ...`` process of its
own (started, measured and stopped by its pid, one at a time, so the runs never share the cores):
``preempt`` with recompute (vLLM), ``preempt`` with swap (InferCept-like), ``migrate`` (Llumnix-like:
running requests move with their KV to the instance with room) and ``drop`` (KunServe:
the throttled pair drops half of its layers each, runs as one pipeline and exchanges KV, Sec. 4).
Every run of a seed sees the same BurstGPT-shaped requests (Gamma arrivals, ``--burstiness`` < 1)
through ``tidal bench serve``, in the memory-bound regime (``tidal.experiments.kunserve_real.resolve``):
the rate keeps every 20 s window of every seed within 85 % of the 2 instances' measured capacity,
the pool is 2x vLLM's mean KV in use over the seeds (unless ``--rate`` / ``--kv-cache-memory`` are
given). While it runs, ``/admin/state`` is sampled to draw each instance's KV capacity (blocks) and
use over time, with the drop and restore events. Prints a table (TTFT and TPOT percentiles,
goodput, events) per seed, writes one JSON (rewritten after each run, ``"complete": false`` until
the last; ``tidal reproduce kunserve --real-json`` reads it) and a PNG of the first seed. Usage::

    python benchmarks/kunserve_serve.py [--rate R] [--burstiness 0.5] [--num-requests 24]
        [--kv-cache-memory SIZE] [--systems preempt,swap,migrate,drop] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import os
import sys

from tidal.common.machine import describe, machine_info
from tidal.common.plots import pyplot, save_figure
from tidal.common.results import write_json
from tidal.experiments.kunserve_real import SYSTEMS, RealSetup, record, resolve, run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = RealSetup()
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workload", default=d.workload)
    p.add_argument("--rate", type=float, default=d.rate, help="default: from the capacity probe")
    p.add_argument("--burstiness", type=float, default=d.burstiness)
    p.add_argument("--num-requests", type=int, default=d.num_requests)
    p.add_argument("--max-input-len", type=int, default=d.max_input_len)
    p.add_argument("--max-output-len", type=int, default=d.max_output_len)
    p.add_argument("--slo", default=d.slo)
    p.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                   help="per instance (default: 2x vLLM's mean KV in use with a large pool)")
    p.add_argument("--probe-requests", type=int, default=d.probe_requests)
    p.add_argument("--window-s", type=float, default=d.window_s)
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="the arrivals' draws, comma-separated")
    p.add_argument("--output", default="results/kunserve_serve.json")
    args = p.parse_args()
    try:
        seeds = tuple(int(x) for x in args.seeds.split(","))
    except ValueError:
        p.error(f"--seeds: comma-separated integers, not {args.seeds!r}")
    setup = RealSetup(**{k: v for k, v in vars(args).items() if k not in ("systems", "output", "seeds")}, seeds=seeds)
    stem = os.path.splitext(args.output)[0]
    command, info = " ".join(["python", *sys.argv]), machine_info()
    setup, regime = resolve(setup, stem, log=lambda msg: print(msg, flush=True))
    rows = run(args.systems.split(","), setup, stem, log=lambda msg: print(msg, flush=True),
               on_row=lambda rows: write_json(record(command, setup, regime, rows, False, info), args.output))

    print(f"\nmachine: {describe(machine_info())}; {args.num_requests} {args.workload} requests "
          f"(<= {args.max_input_len}/{args.max_output_len} tokens) at {setup.rate} req/s, Gamma burstiness "
          f"{args.burstiness}; KV {setup.kv_cache_memory} bytes per instance; SLO {args.slo}; regime {regime}")
    print(f"{'system':<34}{'seed':>5}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}{'TPOT p99':>9}{'goodput':>9}{'SLO':>6}"
          f"{'preempt':>8}{'events':>7}")
    for r in rows:
        print(f"{r['system']:<34}{r['seed']:>5}{r['ttft_p50_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}{r['tpot_p50_ms']:>9.0f}"
              f"{r['tpot_p99_ms']:>9.0f}{r['goodput_tok_s']:>9.1f}{r['attainment']:>6.0%}{r['preemptions']:>8}"
              f"{len(r['events']):>7}")
    write_json(record(command, setup, regime, rows, True, info), args.output)
    _plot([r for r in rows if r["seed"] == setup.seeds[0]], stem + ".png")
    print(f"wrote {args.output} and {stem}.png")
    return 0


def _plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.6 * len(rows)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows, strict=True):
        tl = r["timeline"]
        n = max((len(s["instances"]) for s in tl), default=0)
        for i in range(n):
            ts = [s["t"] for s in tl if len(s["instances"]) > i]
            cap = [s["instances"][i]["num_blocks"] for s in tl if len(s["instances"]) > i]
            used = [s["instances"][i]["num_blocks"] - s["instances"][i]["num_free_blocks"]
                    for s in tl if len(s["instances"]) > i]
            ax.plot(ts, cap, label=f"instance {i} capacity", linewidth=1.5)
            ax.plot(ts, used, linestyle="--", label=f"instance {i} in use", linewidth=1)
        colors = {"drop": "red", "restore-done": "green", "migrate": "orange"}
        for e in r["events"]:
            if e.get("kind") in colors:
                ax.axvline(e["seen_s"], color=colors[e["kind"]], linestyle=":", linewidth=1)
        ax.set_ylabel("KV blocks")
        ax.set_title(f"{r['system']}, seed {r['seed']}: TTFT p99 {r['ttft_p99_ms']:.0f} ms", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the load started (s)")
    save_figure(plt, fig, path, "KV capacity over time under bursts (dotted: drop red, restore green, migration orange)")


if __name__ == "__main__":
    sys.exit(main())
