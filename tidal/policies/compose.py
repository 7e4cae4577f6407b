"""Combining policies by config: ``bucket+memory+sla`` is one policy built from three parts.

The composite works from the parts' typed answers, never from which methods they override:
the step caps are the tighter of all parts' :class:`StepCaps` (b* = min(b_mem, b_SLA), Pang et
al. Sec. III-B); admission order and the preemption victim come from the first part that has an
opinion (a non-None answer); a request is admitted only if every part admits it. Every part
plans, observes and hears of every finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal.core.plan import ScheduledChunk, StepPlan, StepResult
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.core.request import Request


@dataclass(frozen=True, slots=True)
class CompositeState(PolicyState):
    parts: tuple[PolicyState, ...] = ()

    def to_dict(self) -> dict:
        """``{"policy": "a+b", "a": {...}, "b": {...}}``: each part under its own name."""
        out: dict = {"policy": self.policy}
        for p in self.parts:
            out[p.policy] = {k: v for k, v in p.to_dict().items() if k != "policy"}
        return out


class CompositePolicy(SchedulingPolicy):
    def __init__(self, parts: Sequence[SchedulingPolicy]):
        if not parts:
            raise ValueError("a composite policy needs at least one part")
        self.parts = list(parts)
        self.name = "+".join(p.name for p in self.parts)

    def plan_step(self, view: SchedulerView) -> StepCaps:
        caps = StepCaps()
        for p in self.parts:
            caps = caps.tighter(p.plan_step(view))
        return caps

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request] | None:
        for p in self.parts:
            order = p.order_waiting(waiting, now)
            if order is not None:
                return order
        return None

    def admit(self, request: Request, admitted: Sequence[Request]) -> bool:
        return all(p.admit(request, admitted) for p in self.parts)

    def preemption_victim(self, running: Sequence[Request]) -> Request | None:
        for p in self.parts:
            victim = p.preemption_victim(running)
            if victim is not None:
                return victim
        return None

    def seq_ceiling(self, configured: int) -> int:
        return max(p.seq_ceiling(configured) for p in self.parts)

    def padded_tokens(self, chunks: Sequence[ScheduledChunk]) -> int:
        return max(p.padded_tokens(chunks) for p in self.parts)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        for p in self.parts:
            p.observe(plan, result)

    def on_finished(self, request: Request) -> None:
        for p in self.parts:
            p.on_finished(request)

    def state(self) -> CompositeState:
        return CompositeState(self.name, tuple(p.state() for p in self.parts))
