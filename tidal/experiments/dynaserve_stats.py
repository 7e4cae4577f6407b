"""What DynaServe's evaluation measures of a simulated run, and how seeds become ratios.

Per request (Sec. 6.1, 6.3): :func:`attains` (its own P99 TBT within the SLO); per run:
:func:`sustained` (the paper's "maximum sustainable QPS": a queue that does not grow),
:func:`emission_ratio` (reported beside), :func:`instance_loads` (each instance's time-mean
running sequences and busy time) and :func:`split_tokens` (where each request's decode tokens ran:
alpha or beta, planned and actual). Across seeds: :func:`bracket` (a capacity search's own
resolution) and :func:`cap_ratio` (a capacity ratio, or the bound it is when one side left the
searched range), which the claims judge with :func:`tidal.experiments.reproduce.judge`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tidal import workload as W
from tidal.metrics import RequestRecord

STALL_FACTOR = 10.0  # a gap longer than 10 x the TBT SLO fails a request whatever its percentile


def attains(rec: RequestRecord, tbt_s: float, stall: bool = True) -> bool:
    """Succeeded, the 99th percentile of its gaps between tokens is within ``tbt_s``, and (``stall``)
    no gap is a stall (over ``STALL_FACTOR`` x ``tbt_s``: a preemption's recompute, a hand-off
    waiting for KV), which the percentile of a long output would hide."""
    if not rec.success:
        return False
    if not rec.itl_s:
        return True
    return float(np.percentile(rec.itl_s, 99)) <= tbt_s and (not stall or max(rec.itl_s) <= STALL_FACTOR * tbt_s)


GROWTH_FACTOR, GROWTH_SLACK_S = 2.0, 1.0  # the paper's capacity: a queue that does not grow (below)


def queue_growth(records: list[RequestRecord]) -> tuple[float | None, float | None]:
    """(median TTFT of the first quarter of the arrivals, of the last quarter), seconds: a system
    that sustains the rate keeps them alike; a growing queue (of prefills, hand-offs or admissions
    waiting for KV) makes the last quarter wait ever longer."""
    recs = sorted((r for r in records if r.send_s is not None), key=lambda r: r.arrival_s)
    n = len(recs) // 4
    if n < 1:
        return None, None

    def med(part: list[RequestRecord]) -> float:
        # a request that never got a first token waits at least until the run ended
        return float(np.median([r.ttft_s if r.ttft_s is not None else float("inf") for r in part]))
    return med(recs[:n]), med(recs[-n:])


def sustained(records: list[RequestRecord]) -> bool:
    """The paper's "maximum sustainable QPS" (no TTFT bound): the last quarter's median TTFT is at
    most ``GROWTH_FACTOR`` x the first quarter's plus ``GROWTH_SLACK_S``."""
    first, last = queue_growth(records)
    return first is None or last is None or last <= GROWTH_FACTOR * first + GROWTH_SLACK_S


def emission_ratio(records: list[RequestRecord], specs: list[W.RequestSpec]) -> float:
    """Output tokens emitted in the second half of the arrivals' span over those offered in it
    (rate x mean output x half the span), reported beside (a system that keeps up is near 1; with
    few requests or long outputs it is noisy, so it does not decide)."""
    if not specs:
        return 1.0
    end = max(s.arrival_s for s in specs)
    start = end / 2
    offered = len(specs) / end * (sum(s.output_len for s in specs) / len(specs)) * (end - start) if end > 0 else 0.0
    emitted = 0
    for rec in records:
        if rec.ttft_s is None or rec.send_s is None:
            continue
        t = rec.send_s + rec.ttft_s
        emitted += start <= t <= end
        for g in rec.itl_s:
            t += g
            if t > end:
                break
            emitted += t >= start
    return emitted / offered if offered > 0 else 1.0


def token_times(rec: RequestRecord) -> list[float]:
    """When each of the request's tokens came (run seconds): the first at its TTFT, then its gaps."""
    if rec.ttft_s is None or rec.send_s is None:
        return []
    t = rec.send_s + rec.ttft_s
    out = [t]
    for g in rec.itl_s:
        t += g
        out.append(t)
    return out


def instance_loads(timelines: Sequence[dict[str, Any]], instances: Sequence[dict[str, Any]],
                   span_s: float) -> list[dict[str, float]]:
    """Per instance: the time-mean number of running sequences (the scheduler's running list,
    sampled at each step's start, each sample held until the next), busy seconds and steps."""
    out = []
    for tl, inst in zip(timelines, instances, strict=True):
        t, run = np.asarray(tl["t"], dtype=float), np.asarray(tl["running"], dtype=float)
        if len(t) == 0:
            mean = 0.0
        else:
            w = np.diff(np.append(t, max(span_s, t[-1])))
            mean = float(np.dot(run, w) / w.sum()) if w.sum() > 0 else float(run.mean())
        out.append({"mean_running": mean, "busy_s": float(inst["busy_time_s"]), "steps": int(inst["steps"])})
    return out


def split_tokens(splits: Sequence[Any], specs: Sequence[W.RequestSpec], num_instances: int) -> dict[str, Any]:
    """Where the decode tokens of a split run went: per instance (``by_instance``) and per role
    (alpha / beta), the tokens Alg. 1 planned (its split on the *predicted* output) and the tokens
    each side actually sampled (the real output: a request whose split leaves beta nothing runs
    whole on alpha, however long its output is); and the predicted against the actual output."""
    actual = [0] * num_instances
    planned_role, actual_role = {"alpha": 0, "beta": 0}, {"alpha": 0, "beta": 0}
    predicted, real, whole_long = 0, 0, 0
    for t in splits:
        D = specs[t.index].output_len
        predicted += t.predicted_output
        real += D
        a_plan = t.predicted_output if t.split >= t.prompt_len + t.predicted_output - 1 else max(
            0, t.split - t.prompt_len + 1)
        if t.split < t.prompt_len and not t.handoff:
            a_plan = 0  # whole on beta
        planned_role["alpha"] += a_plan
        planned_role["beta"] += t.predicted_output - a_plan
        if not t.handoff:
            on_alpha = t.split >= t.prompt_len
            a = D if on_alpha else 0
            whole_long += on_alpha and t.predicted_output < D
        elif t.finished_on_alpha or t.stayed_on_alpha:
            a = D
        else:
            a = min(max(0, t.split - t.prompt_len + 1), D)
        actual[t.alpha] += a
        actual[t.beta] += D - a
        actual_role["alpha"] += a
        actual_role["beta"] += D - a
    n = len(splits) or 1
    return {"by_instance": actual, "planned_by_role": planned_role, "actual_by_role": actual_role,
            "predicted_output_mean": predicted / n, "actual_output_mean": real / n,
            "whole_on_alpha_past_prediction": whole_long}


def bracket(capacity: float | None, first_failing: float | None) -> float:
    """A capacity search's resolution: hi / lo - 1 of its final bracket (0 when it never brackets:
    the capacity is then a bound, outside the searched range, and :func:`cap_ratio` says so)."""
    if capacity is None or first_failing is None or first_failing <= capacity:
        return 0.0
    return first_failing / capacity - 1.0


def cap_ratio(a: float | None, b: float | None, low: float) -> tuple[float | None, bool]:
    """``a / b`` of two capacities, and whether it is a bound: a side that met no rate of the search
    (None) is below ``low``, so the ratio is at least ``a / low`` (at most ``low / b``); None when
    neither met any rate."""
    if a is None and b is None:
        return None, False
    if b is None:
        return a / low, True  # type: ignore[operator]
    if a is None:
        return low / b, True
    return a / b, False


__all__ = ["GROWTH_FACTOR", "GROWTH_SLACK_S", "STALL_FACTOR", "attains", "bracket", "cap_ratio", "emission_ratio",
           "instance_loads", "queue_growth", "split_tokens", "sustained", "token_times"]
