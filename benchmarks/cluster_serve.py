"""Real serving on this CPU: one instance against two (colocated, and prefill/decode disaggregated),
the same total threads, the same Azure conversation slice through ``tidal bench serve``.

Each layout is a ``tidal serve`` process of its own (started, measured, stopped by its pid, one at a
time, so the runs do not share the cores); every layout sees the same requests at the same rate.
Prints a table (TTFT/TPOT percentiles, attainment, goodput) and writes one JSON beside the
per-layout ones. Usage::

    python benchmarks/cluster_serve.py --rate 0.6 --num-requests 40 [--repeats 1] [--slo ttft=4000,tpot=400]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tidal.common.machine import describe, machine_info
from tidal.common.results import write_json
from tidal.experiments.server_proc import serve, stop

LAYOUTS = {
    "1 instance (2 threads)": ["--instances", "1", "--num-threads", "2"],
    "2 colocated (1 thread each)": ["--instances", "2", "--threads-per-instance", "1"],
    "1 prefill + 1 decode (1 thread each)": ["--instances", "2", "--mode", "disaggregate", "--prefill-instances",
                                             "1", "--threads-per-instance", "1"],
}
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=0.6)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--slo", default="ttft=4000,tpot=400")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--output", default="results/cluster_serve.json")
    args = p.parse_args()
    engine = ["--dtype", "auto", "--kv-cache-memory", args.kv_cache_memory, "--max-num-batched-tokens", "256"]
    trace = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces",
                         "azure2023_conv.csv")
    rows: dict[str, list[dict]] = {}
    stem = os.path.splitext(args.output)[0]
    for rep in range(args.repeats):
        for k, (name, flags) in enumerate(LAYOUTS.items()):
            proc, url, log = serve(flags, engine)
            try:
                out = f"{stem}_{k}_{rep}.json"
                cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--trace", trace,
                       "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                       "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len),
                       "--slo", args.slo, "--no-progress", "--output", out]
                print(f"[{rep + 1}/{args.repeats}] {name}: {' '.join(cmd[2:])}", flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    rows.setdefault(name, []).append(json.load(f))
            finally:
                stop(proc)
                os.unlink(log)

    def med(name: str, key: str, pct: str | None = None) -> float | None:
        vals = [(r[key][pct] if pct else r[key]) for r in rows[name]]
        vals = sorted(v for v in vals if v is not None)
        return vals[len(vals) // 2] if vals else None

    print(f"\nmachine: {describe(machine_info())}; {args.num_requests} Azure conversation requests at "
          f"{args.rate} req/s (inputs <= {args.max_input_len}, outputs <= {args.max_output_len}), SLO {args.slo}; "
          f"median of {args.repeats}")
    print(f"{'layout':<40}{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'attain':>8}{'goodput tok/s':>15}")
    table = []
    for name in rows:
        row = {"layout": name, "ttft_p50_ms": med(name, "ttft_ms", "p50"), "ttft_p99_ms": med(name, "ttft_ms", "p99"),
               "tpot_p50_ms": med(name, "tpot_ms", "p50"), "tpot_p99_ms": med(name, "tpot_ms", "p99"),
               "attainment": med(name, "slo_attainment"),
               "goodput_tok_s": sorted(r["goodput"]["output_throughput"] for r in rows[name])[len(rows[name]) // 2]}
        table.append(row)
        print(f"{name:<40}{row['ttft_p50_ms']:>9.0f}{row['ttft_p99_ms']:>8.0f}{row['tpot_p50_ms']:>10.0f}"
              f"{row['tpot_p99_ms']:>8.0f}{100 * (row['attainment'] or 0):>7.0f}%{row['goodput_tok_s']:>15.1f}")
    write_json({"command": " ".join(sys.argv), "machine": machine_info(), "args": vars(args), "table": table,
                "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "requests"} for r in v] for k, v in rows.items()}},
               args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
