"""KunServe's global memory manager over the monitor (Sec. 3, Fig. 4) (pure).

:class:`KunServeController` is what the simulator and, later, the real runtime call after each
report: ``decide(now)`` reads only the :class:`~tidal.cluster.monitor.GlobalMonitor` and answers
with plain data -- a :class:`~tidal.cluster.pressure.drop_plan.DropPlan` (a throttle: drop
layers, Sec. 4.1), a :class:`~tidal.cluster.pressure.restore.RestorePlan` (the pressure is gone,
Sec. 4.4) or None. The caller executes it (drop the layers, grow the pools, exchange the KV,
run the group as a pipeline; or load the layers back and split the group) and then calls
``applied(plan, now)``; until then no other plan is made. Every decision goes to ``recorder``
as a :class:`~tidal.cluster.pressure.events.PressureDecision` (the caller adds its execution
events, e.g. the exchange, with :meth:`note`); every plan also goes to ``decisions`` with the
view it was made on (:mod:`tidal.cluster.pressure.record`, which replays it).

A group is seen through its first stage, whose status is the whole group's (its pool in blocks
of all layers, its queue); ``monitor.on_groups`` tells the dispatcher to send a group's requests
there. The undropped capacity of a group (the 50 % rule) is the sum of its members' first
reported pools.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tidal.cluster.monitor import GlobalMonitor
from tidal.cluster.pressure.drop_plan import DropPlan, DropPlanner, Layers, ModelMemory
from tidal.cluster.pressure.events import PressureDecision, Recorder
from tidal.cluster.pressure.record import DecisionRecorder, capture
from tidal.cluster.pressure.restore import AutoscaleSignal, RestorePlan, RestorePolicy, restore_plan
from tidal.cluster.pressure.throttle import Throttle, ThrottleDetector, demand_bytes

Plan = DropPlan | RestorePlan


class KunServeController:
    def __init__(self, monitor: GlobalMonitor, model: ModelMemory, *, planner: DropPlanner | None = None,
                 detector: ThrottleDetector | None = None, restore: RestorePolicy | None = None,
                 autoscale: AutoscaleSignal | None = None, recorder: Recorder | None = None,
                 decisions: DecisionRecorder | None = None, gate: Callable[[Throttle], bool] | None = None):
        """``gate``: which throttles a drop may answer (``--kv-pressure auto`` chose a drop for them);
        None: every throttle (KunServe's own rule)."""
        if len(monitor.instances) < 2:
            raise ValueError("KunServe drops layers that a peer holds: it needs at least 2 instances")
        if model.num_layers < 2:
            raise ValueError("KunServe needs a model whose layers split into at least 2 pipeline stages")
        self.monitor, self.model = monitor, model
        self.planner = planner or DropPlanner(model)
        self.detector = detector or ThrottleDetector()
        self.restore_policy = restore or RestorePolicy()
        self.autoscale = autoscale or AutoscaleSignal()
        self.recorder, self.decisions = recorder, decisions
        self.gate = gate
        self.gated: tuple[int, ...] | None = None  # the throttles the last drop was asked for, with a gate
        self.base_blocks = {r.index: r.status.num_blocks for r in monitor.instances}
        self.groups: tuple[tuple[int, ...], ...] = tuple((r.index,) for r in monitor.instances)
        self.layers: dict[int, Layers] = {r.index: (0, model.num_layers) for r in monitor.instances}
        self.pending: Plan | None = None
        self._throttled: set[int] = set()
        self._stuck = False  # throttled and no plan: the autoscale signal was given (again after a plan is applied)

    # ---------------------------------------------------------------- decisions
    def observe(self, now: float) -> list[Throttle]:
        """Log throttle onsets and feed the autoscale signal; no plan (the caller is busy executing one)."""
        throttles = self.detector.scan(self.monitor)
        self._note_throttles(throttles, now)
        if self.autoscale.observe(now, self.usage()):
            self.note("autoscale", now, tuple(sorted(self._throttled)), reason="KV use still rising after a drop",
                      usage=round(self.usage(), 4))
        return throttles

    def decide(self, now: float) -> Plan | None:
        self.gated = None
        throttles = self.observe(now)
        if self.pending is not None:
            return None
        if throttles:  # no restore while any instance is throttled
            if self.gate is not None:
                throttles = [t for t in throttles if self.gate(t)]
                self.gated = tuple(t.index for t in throttles)
            return self._drop(throttles, now) if throttles else None
        for g in self.groups:
            if len(g) > 1:
                st = self.monitor.instances[g[0]].status
                undropped = sum(self.base_blocks[i] for i in g)
                if self.restore_policy.should_restore(st.num_blocks - st.num_free_blocks, st.queued_block_demand,
                                                      undropped):
                    return self.plan_restore(g, now, used_blocks=st.num_blocks - st.num_free_blocks,
                                             undropped_blocks=undropped)
        return None

    def plan_restore(self, group: tuple[int, ...], now: float, **details: Any) -> RestorePlan:
        """Group ``group``'s restore plan, made the pending plan and logged with ``details``."""
        plan = restore_plan(group, self.layers, self.model)
        self._decided(plan, now)
        self.note("restore", now, group, **plan.to_dict(), **details)
        return plan

    def _drop(self, throttles: list[Throttle], now: float) -> DropPlan | None:
        block_size = self.monitor.instances[throttles[0].index].status.block_size
        need = demand_bytes(throttles, self.model.block_bytes(block_size))
        shortage: dict[int, int] = {t.index: max(0, t.shortage_blocks) for t in throttles}
        headroom = {r.index: r.status.num_free_blocks - r.status.queued_block_demand for r in self.monitor.routable()}
        plan = self.planner.plan(self.groups, self.layers, need, shortage, headroom)
        if plan is None:
            if not self._stuck:
                self._stuck = True
                self.note("autoscale", now, tuple(t.index for t in throttles), reason="throttled and no drop plan",
                          demand_bytes=need)
            return None
        self._decided(plan, now)
        self.note("drop", now, tuple(i for g in plan.changed for i in g), **plan.to_dict())
        self.autoscale.on_drop(now)
        return plan

    def _decided(self, plan: Plan, now: float) -> None:
        if self.decisions is not None:
            self.decisions(capture(self, now, plan))
        self.pending = plan

    def applied(self, plan: Plan, now: float) -> None:
        """The caller executed ``plan``: the new groups run from now on."""
        if plan is not self.pending:
            raise ValueError("applied() takes the plan decide() returned last")
        self.pending, self._stuck = None, False
        self.layers.update(plan.layers)
        if isinstance(plan, DropPlan):
            self.groups = plan.groups
        else:
            rest = [g for g in self.groups if g != plan.group]
            self.groups = tuple(sorted(rest + [(i,) for i in plan.group], key=min))
            if all(len(g) == 1 for g in self.groups):
                self.autoscale.on_restore()
        self.monitor.on_groups(self.groups)

    def withdraw(self, plan: Plan | None) -> None:
        """The caller will not execute ``plan`` (a restore that does not fit yet): nothing changes,
        and the next ``decide`` may plan again. A no-op for any plan but the pending one."""
        if plan is not None and plan is self.pending:
            self.pending = None

    def on_failure(self, index: int, now: float) -> tuple[int, ...]:
        """Sec. 4.4's fault tolerance: instance ``index`` failed. Its group dissolves; every member
        holds all layers again (the survivors restore theirs from their host copy, the failed one
        restarts whole). A pending plan touching the group is void. Returns the group (``(index,)``
        when it ran alone)."""
        g = self.group_of(index)
        if len(g) == 1:
            return g
        if self.pending is not None and (any(i in g for gr in getattr(self.pending, "changed", ()) for i in gr)
                                         or getattr(self.pending, "group", None) == g):
            self.pending = None
        self.groups = tuple(sorted([x for x in self.groups if x != g] + [(i,) for i in g], key=min))
        self.layers.update({i: (0, self.model.num_layers) for i in g})
        self.note("restore", now, g, reason="failure", failed=index)
        self.monitor.on_groups(self.groups)
        return g

    # ---------------------------------------------------------------- state
    def usage(self) -> float:
        """The cluster's KV demand (in use plus queued) over what it holds now."""
        recs = self.monitor.routable()
        total = sum(r.status.num_blocks for r in recs)
        used = sum(r.status.num_blocks - r.status.num_free_blocks + r.status.queued_block_demand for r in recs)
        return used / total if total else 0.0

    def group_of(self, index: int) -> tuple[int, ...]:
        return next(g for g in self.groups if index in g)

    def note(self, kind: str, now: float, instances: tuple[int, ...], **details: Any) -> None:
        if self.recorder is not None:
            self.recorder(PressureDecision(kind, now, tuple(instances), details))

    def _note_throttles(self, throttles: list[Throttle], now: float) -> None:
        hot = {t.index for t in throttles}
        for t in throttles:
            if t.index not in self._throttled:
                self.note("throttle", now, t.members, shortage_blocks=t.shortage_blocks, hol_blocks=t.hol_blocks)
        self._throttled = hot


__all__ = ["KunServeController", "Plan"]
