"""The contract between the scheduler and a scheduling policy, and the baseline that fills it.

The scheduler never looks a policy up by name (that is ``tidal.policies``' registry); whoever
builds a scheduler hands a policy object in. Each step goes through the policy in one fixed
order, so no policy depends on which question happens to be asked first:

1. ``plan_step(view) -> StepCaps``: asked exactly once, first, with a snapshot of the instance.
   This is where a policy updates its controllers and decides the step's caps (how many
   requests may run, how many tokens the step may carry). ``None`` in a field means "no cap of
   mine": the configured one holds.
2. Pure questions about that step, any number of times, in any order:
   ``order_waiting`` (admission order; it may leave out requests ``admit`` would refuse this
   step, and the scheduler passes the very snapshot ``plan_step`` saw when the queue did not
   change in between), ``admit`` (may this request join?) and
   ``preemption_victim`` (who gives up its blocks?). ``None`` from ``order_waiting`` or
   ``preemption_victim`` means "no opinion": the scheduler's baseline (priority, then FCFS;
   the lowest priority, latest arrival is preempted) decides.
3. ``observe(plan, result)`` after the step ran, and ``on_finished(request)`` whenever a
   request ends (finished, stopped, aborted or cut at the pool's length), so no policy polls
   the requests it remembers.

``state()`` returns a typed, immutable :class:`PolicyState` for ``/metrics`` and
``/admin/state``; ``to_dict()`` is its JSON form and ``gauges()`` its numeric leaves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from tidal.core.plan import ScheduledChunk, StepPlan, StepResult
from tidal.core.request import Request


@dataclass(frozen=True, slots=True)
class SchedulerView:
    """A read-only snapshot of one instance, given to the policy once per step."""

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


@dataclass(frozen=True, slots=True)
class StepCaps:
    """A policy's decision for one step. ``None``: no cap from this policy (the configured one holds)."""

    max_num_seqs: int | None = None
    token_budget: int | None = None

    def __post_init__(self) -> None:
        for f in ("max_num_seqs", "token_budget"):
            v = getattr(self, f)
            if v is not None and v < 0:
                raise ValueError(f"StepCaps.{f} must be >= 0, got {v}")

    def tighter(self, other: StepCaps) -> StepCaps:
        """Both caps at once: the minimum of each field that either sets (b* = min(b_mem, b_SLA))."""
        def lo(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)
        return StepCaps(lo(self.max_num_seqs, other.max_num_seqs), lo(self.token_budget, other.token_budget))

    def within(self, max_num_seqs: int, token_budget: int) -> StepCaps:
        """These caps applied to the configured ones: both fields set, neither above its configured value."""
        s, t = self.max_num_seqs, self.token_budget  # (one object, not tighter's two: this runs every step)
        return StepCaps(max_num_seqs if s is None or s > max_num_seqs else s,
                        token_budget if t is None or t > token_budget else t)


NO_CAPS = StepCaps()  # frozen: one shared "no cap of mine"


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield prefix, float(value)


def state_gauges(state: dict[str, Any]) -> list[tuple[str, float]]:
    """A policy state's numeric fields (its ``to_dict()``, as a cluster's workers report it) as
    (dotted key, value)."""
    return list(_leaves({k: v for k, v in state.items() if k != "policy"}, ""))


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What a policy shows of itself. Each policy subclasses it with its own typed fields."""

    policy: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form (nested states become nested dicts)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, PolicyState):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = [x.to_dict() if isinstance(x, PolicyState) else (list(x) if isinstance(x, tuple) else x)
                     for x in v]
            out[f.name] = v
        return out

    def gauges(self) -> list[tuple[str, float]]:
        """Every numeric field as (dotted key, value), for Prometheus gauges."""
        return state_gauges(self.to_dict())


class SchedulingPolicy:
    """The baseline, vLLM-style continuous batching: no caps beyond the configured ones, no
    opinion on order or victims (the scheduler's priority-then-FCFS rules apply), admits all."""

    name = "continuous"

    def plan_step(self, view: SchedulerView) -> StepCaps:
        return NO_CAPS

    def order_waiting(self, waiting: Sequence[Request], now: float) -> list[Request] | None:
        """Admission order of ``waiting``, or None to leave it to the scheduler (priority, FCFS)."""
        return None

    def admit(self, request: Request, admitted: Sequence[Request]) -> bool:
        """May ``request`` join this step? ``admitted`` are those already admitted this step."""
        return True

    def preemption_victim(self, running: Sequence[Request]) -> Request | None:
        """Who gives up its blocks when memory runs out, or None to leave it to the scheduler."""
        return None

    def seq_ceiling(self, configured: int) -> int:
        """The hard cap on running requests, given the configured ``max_num_seqs``. A policy with
        its own batch-size bound (``memory.b_max``, Pang et al.'s B_max) may raise it."""
        return configured

    def padded_tokens(self, chunks: Sequence[ScheduledChunk]) -> int:
        """Tokens this step computes only as padding (0: no padding, the default). A padding mode
        pads the step to a rectangle: every row as long as the longest chunk at the longest
        prefix; the rows are the chunks plus rows kept for finished members (see
        :func:`tidal.core.plan.rectangle_padding`)."""
        return 0

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Learn from a finished step (controllers update their state here)."""

    def on_finished(self, request: Request) -> None:
        """``request`` ended (any reason; ``request.finish_reason`` says which) and left the instance."""

    def state(self) -> PolicyState:
        return PolicyState(self.name)


def fcfs_key(r: Request) -> tuple[int, float]:
    """The baseline admission order's key: lower ``priority`` first (as in vLLM), then earlier arrival."""
    return (r.priority, r.arrival_time)


_PER_STEP_HOOKS = ("plan_step", "seq_ceiling", "padded_tokens", "observe", "on_finished")


def is_passive(policy: SchedulingPolicy) -> bool:
    """True when ``policy`` keeps the baseline's per-step answers (no caps of its own, no padding,
    nothing learnt from steps or finishes): a step with nothing to admit and nobody to preempt is
    then decided by the scheduler alone."""
    cls = type(policy)
    return all(getattr(cls, m) is getattr(SchedulingPolicy, m) for m in _PER_STEP_HOOKS)


def default_victim(running: Sequence[Request]) -> Request:
    """The baseline preemption victim: the lowest priority, latest arrival."""
    return max(running, key=lambda r: (r.priority, r.arrival_time))
