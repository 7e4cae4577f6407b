"""KunServe's SLO-violation curves (Fig. 13's last column, Sec. 5.2) from a run's per-request latencies.

"a scale factor of N means that the maximal tolerable latency is N times the P50 latency of the
best baseline": for each N in 1-10, a request meets its SLO when it finished, its TTFT is at most N
times the lowest P50 TTFT among the baselines and its TPOT at most N times the lowest P50 TPOT
among them (a request of one output token has no TPOT: its TTFT decides); the violation of a
system at N is the share of its requests that do not. The paper reports "7.2-12.8% average SLO
violation reductions" (the mean over the scales) and that KunServe "almost eliminates all
violations with a scale larger than 4". Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

SCALES = tuple(range(1, 11))


def p50(values: Sequence[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.percentile(v, 50)) if v else None


def violations(ttft: Sequence[float | None], tpot: Sequence[float | None], ttft_slo: float,
               tpot_slo: float | None) -> float:
    """The share of requests that miss the SLO (unfinished: ``ttft`` None, a miss)."""
    if not ttft:
        return 0.0
    miss = 0
    for a, b in zip(ttft, tpot, strict=True):
        if a is None or a > ttft_slo or (b is not None and tpot_slo is not None and b > tpot_slo):
            miss += 1
    return miss / len(ttft)


def curves(requests: Mapping[str, Mapping[str, Sequence[float | None]]], baselines: Sequence[str],
           scales: Sequence[int] = SCALES) -> dict[str, Any]:
    """Every system's violation share at each scale, against the best baseline's P50 TTFT and
    TPOT (``requests[system]``: ``ttft`` and ``tpot`` per request, seconds or None)."""
    base = [b for b in baselines if b in requests]
    if not base:
        raise ValueError("the SLO curves need at least one baseline's requests")
    ref_ttft = min((x for b in base if (x := p50(requests[b]["ttft"])) is not None), default=None)
    ref_tpot = min((x for b in base if (x := p50(requests[b]["tpot"])) is not None), default=None)
    if ref_ttft is None:
        raise ValueError("no baseline finished a request: no P50 TTFT to scale")
    out = {}
    for name, r in requests.items():
        v = [violations(r["ttft"], r["tpot"], n * ref_ttft, None if ref_tpot is None else n * ref_tpot)
             for n in scales]
        out[name] = {"violation": v, "mean_violation": float(np.mean(v))}
    return {"scales": list(scales), "ref_p50_ttft_s": ref_ttft, "ref_p50_tpot_s": ref_tpot, "systems": out}


def attainment_ratio(c: dict[str, Any], technique: str, baselines: Sequence[str]) -> tuple[float, str, float]:
    """The technique's mean SLO attainment (1 - mean violation over the scales) over the best
    baseline's (> 1: fewer violations), that baseline, and the reduction in mean violation."""
    sys_ = c["systems"]
    best = min((b for b in baselines if b in sys_), key=lambda b: sys_[b]["mean_violation"])
    t, b = sys_[technique]["mean_violation"], sys_[best]["mean_violation"]
    return (1 - t) / (1 - b) if b < 1 else float("inf"), best, b - t


__all__ = ["SCALES", "attainment_ratio", "curves", "p50", "violations"]
