"""A log of the dispatcher's decisions with the inputs each one saw, and their replay (pure).

Give :class:`tidal.cluster.dispatch.Dispatcher` a ``recorder`` (any callable taking a
:class:`Decision`, e.g. ``list.append``) and every ``dispatch`` / ``choose_decode`` is recorded
with the monitor's view of every instance at that moment (:class:`InstanceView`) and the
answer. The real runtime and the simulator drive the same dispatcher, so their logs have the
same shape; :func:`replay` rebuilds a monitor from a logged view and asks a fresh dispatcher
again, which shows that the answer is a function of the logged inputs (the test of "the same
decisions in both shells", ``tests/runtime/test_same_decisions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.router import RouteRequest, build_router
from tidal.cluster.step_fit import StepFit

if TYPE_CHECKING:
    from tidal.cluster.dispatch import ClusterLayout

KINDS = ("dispatch", "handoff")


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What the monitor knew of one instance when a decision was taken."""

    index: int
    role: str
    alive: bool
    num_outstanding: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    queued_block_demand: int
    reserved_blocks: int  # hand-offs on their way here
    # what the cache-aware router reads beside the request's cached prefixes (recorded in the request)
    num_running: int = 0
    token_budget: int | None = None
    queued_prefill_tokens: int = 0
    step_time_ema_s: float | None = None
    queued_prefill_position: float = 0.0
    decode_context: float = 0.0
    step_fit: tuple[float, ...] | None = None  # its prefill steps' fit (tidal.cluster.step_fit)

    @property
    def handoff_room(self) -> int:
        return self.num_free_blocks - self.queued_block_demand - self.reserved_blocks


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision: ``dispatch`` (``request`` -> an instance) or ``handoff`` (``blocks`` -> a
    decode instance); ``choice`` None when nothing could take it."""

    kind: str
    request_id: str
    now: float
    views: tuple[InstanceView, ...]
    choice: int | None
    request: RouteRequest | None = None  # dispatch
    blocks: int | None = None  # handoff

    def view(self, index: int) -> InstanceView:
        return self.views[index]


def views_of(monitor: GlobalMonitor) -> tuple[InstanceView, ...]:
    return tuple(InstanceView(r.index, r.role, r.alive, r.num_outstanding, r.num_blocks, r.num_free_blocks,
                              r.block_size, r.queued_block_demand, sum(r.reserved.values()), r.num_running,
                              r.token_budget, r.queued_prefill_tokens, r.recent_step_s, r.queued_prefill_position,
                              r.decode_context, r.step_fit)
                 for r in monitor.instances)


def monitor_of(views: tuple[InstanceView, ...]) -> GlobalMonitor:
    """A monitor whose every instance looks as ``views`` say (outstanding requests and
    reservations stand in by count)."""
    mon = GlobalMonitor([InstanceStatus(v.index, v.num_blocks, v.num_free_blocks, v.block_size,
                                        num_running=v.num_running, queued_block_demand=v.queued_block_demand,
                                        token_budget=v.token_budget, queued_prefill_tokens=v.queued_prefill_tokens,
                                        queued_prefill_position=v.queued_prefill_position,
                                        step_decode_context=v.decode_context)
                         for v in views],
                        [v.role for v in views])
    for rec, v in zip(mon.instances, views, strict=True):
        rec.alive = v.alive
        if v.step_fit is not None:
            rec.steps = StepFit.of(v.step_fit)
        rec.step_time_ema_s = v.step_time_ema_s
        rec.outstanding = {f"~{k}" for k in range(v.num_outstanding)}
        if v.reserved_blocks:
            rec.reserved = {"~reserved": v.reserved_blocks}
    return mon


def replay(decision: Decision, layout: ClusterLayout, router: str = "least-outstanding") -> int | None:
    """Ask a fresh dispatcher the same question on a monitor rebuilt from the decision's views.
    Dispatch replays are exact only for routers without memory (not round-robin)."""
    from tidal.cluster.dispatch import Dispatcher

    disp = Dispatcher(layout, monitor_of(decision.views), build_router(router))
    if decision.kind == "dispatch":
        assert decision.request is not None
        return disp.dispatch(decision.request, decision.now)
    if decision.kind == "handoff":
        assert decision.blocks is not None
        return disp.choose_decode(decision.request_id, decision.blocks)
    raise ValueError(f"unknown decision kind {decision.kind!r}; kinds: {', '.join(KINDS)}")


__all__ = ["KINDS", "Decision", "InstanceView", "monitor_of", "replay", "views_of"]
