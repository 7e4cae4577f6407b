"""Serving capacity: the highest request rate whose SLO attainment stays >= a target, by bisection.

Pure: the caller runs each probe (a load test or a simulation) and records its attainment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Probe:
    rate: float
    attainment: float
    passed: bool
    summary: dict[str, Any] | None = None


class CapacitySearch:
    """Bisection on request rate for the highest rate whose attainment is >= ``target``.

    Probes ``low`` first (if it fails, capacity is below the range: None), then ``high`` (if it
    passes, capacity is at least ``high``), then geometric midpoints of the bracket until
    ``hi / lo <= 1 + tolerance`` or ``max_probes`` probes were run. The capacity is the highest
    passing rate probed. Call :meth:`next_rate`, run a probe at it, :meth:`record` the attainment.
    """

    def __init__(self, low: float, high: float, target: float, tolerance: float = 0.1, max_probes: int = 8):
        if not (0 < low < high) or math.isinf(high):
            raise ValueError(f"capacity search needs 0 < low < high (finite), got {low}, {high}")
        if not 0 < target <= 1:
            raise ValueError(f"target attainment must be in (0, 1], got {target}")
        if tolerance <= 0 or max_probes < 2:
            raise ValueError("capacity search needs tolerance > 0 and at least 2 probes")
        self.low, self.high, self.target = float(low), float(high), float(target)
        self.tolerance, self.max_probes = float(tolerance), int(max_probes)
        self.probes: list[Probe] = []
        self._lo: float | None = None  # highest passing rate
        self._hi: float | None = None  # lowest failing rate
        self.note = ""

    def next_rate(self) -> float | None:
        if self.done:
            return None
        if not self.probes:
            return self.low
        if len(self.probes) == 1:
            return self.high
        assert self._lo is not None and self._hi is not None
        return math.sqrt(self._lo * self._hi)

    def record(self, rate: float, attainment: float, summary: dict[str, Any] | None = None) -> Probe:
        passed = attainment >= self.target
        p = Probe(rate, attainment, passed, summary)
        self.probes.append(p)
        if passed:
            self._lo = rate if self._lo is None else max(self._lo, rate)
        else:
            self._hi = rate if self._hi is None else min(self._hi, rate)
        return p

    @property
    def done(self) -> bool:
        if not self.probes:
            return False
        first = self.probes[0]
        if not first.passed:
            self.note = f"attainment below target already at the low bound {self.low:g} req/s"
            return True
        if len(self.probes) >= 2 and self.probes[1].passed and self.probes[1].rate == self.high:
            self.note = f"attainment meets the target at the high bound {self.high:g} req/s"
            return True
        if len(self.probes) >= self.max_probes:
            self.note = f"stopped after {self.max_probes} probes"
            return True
        if self._lo is not None and self._hi is not None and self._hi / self._lo <= 1 + self.tolerance:
            self.note = f"bracket [{self._lo:.4g}, {self._hi:.4g}] req/s within {self.tolerance:.0%}"
            return True
        return False

    @property
    def capacity(self) -> float | None:
        return self._lo

    @property
    def bracket(self) -> tuple[float | None, float | None]:
        return self._lo, self._hi

    def report(self) -> dict[str, Any]:
        lo, hi = self.bracket
        return {
            "target_attainment": self.target,
            "low": self.low,
            "high": self.high,
            "capacity_rps": lo,
            "first_failing_rps": hi,
            "note": self.note,
            "probes": [{"rate": p.rate, "attainment": p.attainment, "passed": p.passed,
                        **({"summary": p.summary} if p.summary is not None else {})} for p in self.probes],
        }


__all__ = ["CapacitySearch", "Probe"]
