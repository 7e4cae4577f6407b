"""KunServe's "unrealistic extreme burst" (Sec. 5.5, Fig. 16), read off simulated runs.

"upon meeting the first burst, we repeatedly replay the bursts until all evaluating systems are
out of memory" (Qwen-2.5-72B, KunServe against vLLM (DP)). Here: the run's BurstGPT-like arrivals
at the headline rate until the first window whose rate is at least ``BURST_FACTOR`` times the mean
(Sec. 2.2's burst: "the incoming request rate increases by 2x"; the busiest window if none is),
then that window's arrivals replayed back to back for ``EXTREME_S`` seconds (:func:`extreme_times`).

A system is *out of memory* (:func:`memory_limit`) when nothing is left to free: vLLM at its first
throttle (Sec. 2.2's detector: the queue's head does not fit), KunServe when it is throttled and no
drop plan is left (its autoscale signal, Sec. 4.4). The paper: KunServe reaches its limit 1.5x
later than vLLM (counted from the burst), after 2 drops that freed 57 % more KV memory, with no SLO
(5x) violation before it, while vLLM's TTFT grows up to 42x. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tidal.experiments.kunserve_regime import WINDOW_S, window_rates

BURST_FACTOR = 2.0
EXTREME_S = 300.0  # seconds of replayed bursts
DRAIN_S = 120.0  # the run goes on this long after the last arrival (what is unfinished then counts as missed)
SLO_SCALE = 5  # Sec. 5.5: "no SLO (5x) violations"


def first_burst(times: np.ndarray, duration_s: float, factor: float = BURST_FACTOR) -> int:
    """The first window whose rate is at least ``factor`` times the run's mean rate (else the busiest)."""
    rates = window_rates(times, duration_s)
    mean = len(times) / duration_s
    hot = np.nonzero(rates >= factor * mean)[0]
    return int(hot[0]) if len(hot) else int(np.argmax(rates))


def extreme_times(times: np.ndarray, duration_s: float, extreme_s: float = EXTREME_S,
                  factor: float = BURST_FACTOR) -> tuple[np.ndarray, float]:
    """The arrivals up to the first burst window, then that window's arrivals replayed every
    ``WINDOW_S`` for ``extreme_s`` seconds; and the burst's start."""
    w = first_burst(times, duration_s, factor)
    start = w * WINDOW_S
    burst = times[(times >= start) & (times < start + WINDOW_S)] - start
    reps = int(np.ceil(extreme_s / WINDOW_S))
    replay = np.concatenate([burst + start + j * WINDOW_S for j in range(reps)]) if len(burst) else np.zeros(0)
    return np.sort(np.concatenate([times[times < start], replay[replay < start + extreme_s]])), start


def memory_limit(events: Sequence[Mapping[str, Any]], after: float, mode: str) -> float | None:
    """When a system ran out of memory at or after ``after`` (None: not within the run): ``preempt``
    at its first throttle, ``drop`` when it is throttled with no drop plan left."""
    for e in sorted(events, key=lambda e: e["time"]):
        if e["time"] < after:
            continue
        if mode == "drop" and e["kind"] == "autoscale" and e.get("reason") == "throttled and no drop plan":
            return float(e["time"])
        if mode != "drop" and e["kind"] == "throttle":
            return float(e["time"])
    return None


def freed(events: Sequence[Mapping[str, Any]], until: float | None) -> tuple[int, int]:
    """The drops before ``until`` (None: all) and the bytes they freed (restores not subtracted)."""
    drops = [e for e in events if e["kind"] == "drop" and (until is None or e["time"] < until)]
    return len(drops), int(sum(e.get("freed_bytes", 0) for e in drops))


def window_slo(requests: Mapping[str, Sequence[float | None]], t0: float, t1: float, ttft_slo: float,
               tpot_slo: float | None) -> dict[str, Any]:
    """SLO attainment of the requests arriving in ``[t0, t1)`` and their largest TTFT."""
    idx = [i for i, a in enumerate(requests["arrival"]) if t0 <= a < t1]
    met, worst = 0, 0.0
    for i in idx:
        a, b = requests["ttft"][i], requests["tpot"][i]
        worst = max(worst, float("inf") if a is None else a)
        met += a is not None and a <= ttft_slo and (b is None or tpot_slo is None or b <= tpot_slo)
    return {"requests": len(idx), "attainment": met / len(idx) if idx else None, "max_ttft_s": worst if idx else None}


__all__ = ["BURST_FACTOR", "DRAIN_S", "EXTREME_S", "SLO_SCALE", "extreme_times", "first_burst", "freed",
           "memory_limit", "window_slo"]
