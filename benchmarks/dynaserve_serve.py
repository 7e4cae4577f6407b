"""DynaServe on this CPU: 2 real instances, colocated vs 1P1D disaggregated vs split (micro-requests).

For each of the paper's workload shapes (``dynaserve-*`` in ``tidal bench serve``, lengths divided
by ``--scale`` so a 2-core CPU can serve them), each layout is a ``tidal serve`` process of its own
(started, measured and stopped by its pid, one at a time, so the runs never share the cores), and
``tidal bench serve --capacity-search`` finds the highest Poisson rate at which ``--target`` of the
requests meet the SLO (a P99 TBT bound per request, DynaServe Sec. 6, plus a TTFT bound so queues
cannot grow without limit). The runs are :mod:`tidal.experiments.dynaserve_real` (``tidal reproduce
dynaserve`` uses them for its real column). Prints a table (capacity, goodput, TBT and TTFT at
capacity, splits), writes one JSON and a PNG. Usage::

    python benchmarks/dynaserve_serve.py [--workloads dynaserve-2048-512,dynaserve-219-1467] [--scale 4]
        [--slo tbt=300,ttft=8000] [--duration 30] [--max-probes 5] [--seeds 0,1,2] [--layouts ...,split-fixed]

The split layout is the paper's placement (Alg. 1 on both orientations of the pair); ``split-fixed``
(instance 0 every request's alpha) is a labelled row, run only when asked for.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from tidal.common.machine import describe, machine_info
from tidal.common.plots import pyplot, save_figure
from tidal.common.results import write_json
from tidal.experiments.dynaserve_real import CLAIM_LAYOUTS, LAYOUTS, RealSetup, run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = RealSetup()
    p.add_argument("--workloads", default="dynaserve-2048-512,dynaserve-219-1467")
    p.add_argument("--layouts", default=",".join(CLAIM_LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--scale", type=float, default=d.scale, help="divide the shapes' lengths by this")
    p.add_argument("--slo", default=d.slo)
    p.add_argument("--target", type=float, default=d.target, help="SLO attainment a sustained rate needs")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of arrivals per probe")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="a request still running this long after a probe's last arrival fails")
    p.add_argument("--search-low", type=float, default=d.search_low)
    p.add_argument("--search-high", type=float, default=d.search_high)
    p.add_argument("--max-probes", type=int, default=d.max_probes)
    p.add_argument("--batching", default=d.batching, help="every instance's local policy (DynaServe Alg. 2)")
    p.add_argument("--kv-cache-memory", default=d.kv_cache_memory)
    p.add_argument("--seeds", default=",".join(map(str, d.seeds)), help="each its own requests and arrivals")
    p.add_argument("--output", default="results/dynaserve_serve.json")
    args = p.parse_args()
    try:
        seeds = tuple(int(x) for x in args.seeds.split(","))
    except ValueError:
        p.error(f"--seeds takes integers separated by commas; got {args.seeds!r}")
    setup = RealSetup(**{**{k: v for k, v in vars(args).items() if k not in ("workloads", "layouts", "output")},
                         "seeds": seeds})
    stem = os.path.splitext(args.output)[0]
    meta = {"command": " ".join(sys.argv), "machine": machine_info(), "args": {**vars(args), "seeds": list(seeds)}}
    rows = run(args.workloads.split(","), args.layouts.split(","), setup, stem, log=lambda m: print(m, flush=True),
               on_row=lambda got: write_json({**meta, "rows": got, "complete": False}, args.output))

    print(f"\nmachine: {describe(machine_info())}; SLO {args.slo} for {args.target:.0%} of requests; "
          f"{args.duration:g} s of arrivals per probe; local policy {args.batching}")
    print(f"{'workload':<22}{'layout':<32}{'seed':>5}{'capacity':>10}{'goodput':>10}{'TBT p99':>9}{'TTFT p50':>10}"
          f"{'split':>7}{'KV MB':>7}")
    for r in rows:
        def f(x, spec):
            return "-" if x is None else format(x, spec)
        print(f"{r['workload']:<22}{r['system']:<32}{r['seed']:>5}{f(r['capacity_rps'], '.3f'):>10}"
              f"{f(r['goodput_tok_s'], '.1f'):>10}{f(r['tbt_p99_ms'], '.0f'):>9}{f(r['ttft_p50_ms'], '.0f'):>10}"
              f"{f(r['split_fraction'], '.0%'):>7}{f(r['kv_mb_per_request'], '.2f'):>7}")
    write_json({**meta, "rows": rows, "complete": True}, args.output)
    _plot(rows, stem + ".png")
    print(f"wrote {args.output} and {stem}.png")
    return 0


def _plot(rows: list[dict], path: str) -> None:
    """Per workload and layout the median over seeds (bar) and each seed (dots); a capacity the
    search found none of is drawn at 0."""
    plt = pyplot()
    wls = list(dict.fromkeys(r["workload"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "capacity_rps", "capacity (req/s at SLO)"),
                           (axes[1], "goodput_tok_s", "goodput at capacity (tok/s)")):
        w = 0.8 / len(systems)
        for k, name in enumerate(systems):
            xs = [i + k * w for i in range(len(wls))]
            per = [[r[key] or 0 for r in rows if r["workload"] == wl and r["system"] == name] for wl in wls]
            ax.bar(xs, [float(np.median(v)) if v else 0 for v in per], w, label=name)
            for x, v in zip(xs, per, strict=True):
                ax.plot([x] * len(v), v, "k.", ms=4)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(wls))], wls, fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    save_figure(plt, fig, path, "2 instances on this CPU: colocate vs disaggregate vs split (DynaServe); "
                "bars: median over seeds, dots: each seed")


if __name__ == "__main__":
    sys.exit(main())
