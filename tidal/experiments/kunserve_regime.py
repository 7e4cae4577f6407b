"""The regimes of ``tidal bench sim-kunserve``: its arrivals, its rate and its KV pool.

**The paper's regime** (the headline): the default pool (0.9 of each GPU, Sec. 5.1) and the rate
by the paper's own rule, "ensure that the average memory demand is lower than 60% of the total
memory during the entire evaluation of the trace" (Sec. 5.1): :class:`DemandSearch` finds the
highest mean rate whose vLLM run keeps its time-mean KV demand (in use plus the queue's need,
Sec. 2.2's count) at or under 60 % of the pool, by bracketing and bisection over the burst pattern
below. The compute capacity (step 1 below) is measured beside it, so a rate the compute cannot
keep up with is shown as such: above the highest steady rate the probe saw kept up with, compute
saturates before the 60 % rule binds.

**The shrunken pool** (a sensitivity row, the regime tidal ran before): KunServe's premise (Sec. 2.2) is a burst that overflows *memory* while compute keeps up: "the
increase comes from the queuing delays of waiting for sufficient memory to be freed up", with
"the overall HBM provisioned for KVCache ... 2.1x higher than the average requirement". So the
run is set up in three steps, none of them tuned to any system's result:

1. **compute capacity** (:func:`probe_capacity`): with an unlimited KV pool (memory never
   throttles), steady Poisson arrivals at a rate; the cluster *keeps up* at that rate when its
   waiting queue does not grow (:func:`keeps_up`); the capacity is the highest rate that kept up in
   a bracketing search of ``probes`` runs;
2. **the mean rate** (:func:`rate_under_capacity`): the highest mean rate at which every
   ``WINDOW_S`` window of the bursty arrivals stays at or under ``CAPACITY_SHARE`` of the capacity
   (the realised windows of the very arrivals the run uses, so no burst is over compute);
3. **the KV pool** (:func:`kv_in_use`): vLLM on those arrivals with an unlimited pool gives the
   time-mean KV in use per instance; the pool is ``POOL_OVER_MEAN`` times it (mean use about half of
   the pool, Sec. 2.2), and the bursts' peak use above it is what throttles.

Arrivals are either the Gamma process modulated per window (``gamma``) or the Azure conversation
hour's real timestamps (``azure``, :func:`azure_arrivals`), lengths from the dataset either way.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

WINDOW_S, RATE_SHAPE, BURSTINESS = 20.0, 2.0, 0.5
DEMAND_SHARE = 0.6  # Sec. 5.1: the average memory demand lower than 60 % of the total memory
SEARCH_TOLERANCE = 0.03  # the demand search stops when its bracket is this narrow (relative)
SEARCH_PROBES = 10
CAPACITY_SHARE = 0.85  # every burst window at or under this share of the compute capacity
POOL_OVER_MEAN = 2.0  # pool / mean KV in use (Sec. 2.2: mean in use about half; Fig. 2's setup: 2.1x)
UNLIMITED_BLOCKS = 1 << 22  # per instance: 67M tokens of KV, never full in these runs
PROBE_DURATION_S, PROBES = 120.0, 6
GROWTH_TOLERANCE = 0.03  # keeps up: the queue grows by at most this share of the arrivals
ARRIVALS = ("gamma", "azure")
AZURE_ENV = "TIDAL_AZURE_TRACE"  # the Azure conversation trace's path (default: the shared traces folder)


class RegimeError(ValueError):
    """An arrival option or trace that cannot be used; the message says why."""


# ---------------------------------------------------------------- arrivals
def bursty_arrivals(rng: np.random.Generator, duration_s: float, rate: float) -> np.ndarray:
    """A Gamma process (shape ``BURSTINESS``) whose rate is ``rate`` times a Gamma(``RATE_SHAPE``)
    factor of mean 1, drawn per ``WINDOW_S`` window (the rate pattern is the same at any ``rate``:
    the factors are drawn first)."""
    windows = math.ceil(duration_s / WINDOW_S)
    factors = rng.gamma(RATE_SHAPE, 1.0 / RATE_SHAPE, size=windows)
    gaps = rng.gamma(BURSTINESS, 1.0 / BURSTINESS, size=int(duration_s * rate * 4) + 64)  # unit-rate gaps
    out, t, k = [], 0.0, 0
    while k < len(gaps):  # time runs at the window's rate: a unit gap lasts 1 / (rate * factor) s
        w = int(t // WINDOW_S)
        if w >= windows:
            break
        r = rate * max(factors[w], 1e-3)
        step = gaps[k] / r
        if t + step > (w + 1) * WINDOW_S:  # the gap crosses into the next window: spend the rest there
            gaps[k] -= ((w + 1) * WINDOW_S - t) * r
            t = (w + 1) * WINDOW_S
            continue
        t += step
        k += 1
        if t < duration_s:
            out.append(t)
    return np.asarray(out)


def azure_trace_path(path: str | None = None) -> str:
    """``path``, else ``$TIDAL_AZURE_TRACE``, else the shared traces folder's Azure conversation hour."""
    from tidal import workload as W

    p = path or os.environ.get(AZURE_ENV) or W.default_dataset_path("azure", None)
    if not os.path.isfile(p):
        raise RegimeError(f"--arrivals azure needs the Azure conversation trace (TIMESTAMP,ContextTokens,"
                          f"GeneratedTokens): {p} does not exist; pass --azure-trace PATH or set {AZURE_ENV}")
    return p


@functools.lru_cache(maxsize=4)
def _trace_times(path: str) -> np.ndarray:
    from tidal import workload as W

    t = np.asarray([r.time_s for r in W.load_trace(path)], dtype=float)
    if len(t) < 2:
        raise RegimeError(f"{path}: a trace needs at least 2 timed rows")
    return t - t[0]


def azure_arrivals(path: str, duration_s: float, rate: float) -> np.ndarray:
    """The trace's first ``rate * duration_s`` arrivals, their times stretched so that the mean
    rate is ``rate`` (:func:`tidal.workload.rescale_to_rate`: the gaps' pattern is kept), in
    ``[0, duration_s)``."""
    from tidal import workload as W

    times = _trace_times(path)
    n = int(round(rate * duration_s)) + 1
    if n > len(times):
        raise RegimeError(f"{path} holds {len(times)} arrivals; {rate:g} req/s for {duration_s:g} s needs {n}: "
                          "lower --rate or --duration")
    out = W.rescale_to_rate(times[:n], rate)
    return out[out < duration_s]


def arrivals(kind: str, rng: np.random.Generator, duration_s: float, rate: float,
             trace: str | None = None) -> np.ndarray:
    if kind == "gamma":
        return bursty_arrivals(rng, duration_s, rate)
    if kind == "azure":
        return azure_arrivals(azure_trace_path(trace), duration_s, rate)
    raise RegimeError(f"unknown arrivals {kind!r}; available: {', '.join(ARRIVALS)}")


def window_rates(times: np.ndarray, duration_s: float | None, window_s: float = WINDOW_S) -> np.ndarray:
    """Arrivals per second in each ``window_s`` window of ``[0, duration_s)`` (a last partial
    window by its own length; ``duration_s`` None: whole windows up to the last arrival)."""
    if duration_s is None:
        duration_s = (math.floor(float(np.max(times, initial=0.0)) / window_s) + 1) * window_s
    edges = np.append(np.arange(0.0, duration_s, window_s), duration_s)
    counts = np.histogram(times, bins=edges)[0]
    return counts / np.diff(edges)


def rate_under_capacity(capacity: float, gen: Any, duration_s: float | None, share: float = CAPACITY_SHARE,
                        steps: int = 200, window_s: float = WINDOW_S) -> tuple[float, float]:
    """The highest mean rate whose arrivals ``gen(rate)`` (one array, or a list of them: one a seed,
    each kept) keep every ``window_s`` window at or under ``share * capacity``, on a geometric grid
    of ``steps`` rates from 1/50 of that limit to it (a scan, not a bisection: with few arrivals the
    busiest window is not monotone in the rate); returns (rate, its busiest window's rate)."""
    limit = share * capacity
    for rate in np.geomspace(limit, limit / 50, steps):  # the mean is at most the busiest window's rate
        got = gen(float(rate))
        peak = max(float(window_rates(a, duration_s, window_s).max()) for a in (got if isinstance(got, list) else [got]))
        if peak <= limit:
            return float(rate), peak
    raise RegimeError(f"no mean rate keeps every {window_s:g} s window under {limit:.3g} req/s")


# ---------------------------------------------------------------- the paper's rule (Sec. 5.1)
class DemandSearch:
    """The highest mean rate at which vLLM's time-mean KV demand stays at or under ``share`` of
    the pool. ``next_rate()`` names the rate to try (None: done), ``record(rate, demand)`` takes
    what the run measured: from ``initial`` the rate grows (or shrinks) 1.5x until the rule is
    bracketed, then the bracket is bisected until ``(hi - lo) / hi <= tolerance``, at most
    ``max_probes`` runs. Pure: the caller runs the simulator."""

    def __init__(self, initial: float, share: float = DEMAND_SHARE, tolerance: float = SEARCH_TOLERANCE,
                 max_probes: int = SEARCH_PROBES):
        if not initial > 0 or not share > 0 or not tolerance > 0 or max_probes < 1:
            raise ValueError("a demand search needs initial > 0, share > 0, tolerance > 0 and max_probes >= 1")
        self.initial, self.share, self.tolerance, self.max_probes = initial, share, tolerance, max_probes
        self.lo, self.hi = 0.0, math.inf
        self.probes: list[dict[str, Any]] = []

    @property
    def done(self) -> bool:
        return self.next_rate() is None

    def next_rate(self) -> float | None:
        if not self.probes:
            return self.initial
        if len(self.probes) >= self.max_probes:
            return None
        if math.isinf(self.hi):
            return max(p["rate"] for p in self.probes) * 1.5
        if self.lo == 0:
            return min(p["rate"] for p in self.probes) / 1.5
        if (self.hi - self.lo) / self.hi <= self.tolerance:
            return None
        return (self.lo + self.hi) / 2

    def record(self, rate: float, demand: float, **details: Any) -> None:
        ok = demand <= self.share
        self.probes.append({"rate": rate, "mean_kv_demand": demand, "within": ok, **details})
        if ok:
            self.lo = max(self.lo, rate)
        else:
            self.hi = min(self.hi, rate)

    def result(self) -> dict[str, Any]:
        if self.lo == 0:
            raise RegimeError(f"no rate tried kept vLLM's mean KV demand at or under {self.share:.0%} of the pool "
                              f"(lowest tried {min(p['rate'] for p in self.probes):.3g} req/s)")
        return {"rate": self.lo, "bracket": [self.lo, None if math.isinf(self.hi) else self.hi],
                "share": self.share, "tolerance": self.tolerance, "probes": sorted(self.probes, key=lambda p: p["rate"]),
                "rule": f"the highest mean rate at which vLLM's time-mean KV demand (in use + the queue's need) is at "
                        f"most {self.share:.0%} of the pool (Sec. 5.1)"}


# ---------------------------------------------------------------- the capacity probe
def queue_growth(timelines: list[dict[str, Any]], start: float, end: float) -> float:
    """How much the cluster's waiting queue (summed over instances) grew between the middle and
    the last third of ``[start, end)``: the difference of its time means, in requests."""
    span = (end - start) / 3
    grid = np.linspace(start, end, 301)[:-1]
    total = np.zeros_like(grid)
    for tl in timelines:
        t, w = np.asarray(tl["t"], dtype=float), np.asarray(tl["waiting"], dtype=float)
        if len(t):
            idx = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(t) - 1)
            total += np.where(grid >= t[0], w[idx], 0.0)
    mid = total[(grid >= start + span) & (grid < start + 2 * span)].mean()
    last = total[grid >= start + 2 * span].mean()
    return float(last - mid)


def keeps_up(timelines: list[dict[str, Any]], rate: float, duration_s: float) -> tuple[bool, float]:
    """The cluster keeps up with ``rate`` when its waiting queue does not grow: from the middle to
    the last third of the run it gains at most ``GROWTH_TOLERANCE`` of the arrivals of a third
    (plus one request per instance of noise). Returns (kept up, the growth)."""
    growth = queue_growth(timelines, 0.0, duration_s)
    return growth <= GROWTH_TOLERANCE * rate * duration_s / 3 + len(timelines), growth


def probe_capacity(run: Any, initial_rate: float, duration_s: float = PROBE_DURATION_S, probes: int = PROBES,
                   log: Any = None) -> dict[str, Any]:
    """The cluster's compute capacity: the highest steady rate at which it keeps up with an
    unlimited KV pool (``run(rate, duration_s)`` -> the simulator's per-instance timelines). The
    rate grows 1.5x until it does not keep up, then the bracket is bisected; ``probes`` runs."""
    lo, hi, rate = 0.0, math.inf, initial_rate
    tries = []
    for _ in range(probes):
        ok, growth = keeps_up(run(rate, duration_s), rate, duration_s)
        tries.append({"rate": rate, "keeps_up": ok, "queue_growth": growth})
        if log:
            log(f"capacity probe: {rate:.2f} req/s steady, unlimited KV -> queue grows by {growth:.0f} "
                f"({'keeps up' if ok else 'falls behind'})")
        if ok:
            lo = rate
        else:
            hi = rate
        rate = rate * 1.5 if math.isinf(hi) else (rate / 1.5 if lo == 0 else (lo + hi) / 2)
    if lo == 0:
        raise RegimeError(f"the capacity probe found no rate the cluster keeps up with (lowest tried "
                          f"{min(t['rate'] for t in tries):.3g} req/s)")
    return {"capacity": lo, "falls_behind_at": None if math.isinf(hi) else hi, "probes": tries,
            "duration_s": duration_s, "definition": "the highest steady Poisson rate at which, with an unlimited "
            "KV pool, the waiting queue does not grow (middle to last third of the run: at most "
            f"{GROWTH_TOLERANCE:.0%} of a third's arrivals)"}


def kv_in_use(timelines: list[dict[str, Any]], num_blocks: int) -> dict[str, float]:
    """Per instance KV in use, in blocks: the time mean (each sample held until the next), averaged
    over the instances, and the highest sample of any instance (the bursts' peak)."""
    means, peak = [], 0.0
    for tl in timelines:
        t, u = np.asarray(tl["t"], dtype=float), np.asarray(tl["kv_usage"], dtype=float) * num_blocks
        if len(t) > 1:
            means.append(float(np.sum(u[:-1] * np.diff(t)) / (t[-1] - t[0])))
        if len(u):
            peak = max(peak, float(u.max()))
    return {"mean_blocks": float(np.mean(means)) if means else 0.0, "peak_blocks": peak}


def pool_blocks(mean_blocks: float) -> int:
    """The KV pool per instance: ``POOL_OVER_MEAN`` times the mean in use (Sec. 2.2)."""
    return max(1, int(round(POOL_OVER_MEAN * mean_blocks)))


__all__ = ["ARRIVALS", "CAPACITY_SHARE", "DEMAND_SHARE", "POOL_OVER_MEAN", "DemandSearch", "RegimeError", "arrivals", "azure_arrivals",
           "azure_trace_path", "bursty_arrivals", "keeps_up", "kv_in_use", "pool_blocks", "probe_capacity",
           "queue_growth", "rate_under_capacity", "window_rates"]
