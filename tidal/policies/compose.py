"""Combining policies by config: ``bucket+memory+sla`` is one policy built from three parts.

Each part answers only the questions it overrides; the composite asks every part and combines
the answers: admission order and preemption choice come from the first part that defines them,
a request is admitted only if every part admits it, and the caps are the minimum over the parts
(b* = min(b_mem, b_SLA), Pang et al. Sec. III-C). Every part learns from every step.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import SchedulerView, SchedulingPolicy
from tidal.core.request import Request


def _overrides(part: SchedulingPolicy, method: str) -> bool:
    return getattr(type(part), method) is not getattr(SchedulingPolicy, method)


class CompositePolicy(SchedulingPolicy):
    def __init__(self, parts: Sequence[SchedulingPolicy]):
        if not parts:
            raise ValueError("a composite policy needs at least one part")
        self.parts = list(parts)
        self.name = "+".join(p.name for p in self.parts)
        self._order = next((p for p in self.parts if _overrides(p, "order_waiting")), self.parts[0])
        self._victim = next((p for p in self.parts if _overrides(p, "preemption_victim")), self.parts[0])

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        return self._order.order_waiting(waiting, now)

    def admit(self, view: SchedulerView, request: Request, admitted: Sequence[Request]) -> bool:
        return all(p.admit(view, request, admitted) for p in self.parts)

    def max_num_seqs(self, view: SchedulerView) -> int:
        return min(p.max_num_seqs(view) for p in self.parts)

    def token_budget(self, view: SchedulerView) -> int:
        return min(p.token_budget(view) for p in self.parts)

    def preemption_victim(self, running: Sequence[Request]) -> Request:
        return self._victim.preemption_victim(running)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        for p in self.parts:
            p.observe(plan, result)

    def state(self) -> dict:
        out: dict = {"policy": self.name}
        for p in self.parts:
            out[p.name] = {k: v for k, v in p.state().items() if k != "policy"}
        return out
