"""The pipeline-cost sensitivity of ``tidal bench sim-kunserve``: a stage gap calibrated to the
paper's measured bubbles.

The simulated pipeline's bubbles come only from unequal microbatches and the activations'
transfer (:mod:`tidal.sim.pipeline`); Sec. 5.3 measured "21.9% bubble time ... on average during
the pipelined execution" with token-count microbatches and 8.3 % with the lookahead, on LongBench
with Qwen-2.5-14B. A real pipeline also idles between microbatches (stage hand-offs, each stage's
scheduling), which the default cost leaves out. :func:`fit_stage_gap` calibrates that idle time,
one gap per stage per microbatch (``ClusterSpec.pipeline_stage_gap_s``), to both measurements at
once: KunServe with and without the lookahead runs on the headline LongBench setup at each gap of
a grid; each configuration's bubble ratio is interpolated (linearly) between grid points, and the
gap minimising the summed squared error against (8.3 %, 21.9 %) is taken. The residuals say how
much of the paper's gap between the two one idle time cannot explain. Published measurements only:
no system's result is a target. Pure (the caller runs the simulator).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

PAPER_BUBBLES = {"lookahead": 0.083, "token-count": 0.219}  # Sec. 5.3, LongBench, Qwen-2.5-14B
GAP_GRID_S = (0.0, 0.002, 0.004, 0.008, 0.016, 0.032)  # seconds of idle per stage per microbatch
QUICK_GAP_GRID_S = (0.0, 0.008, 0.032)


def fit_stage_gap(bubbles: Mapping[str, Sequence[tuple[float, float | None]]],
                  targets: Mapping[str, float] = PAPER_BUBBLES, points: int = 2001) -> dict[str, Any]:
    """The gap (seconds) whose interpolated bubbles best match ``targets`` (least squares), from
    ``bubbles[config]`` = [(gap, bubble ratio or None: no pipeline ran)]. Returns the gap, each
    configuration's fitted bubble and its error, or ``gap_s`` None when a configuration ran no
    pipeline at any gap."""
    curves = {}
    for cfg, target in targets.items():
        pts = sorted((g, b) for g, b in bubbles.get(cfg, ()) if b is not None)
        if len(pts) < 2:
            return {"gap_s": None, "targets": dict(targets), "reason": f"{cfg}: fewer than 2 gaps ran a pipeline",
                    "grid": {k: list(v) for k, v in bubbles.items()}}
        curves[cfg] = (np.array([g for g, _ in pts]), np.array([b for _, b in pts]), target)
    lo = max(c[0][0] for c in curves.values())
    hi = min(c[0][-1] for c in curves.values())
    gaps = np.linspace(lo, hi, points)
    err = sum((np.interp(gaps, x, y) - t) ** 2 for x, y, t in curves.values())
    k = int(np.argmin(err))
    g = float(gaps[k])
    fitted = {cfg: float(np.interp(g, x, y)) for cfg, (x, y, _) in curves.items()}
    return {"gap_s": g, "targets": dict(targets), "fitted": fitted,
            "error": {cfg: fitted[cfg] - t for cfg, t in targets.items()},
            "at_grid_edge": bool(k in (0, points - 1)),
            "grid": {cfg: [[gg, b] for gg, b in bubbles[cfg]] for cfg in targets}}


__all__ = ["GAP_GRID_S", "PAPER_BUBBLES", "QUICK_GAP_GRID_S", "fit_stage_gap"]
