"""The one interface between the simulator and whatever predicts step times.

A cost model answers one question: how long does one engine step take to execute this
:class:`~tidal.core.plan.StepPlan` (its chunks, with their prefixes, and its swaps)? The
simulator advances its virtual clock by that much. Implementations:

- :class:`tidal.sim.analytic.AnalyticCostModel`: roofline over matmul FLOPs and weight/KV bytes
  against a hardware spec, attention per KunServe Eq. 1 (prefix and self terms).
- :class:`tidal.sim.profiled.ProfiledCostModel`: fitted to measurements of the real engine
  written by ``tidal profile``.
- :class:`ReplayCostModel`: replays recorded step times in order (the same-plans test).

Pure: no torch, no clock, no threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tidal.core.plan import StepPlan


class CostModel(Protocol):
    name: str

    def step_time(self, plan: StepPlan) -> float:
        """Seconds one engine step takes to execute ``plan`` (swaps included)."""
        ...


class ReplayCostModel:
    """Step times recorded elsewhere (e.g. from the real engine), handed out in order."""

    name = "replay"

    def __init__(self, times: Sequence[float]):
        self.times = list(times)
        self.calls = 0

    def step_time(self, plan: StepPlan) -> float:
        if self.calls >= len(self.times):
            raise IndexError(f"replay ran out of recorded step times after {self.calls} steps")
        t = self.times[self.calls]
        self.calls += 1
        return t


class ScaledCostModel:
    """Another cost model's times multiplied by ``factor``: a machine that runs ``factor`` times
    slower (> 1) or faster (< 1) than the one that was measured or specified."""

    def __init__(self, base: CostModel, factor: float):
        if not factor > 0:
            raise ValueError(f"speed factor must be > 0, got {factor}")
        self.base, self.factor = base, factor
        self.name = f"{base.name} x{factor:g}"

    def step_time(self, plan: StepPlan) -> float:
        return self.base.step_time(plan) * self.factor
