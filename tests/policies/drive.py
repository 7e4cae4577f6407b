"""Driving a Scheduler by hand in policy tests: one step with a fake model, and who was admitted."""

from __future__ import annotations

from tidal.core.plan import StepPlan, StepResult
from tidal.core.scheduler import Scheduler


def step(s: Scheduler, now: float = 0.0) -> StepPlan:
    """Schedule one step and apply a fake result that samples token 7 wherever the plan samples."""
    plan = s.schedule(now)
    s.update(plan, StepResult(plan.step_id, sampled={c.request_id: 7 for c in plan.chunks if c.sample}), now)
    return plan


def admitted(plan: StepPlan) -> list[str]:
    """Requests whose first chunk (position 0) is in this plan."""
    return [c.request_id for c in plan.chunks if c.start == 0]
