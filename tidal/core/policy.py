"""The small interface a scheduling policy fills, and the baseline that fills it.

The scheduler never looks a policy up by name (that is ``tidal.policies``' registry); whoever
builds a scheduler hands a policy object in. A policy answers four questions each step:
in which order to admit waiting requests, whether to admit one more, how many requests may
run, and how many tokens the step may carry. It may learn from every step result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tidal.core.plan import StepPlan, StepResult
from tidal.core.request import Request


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """A read-only snapshot of one instance, given to the policy each step."""

    now: float
    running: Sequence[Request]
    waiting: Sequence[Request]
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    max_num_seqs: int  # the configured cap
    max_num_batched_tokens: int  # the configured token budget

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_decodes(self) -> int:
        return sum(1 for r in self.running if not r.in_prefill)


class SchedulingPolicy:
    """Baseline continuous batching (vLLM style): priority then FCFS admission, fixed caps."""

    name = "continuous"

    def order_waiting(self, waiting: list[Request], now: float) -> list[Request]:
        """Admission order. Lower ``priority`` first (as in vLLM), then earlier arrival."""
        return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))

    def max_num_seqs(self, view: SchedulerView) -> int:
        return view.max_num_seqs

    def token_budget(self, view: SchedulerView) -> int:
        return view.max_num_batched_tokens

    def admit(self, view: SchedulerView, request: Request, admitted: Sequence[Request]) -> bool:
        """May ``request`` join this step? ``admitted`` are those already admitted this step."""
        return True

    def preemption_victim(self, running: Sequence[Request]) -> Request:
        """Who gives up its blocks when memory runs out: the lowest priority, latest arrival."""
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Learn from a finished step (controllers update their state here)."""

    def state(self) -> dict:
        """Controller state for /metrics and /admin/state."""
        return {"policy": self.name}
