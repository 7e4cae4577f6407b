"""Multi-turn conversations on this machine, prefix caching on against off, in one run.

Two ``tidal serve`` processes of the default model, one after the other (never sharing the cores):
prefix caching on (the default) and ``--no-enable-prefix-caching``. Against each, ``tidal bench
serve`` sends the same conversation workload at a fixed rate (each turn resends the history with the
answers the server actually gave, ``think`` seconds after the previous answer): TTFT p50 / p99,
output throughput and the share of prompt tokens the server reported cached. Writes one JSON
(``tidal bench report`` reads it). Usage::

    python benchmarks/conversation_cache.py [--workload conversation:...] [--num-requests 24] [--rate 0.5]
        [--output benchmarks/results/DATE-NN-NAME-conversation-cache.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from tidal.common.results import write_figures
from tidal.experiments.server_proc import serve, stop

WORKLOAD = "conversation:system=300,turns=3,user=100,answer=64,think=1"


def bench(url: str, workload: str, num: int, rate: float, endpoint: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", workload,
               "--num-requests", str(num), "--rate", str(rate), "--no-progress", "--no-plots", "--output", out,
               "--endpoint", endpoint, *(["--prompt-format", "ids"] if endpoint == "completions" else [])]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=24, help="turns in all")
    p.add_argument("--rate", type=float, default=0.5, help="conversation starts per second")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--output", default="results/conversation_cache.json")
    args = p.parse_args()
    runs = {}
    for label, flags in (("on", []), ("off", ["--no-enable-prefix-caching"])):
        proc, url, _ = serve(flags, [])
        try:
            runs[label] = bench(url, args.workload, args.num_requests, args.rate, args.endpoint)
        finally:
            stop(proc)
        print(f"  caching {label}: TTFT p50 {runs[label]['ttft_ms']['p50']:.0f} ms", flush=True)
    on, off = runs["on"], runs["off"]

    def ms(r: dict, q: str) -> float:
        return round(r["ttft_ms"][q], 1)

    figures = [
        ["workload", f"{args.workload}, {args.num_requests} turns, {args.rate} conversations/s, {args.endpoint}"],
        ["prompt tokens reported cached, caching on", f"{100 * (on.get('cached_prompt_share') or 0):.1f} %"],
        ["prompt tokens reported cached, caching off", f"{100 * (off.get('cached_prompt_share') or 0):.1f} %"],
        ["TTFT p50 / p99 ms, caching on", f"{ms(on, 'p50')} / {ms(on, 'p99')}"],
        ["TTFT p50 / p99 ms, caching off", f"{ms(off, 'p50')} / {ms(off, 'p99')}"],
        ["TTFT p50, off / on", round(off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"], 2)],
        ["output tok/s, on / off", f"{on['output_throughput']:.1f} / {off['output_throughput']:.1f}"],
        ["requests completed, on / off", f"{on['completed']} / {off['completed']}"],
    ]
    write_figures(args.output, "prefix caching: multi-turn conversations",
                  "Multi-turn conversations with prefix caching on and off", "python benchmarks/conversation_cache.py",
                  figures, "Each turn resends the history with the answers the server gave; the servers ran one after "
                           "the other on the same machine, the default model.",
                  {k: {x: v.get(x) for x in ("ttft_ms", "tpot_ms", "output_throughput", "completed", "failed",
                                             "cached_prompt_share")} for k, v in runs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
