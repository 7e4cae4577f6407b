"""KunServe on this CPU: 2 real instances with a KV budget small enough to throttle, under bursts.

Each policy for memory pressure is a ``tidal serve --instances 2 --kv-pressure ...`` process of its
own (started, measured and stopped by its pid, one at a time, so the runs never share the cores):
``preempt`` with recompute (vLLM), ``preempt`` with swap (InferCept-like), ``migrate`` (Llumnix-like:
running requests move with their KV to the instance with room) and ``drop`` (KunServe:
the throttled pair drops half of its layers each, runs as one pipeline and exchanges KV, Sec. 4).
Every run sees the same BurstGPT-shaped requests (Gamma arrivals, ``--burstiness`` < 1) through
``tidal bench serve``. While it runs, ``/admin/state`` is sampled to draw each instance's KV
capacity (blocks) and use over time, with the drop and restore events. Prints a table (TTFT and
TPOT percentiles, goodput, events), writes one JSON and a PNG. Usage::

    python benchmarks/kunserve_serve.py [--rate 1.5] [--burstiness 0.25] [--num-requests 48]
        [--kv-cache-memory 24MiB] [--systems preempt,swap,migrate,drop]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import httpx
from cluster_serve import serve, stop

from tidal.common.machine import describe, machine_info
from tidal.common.plots import pyplot, save_figure
from tidal.common.results import write_json

SYSTEMS = {
    "preempt": ("vLLM (preempt: recompute)", ["--kv-pressure", "preempt"]),
    "swap": ("InferCept-like (preempt: swap)", ["--kv-pressure", "preempt", "--preemption-mode", "swap",
                                                "--swap-space", "1GiB"]),
    "migrate": ("Llumnix-like (migrate)", ["--kv-pressure", "migrate"]),
    "drop": ("KunServe (drop)", ["--kv-pressure", "drop"]),
}


class StateSampler(threading.Thread):
    """Polls ``/admin/state`` every ``period`` seconds: per instance (time, KV blocks, free blocks)."""

    def __init__(self, url: str, period: float = 0.5):
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.samples: list[dict] = []
        self.events: list[dict] = []  # KunServe's pressure events, when the sampler first saw them
        self.seen: set[tuple] = set()
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=5, trust_env=False) as c:
            while not self.stopped.wait(self.period):
                try:
                    cluster = c.get(f"{self.url}/admin/state").json().get("cluster") or {}
                except (httpx.HTTPError, ValueError):
                    continue
                t = time.monotonic() - self.t0
                self.samples.append({"t": t, "instances": [{k: i.get(k) for k in ("index", "num_blocks",
                                                                                   "num_free_blocks", "kv_usage")}
                                                           for i in cluster.get("instances", [])]})
                for e in (cluster.get("kv_pressure") or {}).get("events") or []:
                    key = (e.get("kind"), e.get("time"))
                    if key not in self.seen:  # the front end's clock is its own: place it when first seen
                        self.seen.add(key)
                        self.events.append({**e, "seen_s": t})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workload", default="burstgpt")
    p.add_argument("--rate", type=float, default=1.5)
    p.add_argument("--burstiness", type=float, default=0.25)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--max-input-len", type=int, default=384)
    p.add_argument("--max-output-len", type=int, default=96)
    p.add_argument("--slo", default="ttft=5000,tpot=500")
    p.add_argument("--kv-cache-memory", default="24MiB", help="per instance: small enough to throttle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/kunserve_serve.json")
    args = p.parse_args()
    engine = ["--dtype", "auto", "--kv-cache-memory", args.kv_cache_memory, "--max-num-batched-tokens", "256",
              "--instances", "2", "--threads-per-instance", "1"]
    stem = os.path.splitext(args.output)[0]
    rows = []
    for key in args.systems.split(","):
        name, flags = SYSTEMS[key]
        proc, url, log = serve(flags, engine)
        sampler = StateSampler(url)
        try:
            out = f"{stem}_{key}.json"
            cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", args.workload,
                   "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
                   "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                   "--burstiness", str(args.burstiness), "--seed", str(args.seed), "--slo", args.slo,
                   "--no-progress", "--output", out]
            print(f"{name}: {' '.join(cmd[2:])}", flush=True)
            sampler.start()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            sampler.stopped.set()
            sampler.join(5)
            with open(out) as f:
                r = json.load(f)
            final = httpx.get(f"{url}/admin/state", timeout=10, trust_env=False).json().get("cluster") or {}
        finally:
            sampler.stopped.set()
            stop(proc)
            os.unlink(log)
        events = sampler.events
        row = {"system": name, "key": key, "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
               "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"],
               "goodput_tok_s": r["goodput"]["output_throughput"], "attainment": r["slo_attainment"],
               "completed": r["completed"], "preemptions": sum(i.get("num_preemptions", 0) or 0
                                                               for i in final.get("instances", [])),
               "events": events, "timeline": sampler.samples}
        rows.append(row)
        print(f"  TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, TPOT p50/p99 "
              f"{row['tpot_p50_ms']:.0f}/{row['tpot_p99_ms']:.0f} ms, goodput {row['goodput_tok_s']:.1f} tok/s, "
              f"{len(events)} pressure events", flush=True)

    print(f"\nmachine: {describe(machine_info())}; {args.num_requests} {args.workload} requests "
          f"(<= {args.max_input_len}/{args.max_output_len} tokens) at {args.rate} req/s, Gamma burstiness "
          f"{args.burstiness}; KV {args.kv_cache_memory} per instance; SLO {args.slo}")
    print(f"{'system':<34}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}{'TPOT p99':>9}{'goodput':>9}{'SLO':>6}"
          f"{'preempt':>8}{'events':>7}")
    for r in rows:
        print(f"{r['system']:<34}{r['ttft_p50_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}{r['tpot_p50_ms']:>9.0f}"
              f"{r['tpot_p99_ms']:>9.0f}{r['goodput_tok_s']:>9.1f}{r['attainment']:>6.0%}{r['preemptions']:>8}"
              f"{len(r['events']):>7}")
    write_json({"command": " ".join(sys.argv), "machine": machine_info(), "args": vars(args), "rows": rows},
               args.output)
    _plot(rows, stem + ".png")
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
        ax.set_title(f"{r['system']}: TTFT p99 {r['ttft_p99_ms']:.0f} ms", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the load started (s)")
    save_figure(plt, fig, path, "KV capacity over time under bursts (dotted: drop red, restore green, migration orange)")


if __name__ == "__main__":
    sys.exit(main())
