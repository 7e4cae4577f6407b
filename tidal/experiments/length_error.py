"""``tidal bench length-error``: the split planner's output-length predictor against real traces.

DynaServe (Sec. 5) predicts each request's output length to choose its split point and reports
"over 95% of predictions fall within +-100 tokens of the actual value". tidal's predictor
(:class:`tidal.cluster.split.LengthPredictor`) is the running mean of earlier outputs whose prompt
fell in the same length bucket, plus a 20-token margin. This command replays each trace in its
order, online as the planner sees it: predict (no cap), then observe the actual output, and
reports the share within +-100 tokens, the share under-predicted, the means and the absolute
error, per trace (``/work/shared/traces`` by default, or ``--traces-dir``), and on the synthetic
hybrid of ``tidal bench sim-dynaserve``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tidal import workload as W
from tidal.cluster.split import LengthPredictor
from tidal.common import flags as F
from tidal.common.results import command_line, write_json

PROG = "tidal bench length-error"
TRACES = ("azure", "mooncake", "sharegpt-lengths", "arxiv-lengths")
SYNTHETIC = {"hybrid": "mix:burstgpt-dynaserve=0.5,azure-code=0.5", "hybrid-262": "mix:burstgpt=0.5,azure-code=0.5"}


def replay_errors(pairs: Sequence[tuple[int, int]], margin: int = 20) -> dict[str, Any]:
    """Predict each ``(prompt, output)`` in order before observing it; the error statistics."""
    lp = LengthPredictor(margin=margin)
    pred, actual = [], []
    for p, o in pairs:
        pred.append(lp.predict(p, 1 << 30))
        actual.append(o)
        lp.observe(p, o)
    a, b = np.array(pred, dtype=float), np.array(actual, dtype=float)
    err = a - b
    return {"n": len(pairs), "actual_mean": float(b.mean()), "predicted_mean": float(a.mean()),
            "within_100": float((np.abs(err) <= 100).mean()), "under": float((err < 0).mean()),
            "mae": float(np.abs(err).mean()), "median_abs_err": float(np.median(np.abs(err))),
            "p95_abs_err": float(np.percentile(np.abs(err), 95))}


def _pairs(name: str, traces_dir: str | None, limit: int) -> list[tuple[int, int]]:
    if name in SYNTHETIC:
        specs = W.make_requests(W.WorkloadOptions(workload=SYNTHETIC[name], num_requests=limit, rate=1.0, seed=0))
        return [(s.prompt_len, s.output_len) for s in specs]
    path = os.path.join(traces_dir or W.default_traces_dir(), W.TRACE_FILES[name])
    if name in ("azure", "mooncake"):
        return [(r.input_len, r.output_len) for r in W.load_trace(path, limit)]
    ins, outs = W.load_length_set(path)
    return list(zip(ins[:limit].tolist(), outs[:limit].tolist(), strict=True))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("length-error", help="the split planner's output-length predictor against the traces",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--traces-dir", default=None, help="where the trace files are (default: the shared traces)")
    p.add_argument("--limit", type=F.positive_int, default=20000, help="at most this many requests of each")
    p.add_argument("--margin", type=int, default=20, help="the predictor's margin (Sec. 5: 20 tokens)")
    F.add_output_flags(p, "results/length_error.json", plots=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = command_line(PROG)
    print(f"command: {command}")
    rows: dict[str, Any] = {}
    for name in (*TRACES, *SYNTHETIC):
        try:
            rows[name] = replay_errors(_pairs(name, args.traces_dir, args.limit), args.margin)
        except (OSError, W.WorkloadError) as e:
            print(f"{PROG}: error: {name}: {e}", file=sys.stderr)
            return 2
        r = rows[name]
        print(f"  {name:<18} n {r['n']:6d}  actual mean {r['actual_mean']:7.1f}  predicted {r['predicted_mean']:7.1f}  "
              f"within +-100: {100 * r['within_100']:5.1f}%  under: {100 * r['under']:5.1f}%  "
              f"MAE {r['mae']:6.1f}  p95 |err| {r['p95_abs_err']:6.0f}")
    print("paper (Sec. 5): over 95% of predictions within +-100 tokens")
    write_json({"command": command, "margin": args.margin, "rows": rows}, args.output)
    print(f"wrote {args.output}")
    return 0


__all__ = ["add_parser", "replay_errors", "run"]
