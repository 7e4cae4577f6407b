"""Traces that change regime, built from the shared traces, for ``tidal bench sim-auto``.

A trace is phases back to back, each ``duration_s`` of arrivals of one kind:

- ``chat``: bursty chat, the Azure LLM inference trace's conversation hour (``azure2023_conv.csv``):
  its rows' lengths and real arrival times, a window of them starting at a seed-drawn row, the gaps
  stretched to the phase's mean rate (:func:`tidal.workload.rescale_to_rate`: their pattern kept);
- ``long``: long-context conversation, the Mooncake trace (``mooncake_synthetic.jsonl``): its rows'
  lengths (prompts cut to the model's context less the output) and arrival times, the same way;
- ``code``: short code completions. The shared traces hold no code service, so these are the
  ``azure-code`` shape (the Azure 2023 code trace's published statistics, about 2,048 tokens in and
  28 out, lognormal) on Poisson arrivals: synthetic, and said so wherever they are reported.

Each phase's rate comes from a rule set before any system ran (:func:`search_rate`, on the
``recompute`` baseline alone): the highest mean rate at which the baseline's time-mean KV demand (in
use plus the queue's need) stays at or under ``share`` of the pool -- KunServe Sec. 5.1's rule at 60 %
-- and its waiting queue does not grow (:func:`tidal.experiments.kunserve_regime.keeps_up`: the
compute keeps up), found by bracketing and bisection. Pure apart from reading the trace files.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal import workload as W

PHASES = ("chat", "long", "code")
SOURCES = {"chat": "azure2023_conv.csv (Azure LLM inference 2023, conversation: lengths and arrival times)",
           "long": "mooncake_synthetic.jsonl (Mooncake FAST'25: lengths and arrival times)",
           "code": "azure-code shape (Azure 2023 code trace's published statistics, 2,048 in / 28 out; "
                   "synthetic: the shared traces hold no code service), Poisson arrivals"}
TRACE_FILES = {"chat": "azure", "long": "mooncake"}
SEARCH_TOLERANCE = 0.05  # the rate search stops when its bracket is this narrow (relative)
SEARCH_PROBES = 8


class TraceError(ValueError):
    """A phase or trace argument that cannot be used; the message says why."""


@functools.lru_cache(maxsize=4)
def _rows(phase: str, traces_dir: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    path = W.default_dataset_path(TRACE_FILES[phase], traces_dir)
    if not os.path.isfile(path):
        raise TraceError(f"the {phase} phase reads {path}, which does not exist (../shared/traces, or --traces-dir)")
    rows = W.load_trace(path)
    t = np.asarray([r.time_s for r in rows], dtype=float)
    return t - t[0], np.asarray([r.input_len for r in rows]), np.asarray([r.output_len for r in rows])


def phase_requests(phase: str, rate: float, duration_s: float, seed: int, max_len: int,
                   traces_dir: str | None = None) -> list[W.RequestSpec]:
    """``duration_s`` of ``phase`` at mean ``rate`` (arrivals from 0), prompts within ``max_len`` less the output."""
    if phase not in PHASES:
        raise TraceError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
    rng = np.random.default_rng([seed, PHASES.index(phase)])
    n = max(2, int(math.ceil(rate * duration_s * 1.2)) + 2)
    if phase == "code":
        times = W.arrivals_within(rng, duration_s, rate)
        ins, outs = W.synthetic_lengths("azure-code", len(times), rng)
    else:
        t, ins_all, outs_all = _rows(phase, traces_dir)
        if n > len(t):
            raise TraceError(f"the {phase} trace holds {len(t)} rows; {rate:g} req/s for {duration_s:g} s needs {n}")
        start = int(rng.integers(0, len(t) - n + 1))
        times = W.rescale_to_rate(t[start:start + n], rate)
        ins, outs = ins_all[start:start + n], outs_all[start:start + n]
    out = []
    for a, i, o in zip(times, ins, outs, strict=True):
        if a >= duration_s:
            break
        o = int(max(1, min(o, max_len // 2)))
        out.append(W.RequestSpec(float(a), int(max(1, min(i, max_len - o))), o))
    return out


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float
    rate: float


def regime_trace(rates: dict[str, float], duration_s: float, seed: int, max_len: int, order: tuple[str, ...] = PHASES,
                 traces_dir: str | None = None) -> tuple[list[W.RequestSpec], list[Phase]]:
    """The phases of ``order`` back to back (each at its rate), and where each begins and ends."""
    specs: list[W.RequestSpec] = []
    phases = []
    for k, name in enumerate(order):
        t0 = k * duration_s
        for s in phase_requests(name, rates[name], duration_s, seed, max_len, traces_dir):
            specs.append(W.RequestSpec(s.arrival_s + t0, s.prompt_len, s.output_len))
        phases.append(Phase(name, t0, t0 + duration_s, rates[name]))
    return specs, phases


def phase_of(phases: list[Phase], arrival_s: float) -> str:
    return next((p.name for p in phases if p.start_s <= arrival_s < p.end_s), phases[-1].name)


def search_rate(probe: Callable[[float], dict[str, Any]], initial: float, share: float,
                tolerance: float = SEARCH_TOLERANCE, max_probes: int = SEARCH_PROBES,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The highest rate at which ``probe(rate)`` (the baseline's run: ``mean_kv_demand`` and ``keeps_up``)
    keeps its mean KV demand at or under ``share`` of the pool and keeps up: 1.5x steps until bracketed,
    then bisection until the bracket is ``tolerance`` wide, at most ``max_probes`` runs."""
    lo, hi, rate, tries = 0.0, math.inf, initial, []
    for _ in range(max_probes):
        r = probe(rate)
        ok = r["mean_kv_demand"] <= share and r["keeps_up"]
        tries.append({"rate": rate, "ok": ok, **r})
        if log:
            log(f"rate {rate:.3g} req/s: mean KV demand {r['mean_kv_demand']:.0%}, "
                f"{'keeps up' if r['keeps_up'] else 'falls behind'} -> {'within' if ok else 'over'}")
        lo, hi = (max(lo, rate), hi) if ok else (lo, min(hi, rate))
        if not math.isinf(hi) and lo > 0 and (hi - lo) / hi <= tolerance:
            break
        rate = rate * 1.5 if math.isinf(hi) else (rate / 1.5 if lo == 0 else (lo + hi) / 2)
    if lo == 0:
        raise TraceError(f"no rate tried kept the baseline within {share:.0%} KV demand and its queue from growing "
                         f"(lowest {min(t['rate'] for t in tries):.3g} req/s)")
    return {"rate": lo, "bracket": [lo, None if math.isinf(hi) else hi], "share": share, "probes": tries,
            "rule": f"the highest mean rate at which recompute's time-mean KV demand is at most {share:.0%} of the "
                    "pool and its waiting queue does not grow"}


__all__ = ["PHASES", "SOURCES", "Phase", "TraceError", "phase_of", "phase_requests", "regime_trace", "search_rate"]
