"""DynaServe on this CPU: 2 real instances, colocated vs 1P1D disaggregated vs split (micro-requests).

For each of the paper's workload shapes (``dynaserve-*`` in ``tidal bench serve``, lengths divided
by ``--scale`` so a 2-core CPU can serve them), each layout is a ``tidal serve`` process of its own
(started, measured and stopped by its pid, one at a time, so the runs never share the cores), and
``tidal bench serve --capacity-search`` finds the highest Poisson rate at which ``--target`` of the
requests meet the SLO (a P99 TBT bound per request, DynaServe Sec. 6, plus a TTFT bound so queues
cannot grow without limit). Prints a table (capacity, goodput, TBT and TTFT at capacity, splits),
writes one JSON and a PNG. Usage::

    python benchmarks/dynaserve_serve.py [--workloads dynaserve-2048-512,dynaserve-219-1467] [--scale 4]
        [--slo tbt=300,ttft=8000] [--num-requests 24] [--max-probes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tidal.bench.server_proc import serve, stop
from tidal.common.machine import describe, machine_info
from tidal.common.results import write_json
from tidal.workload.requests import SHAPES

LAYOUTS = {
    "colocate": ["--instances", "2", "--threads-per-instance", "1"],
    "disaggregate": ["--instances", "2", "--mode", "disaggregate", "--prefill-instances", "1",
                     "--threads-per-instance", "1"],
    "split": ["--instances", "2", "--mode", "split", "--threads-per-instance", "1"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="dynaserve-2048-512,dynaserve-219-1467")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--scale", type=float, default=4.0, help="divide the shapes' lengths by this")
    p.add_argument("--slo", default="tbt=300,ttft=8000")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment a sustained rate needs")
    p.add_argument("--num-requests", type=int, default=24, help="requests per probe")
    p.add_argument("--search-low", type=float, default=0.05)
    p.add_argument("--search-high", type=float, default=2.0)
    p.add_argument("--max-probes", type=int, default=4)
    p.add_argument("--batching", default="slo-compose", help="every instance's local policy (DynaServe Alg. 2)")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--output", default="results/dynaserve_serve.json")
    args = p.parse_args()
    slo = dict(kv.split("=") for kv in args.slo.split(","))
    engine = ["--dtype", "auto", "--kv-cache-memory", args.kv_cache_memory, "--max-num-batched-tokens", "256",
              "--batching", args.batching]
    if "tbt" in slo:  # slo-compose (Alg. 2) composes each step to the same TBT bound the SLO counts
        engine += ["--tbt-slo-ms", slo["tbt"]]
    stem = os.path.splitext(args.output)[0]
    rows = []
    for wl in args.workloads.split(","):
        shape = SHAPES[wl]
        max_in, max_out = max(1, round(shape.in_mean / args.scale)), max(1, round(shape.out_mean / args.scale))
        for layout in args.layouts.split(","):
            proc, url, log = serve(LAYOUTS[layout], engine)
            try:
                out = f"{stem}_{wl}_{layout}.json"
                cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", wl,
                       "--max-input-len", str(max_in), "--max-output-len", str(max_out),
                       "--num-requests", str(args.num_requests), "--capacity-search", "--slo", args.slo,
                       "--target-attainment", str(args.target), "--search-low", str(args.search_low),
                       "--search-high", str(args.search_high), "--max-probes", str(args.max_probes),
                       "--no-progress", "--output", out]
                print(f"{wl} ({max_in}/{max_out} tokens), {layout}: {' '.join(cmd[2:])}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    r = json.load(f)
            finally:
                stop(proc)
                os.unlink(log)
            splits = [q["placement"] for q in r["requests"] if q.get("placement")]
            row = {"workload": wl, "lengths": [max_in, max_out], "layout": layout,
                   "capacity_rps": r["capacity_search"]["capacity_rps"],
                   "goodput_tok_s": r["goodput"]["output_throughput"], "attainment": r["slo_attainment"],
                   "tbt_p99_ms": r["itl_ms"]["p99"], "ttft_p50_ms": r["ttft_ms"]["p50"],
                   "ttft_p99_ms": r["ttft_ms"]["p99"],
                   "split_mean": (sum(s["split"] for s in splits) / len(splits)) if splits else None,
                   "split_fraction": (sum(s["whole_on"] is None for s in splits) / len(splits)) if splits else None,
                   "kv_mb_per_request": (sum(s["kv_bytes"] for s in splits) / len(splits) / 1e6) if splits else None,
                   "probes": [(q["rate"], q["attainment"]) for q in r["capacity_search"]["probes"]]}
            rows.append(row)
            print(f"  capacity {row['capacity_rps']} req/s, goodput {row['goodput_tok_s']:.1f} tok/s, "
                  f"TBT p99 {row['tbt_p99_ms']} ms, probes {row['probes']}", flush=True)

    print(f"\nmachine: {describe(machine_info())}; SLO {args.slo} for {args.target:.0%} of requests; "
          f"{args.num_requests} requests per probe; local policy {args.batching}")
    print(f"{'workload':<22}{'layout':<14}{'capacity':>10}{'goodput':>10}{'TBT p99':>9}{'TTFT p50':>10}"
          f"{'split':>7}{'KV MB':>7}")
    for r in rows:
        def f(x, spec):
            return "-" if x is None else format(x, spec)
        print(f"{r['workload']:<22}{r['layout']:<14}{f(r['capacity_rps'], '.3f'):>10}"
              f"{f(r['goodput_tok_s'], '.1f'):>10}{f(r['tbt_p99_ms'], '.0f'):>9}{f(r['ttft_p50_ms'], '.0f'):>10}"
              f"{f(r['split_fraction'], '.0%'):>7}{f(r['kv_mb_per_request'], '.2f'):>7}")
    write_json({"command": " ".join(sys.argv), "machine": machine_info(), "args": vars(args), "rows": rows},
               args.output)
    _plot(rows, stem + ".png")
    print(f"wrote {args.output} and {stem}.png")
    return 0


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(r["workload"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "capacity_rps", "capacity (req/s at SLO)"),
                           (axes[1], "goodput_tok_s", "goodput at capacity (tok/s)")):
        w = 0.8 / len(layouts)
        for k, lay in enumerate(layouts):
            vals = [next((r[key] or 0 for r in rows if r["workload"] == wl and r["layout"] == lay), 0) for wl in wls]
            ax.bar([i + k * w for i in range(len(wls))], vals, w, label=lay)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(wls))], wls, fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("2 instances on this CPU: colocate vs disaggregate vs split (DynaServe)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
