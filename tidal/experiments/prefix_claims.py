"""The claims ``tidal bench sim-prefix`` judges, one ratio a seed (> 1 = the technique's way), by the
shared rule of :func:`tidal.experiments.reproduce.judge`.

Per workload family (the trace is one fixed replay: one "seed"; a conversation workload has one
run a seed):

- prefix caching (the KV pools alone) against caching off, least-outstanding routing: P99 TTFT at
  the workload's own rate, and the capacity at the SLO (judged against the capacity search's
  bracket);
- cache-aware routing against least-outstanding, prefix caching on with the routing study's host
  tier: the hit rate, and P99 TTFT, at the workload's own rate; the capacity.
"""

from __future__ import annotations

from typing import Any

from tidal.experiments.reproduce import MARGIN_PAST_BRACKET, judge

MARGIN = 0.02  # a ratio must clear 1.02 on every seed (the reproductions' margin)
BASE, MINE = "least-outstanding", "cache-aware"


def _p99(r: dict[str, Any] | None) -> float | None:
    return ((r or {}).get("ttft_ms") or {}).get("p99")


def _hit(r: dict[str, Any] | None) -> float | None:
    return ((r or {}).get("prefix_cache") or {}).get("hit_rate")


def _cap(c: dict[str, Any] | None) -> float | None:
    """The capacity found, or None: none in the range, or the range's top passed (no failing rate: a bound)."""
    if not c or c.get("first_failing_rps") is None:
        return None
    return c.get("capacity_rps")


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _own_rate_run(routing: dict[str, Any], router: str, rate: float) -> dict[str, Any] | None:
    """The sweep's run at the workload's own rate (the sweep holds it: factor 1)."""
    for r, s in zip(routing["rates"], routing["routers"][router]["sweep"], strict=True):
        if abs(r - round(rate, 3)) < 1e-9:
            return s
    return None


def _claim(family: str, what: str, ratios: list[float | None], unit: str, tolerance: float = 0.0) -> dict[str, Any]:
    got = [r for r in ratios if r is not None]
    margin = tolerance + MARGIN_PAST_BRACKET if tolerance else MARGIN  # a capacity must clear its search's bracket
    verdict = judge(got if len(got) == len(ratios) else None, margin, tolerance)
    return {"workload": family, "claim": what, "per_seed": [None if r is None else round(r, 4) for r in ratios],
            "ratio": unit, "margin": margin, "tolerance": tolerance, "verdict": verdict}


def claims(res: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Every claim of every workload family of a ``run_experiment`` result."""
    families: dict[str, list[dict[str, Any]]] = {}
    for w in res["workloads"]:
        families.setdefault(w.get("family") or w["workload"], []).append(w)
    out = []
    for family, runs in families.items():
        if all(w.get("caching") for w in runs):
            rows = [{row["setup"]: row for row in w["caching"]} for w in runs]
            if all("off" in r and "pool" in r for r in rows):
                out.append(_claim(family, "prefix caching (pools alone) lowers P99 TTFT at the workload's own rate",
                                  [_ratio(_p99(r["off"]["at_trace_rate"]), _p99(r["pool"]["at_trace_rate"]))
                                   for r in rows], "off's P99 TTFT over on's"))
                if all(r["off"].get("sweep") and r["pool"].get("sweep") for r in rows):
                    out.append(_claim(family, "prefix caching (pools alone) lowers P99 TTFT at the sweep's lowest rate",
                                      [_ratio(_p99(r["off"]["sweep"][0]), _p99(r["pool"]["sweep"][0])) for r in rows],
                                      "off's P99 TTFT over on's"))
                out.append(_claim(family, "prefix caching (pools alone) raises the capacity at the SLO",
                                  [_ratio(_cap(r["pool"]["capacity"]), _cap(r["off"]["capacity"])) for r in rows],
                                  "on's capacity over off's", tolerance))
        if all(w.get("routing") and {BASE, MINE} <= set(w["routing"]["routers"]) for w in runs):
            own = [(_own_rate_run(w["routing"], MINE, w["trace_rate"]), _own_rate_run(w["routing"], BASE, w["trace_rate"]))
                   for w in runs]
            out.append(_claim(family, f"{MINE} routing hits more prompt tokens than {BASE} at the workload's own rate",
                              [_ratio(_hit(m), _hit(b)) for m, b in own], f"{MINE}'s hit rate over {BASE}'s"))
            out.append(_claim(family, f"{MINE} routing lowers P99 TTFT at the workload's own rate",
                              [_ratio(_p99(b), _p99(m)) for m, b in own], f"{BASE}'s P99 TTFT over {MINE}'s"))
            out.append(_claim(family, f"{MINE} routing raises the capacity at the SLO",
                              [_ratio(_cap(w["routing"]["routers"][MINE]["capacity"]),
                                      _cap(w["routing"]["routers"][BASE]["capacity"])) for w in runs],
                              f"{MINE}'s capacity over {BASE}'s", tolerance))
    return out


__all__ = ["claims"]
