"""``tidal bench calibrate``: the analytic cost model against published A100 measurements.

Fits the calibration terms of :class:`~tidal.sim.hardware.HardwareSpec` to the reference points
of :mod:`tidal.sim.reference` (Vidur's A100 kernel and CPU profiles), one part of the step at a
time, each a small least-squares problem:

- linear layers (9 points): ``max(tc, tm) + (1 - overlap) * min(tc, tm)`` with
  ``tc = flops / (peak * compute_efficiency)``, ``tm = weight bytes / (bandwidth *
  memory_efficiency)``; a grid over the three parameters, least relative squared error;
- attention (13 points): ``layers * attn_layer_s + sum over sequences of max((prefix pairs +
  attn_self_factor * self pairs) * flop / (peak * attn_compute_efficiency), kv bytes * (context +
  attn_seq_tokens) / (bandwidth * attn_memory_efficiency))``: linear in ``(attn_layer_s, 1/eff_m,
  seq_tokens/eff_m, 1/eff_c, self_factor/eff_c)`` when decodes are taken as memory bound and
  prefills as compute bound (weighted lstsq);
- CPU (4 points): ``step_overhead_s + cpu_per_seq_s * sequences`` (weighted lstsq).

Then prints every point's error before (the plain roofline the simulator had: the specs' old
efficiencies, 1.5 ms per step, no calibration terms) and after (the specs as they are now in
:mod:`tidal.sim.hardware`, whose A100 values are these fits rounded), with median and max
relative error, the held-out DynaServe step included, and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import numpy as np

from tidal.common import flags as F
from tidal.common.results import command_line, write_json
from tidal.sim.analytic import AnalyticCostModel
from tidal.sim.hardware import HardwareSpec, get_hardware
from tidal.sim.models import get_model
from tidal.sim.reference import A100_POINTS, RefPoint, predict

PROG = "tidal bench calibrate"
# the specs before calibration (tidal/sim/hardware.py until issue 14): plain roofline
UNCALIBRATED = dict(compute_efficiency=0.65, memory_efficiency=0.8, step_overhead_s=1.5e-3, overlap=1.0,
                    attn_compute_efficiency=None, attn_memory_efficiency=None, attn_self_factor=1.0, attn_seq_tokens=0.0,
                    attn_layer_s=0.0, cpu_per_seq_s=0.0)


def uncalibrated(hw: HardwareSpec) -> HardwareSpec:
    return replace(hw, **UNCALIBRATED)


def cost_model(point: RefPoint, hw: HardwareSpec | None = None) -> AnalyticCostModel:
    return AnalyticCostModel(get_model(point.model), hw or get_hardware(point.hardware), tp=point.tp)


def errors(points: tuple[RefPoint, ...], spec_of: Any) -> list[dict[str, Any]]:
    """One row per point: measured and predicted ms and the relative error (pred / measured - 1)."""
    rows = []
    for pt in points:
        pred = predict(pt, cost_model(pt, spec_of(get_hardware(pt.hardware))))
        rows.append({"name": pt.name, "part": pt.part, "measured_ms": pt.seconds * 1e3, "predicted_ms": pred * 1e3,
                     "rel_error": pred / pt.seconds - 1.0, "held_out": pt.held_out, "source": pt.source})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    e = [abs(r["rel_error"]) for r in rows]
    return {"median_abs_rel_error": statistics.median(e), "max_abs_rel_error": max(e), "n_points": len(e)}


def _fit_linear(points: list[RefPoint], hw: HardwareSpec) -> dict[str, float]:
    arch = get_model(points[0].model)
    params = points[0].tp and arch.num_layers * arch.params_per_layer()
    tok = np.array([p.chunk for p in points], dtype=float)
    y = np.array([p.seconds for p in points])
    xc = 2 * params * tok / hw.peak_flops  # seconds at 100% of peak
    xm = np.full_like(tok, params * 2 / hw.mem_bandwidth)
    ec = np.arange(0.40, 0.951, 0.01)[:, None, None, None]
    em = np.arange(0.50, 1.001, 0.01)[None, :, None, None]
    om = np.arange(0.0, 1.001, 0.02)[None, None, :, None]
    tc, tm = xc / ec, xm / em
    pred = np.maximum(tc, tm) + (1 - om) * np.minimum(tc, tm)
    sse = (((pred - y) / y) ** 2).sum(axis=-1)
    i, j, k = np.unravel_index(np.argmin(sse), sse.shape)
    return {"compute_efficiency": float(ec[i, 0, 0, 0]), "memory_efficiency": float(em[0, j, 0, 0]),
            "overlap": float(om[0, 0, k, 0])}


def _fit_attention(points: list[RefPoint], hw: HardwareSpec) -> dict[str, float]:
    rows, y = [], []
    for p in points:
        arch = get_model(p.model)
        kvb = arch.kv_bytes_per_token(2) / (hw.mem_bandwidth * p.tp)  # s per context token at 100%
        flop = 4 * arch.head_dim * arch.num_heads * arch.num_layers / (hw.peak_flops * p.tp)  # s per pair at 100%
        if p.decodes:  # memory bound: b * kv * (context + 1 + seq_tokens) / eff_m
            rows.append([arch.num_layers, p.decodes * kvb * (p.context + 1), p.decodes * kvb, 0.0, 0.0])
        else:  # compute bound: (prefix pairs + self_factor * self pairs) * flop / eff_c
            self_pairs = (p.chunk * p.chunk + p.chunk) / 2
            rows.append([arch.num_layers, 0.0, 0.0, p.prefix * p.chunk * flop, self_pairs * flop])
        y.append(p.seconds)
    a, yv = np.array(rows), np.array(y)
    sol, *_ = np.linalg.lstsq(a / yv[:, None], np.ones_like(yv), rcond=None)
    a0, u, v, w, w_self = (float(x) for x in sol)
    return {"attn_layer_s": max(a0, 0.0), "attn_memory_efficiency": min(1.0, 1 / u),
            "attn_seq_tokens": max(v / u, 0.0), "attn_compute_efficiency": min(1.0, 1 / w),
            "attn_self_factor": max(1.0, w_self / w)}


def _fit_cpu(points: list[RefPoint]) -> dict[str, float]:
    b = np.array([p.decodes for p in points], dtype=float)
    y = np.array([p.seconds for p in points])
    a = np.stack([np.ones_like(b), b], axis=1) / y[:, None]
    (s0, s1), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    return {"step_overhead_s": float(s0), "cpu_per_seq_s": float(s1)}


def fit(points: tuple[RefPoint, ...] = A100_POINTS) -> dict[str, float]:
    """The calibration terms that best fit the points not held out (one A100 spec)."""
    used = [p for p in points if not p.held_out]
    hw = get_hardware(used[0].hardware)
    out = _fit_linear([p for p in used if p.part == "linear"], hw)
    out.update(_fit_attention([p for p in used if p.part == "attention"], hw))
    out.update(_fit_cpu([p for p in used if p.part == "overhead"]))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="the analytic cost model against published A100 measurements",
                       description=__doc__.split("\n\n")[0])
    F.add_output_flags(p, "results/calibration.json")
    p.set_defaults(func=run)


def _table(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'point':36} {'measured ms':>12} {'before ms':>10} {'err':>7} {'after ms':>10} {'err':>7}"]
    for b, a in zip(before, after, strict=True):
        tag = " (held out)" if a["held_out"] else ""
        lines.append(f"{a['name'] + tag:36} {a['measured_ms']:12.3f} {b['predicted_ms']:10.3f} {b['rel_error']:+7.1%} "
                     f"{a['predicted_ms']:10.3f} {a['rel_error']:+7.1%}")
    return lines


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    fitted = fit()
    before = errors(A100_POINTS, uncalibrated)
    after = errors(A100_POINTS, lambda hw: hw)
    hw = get_hardware("a100-80g")
    spec = {k: getattr(hw, k) for k in UNCALIBRATED}
    result = {"command": command_line(PROG), "fitted": fitted, "a100_spec": spec,
              "before": {"points": before, **summary(before)}, "after": {"points": after, **summary(after)},
              "seconds": time.perf_counter() - t0}
    print(f"$ {result['command']}")
    print("\n".join(_table(before, after)))
    for when in ("before", "after"):
        s = result[when]
        print(f"{when:6}: median |error| {s['median_abs_rel_error']:.1%}, max {s['max_abs_rel_error']:.1%} "
              f"over {s['n_points']} points")
    print("fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in fitted.items()))
    print("a100-80g spec now: " + ", ".join(f"{k}={v}" for k, v in spec.items()))
    write_json(result, args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


__all__ = ["UNCALIBRATED", "add_parser", "errors", "fit", "run", "summary", "uncalibrated"]
