"""Cache-aware routing on this machine: multi-turn conversations on 2 real instances, least-outstanding
against cache-aware, in one run.

Two ``tidal serve --instances 2`` servers of the default model (one thread an instance, prefix
caching on), one after the other (never sharing the cores), each with one router. Against each,
``tidal bench serve`` sends the same conversation workload at a fixed rate (each turn resends the
history with the answers the server gave): the share of prompt tokens the server reported cached,
TTFT p50 / p99, ITL p99, and per instance the requests dispatched to it and its prefix-cache hits
(from ``/admin/state``), so the busiest instance's share shows the balance. Writes one JSON (``tidal
bench report`` reads it). Usage::

    python benchmarks/cache_routing.py [--workload conversation:...] [--num-requests 32] [--rate 0.5]
        [--output benchmarks/results/DATE-NN-NAME-cache-routing.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from conversation_cache import WORKLOAD, bench

from tidal.common.results import write_figures
from tidal.experiments.server_proc import serve, stop

ROUTERS = ("least-outstanding", "cache-aware")


def instances(url: str) -> list[dict]:
    """Each instance's requests dispatched and prefix-cache tokens looked up and hit, from /admin/state."""
    with urllib.request.urlopen(f"{url}/admin/state", timeout=30) as r:
        state = json.load(r)
    keep = ("index", "dispatched", "prefix_queries", "prefix_hits")
    return [{k: d.get(k) for k in keep} for d in state["cluster"]["instances"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--num-requests", type=int, default=32, help="turns in all")
    p.add_argument("--rate", type=float, default=0.5, help="conversation starts per second")
    p.add_argument("--output", default="results/cache_routing.json")
    args = p.parse_args()
    runs, per_instance = {}, {}
    for router in ROUTERS:
        proc, url, _ = serve(["--instances", "2", "--threads-per-instance", "1", "--router", router], [])
        try:
            runs[router] = bench(url, args.workload, args.num_requests, args.rate, "chat")
            per_instance[router] = instances(url)
        finally:
            stop(proc)
        print(f"  {router}: TTFT p50 {runs[router]['ttft_ms']['p50']:.0f} ms, cached "
              f"{100 * (runs[router].get('cached_prompt_share') or 0):.1f} %", flush=True)
    lo, ca = runs["least-outstanding"], runs["cache-aware"]

    def ms(r: dict, key: str, q: str) -> float:
        return round(r[key][q], 1)

    def busiest(router: str) -> str:
        sent = [d["dispatched"] or 0 for d in per_instance[router]]
        return f"{max(sent)} of {sum(sent)}" if sum(sent) else "-"

    figures = [
        ["workload", f"{args.workload}, {args.num_requests} turns, {args.rate} conversations/s, 2 instances"],
        *[[f"prompt tokens reported cached, {r}", f"{100 * (runs[r].get('cached_prompt_share') or 0):.1f} %"]
          for r in ROUTERS],
        *[[f"TTFT p50 / p99 ms, {r}", f"{ms(runs[r], 'ttft_ms', 'p50')} / {ms(runs[r], 'ttft_ms', 'p99')}"]
          for r in ROUTERS],
        *[[f"ITL p99 ms, {r}", ms(runs[r], "itl_ms", "p99")] for r in ROUTERS],
        ["TTFT p50, least-outstanding / cache-aware", round(lo["ttft_ms"]["p50"] / ca["ttft_ms"]["p50"], 2)],
        *[[f"requests on the busiest instance, {r}", busiest(r)] for r in ROUTERS],
        ["requests completed, least-outstanding / cache-aware", f"{lo['completed']} / {ca['completed']}"],
    ]
    write_figures(args.output, "cache-aware routing: multi-turn conversations on 2 instances",
                  "Cache-aware routing against least-outstanding, multi-turn conversations on 2 instances",
                  "python benchmarks/cache_routing.py", figures,
                  "Each turn resends the history with the answers the server gave; two 2-instance servers of the "
                  "default model (one thread an instance) ran one after the other on the same machine.",
                  {r: {**{x: runs[r].get(x) for x in ("ttft_ms", "itl_ms", "output_throughput", "completed",
                                                      "failed", "cached_prompt_share")},
                       "instances": per_instance[r]} for r in ROUTERS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
