"""A log of :class:`~tidal.cluster.pressure.KunServeController`'s plans with what each one saw,
and their replay (pure).

Give the controller a ``decisions`` callable (e.g. ``list.append``) and every plan it makes (a
drop, Sec. 4.1 / Fig. 6, or a restore, Sec. 4.4) is recorded as a :class:`ControllerDecision`:
the monitor's view of every instance (only what the controller reads: liveness, group, pool,
free blocks, queued and head-of-line demand), the controller's own state (groups, layers, the
undropped pools) and the plan. :func:`replay` asks a fresh controller on a monitor rebuilt from
that view, which shows that the plan is a function of the logged inputs -- in the simulator and
in the real runtime alike (``tests/runtime/test_same_pressure_decisions.py``), as
:mod:`tidal.cluster.decisions` does for the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.cluster.monitor import GlobalMonitor, InstanceStatus

if TYPE_CHECKING:
    from tidal.cluster.pressure.controller import KunServeController, Plan
    from tidal.cluster.pressure.drop_plan import Layers, ModelMemory


@dataclass(frozen=True, slots=True)
class PressureView:
    """What the monitor knew of one instance when a plan was made."""

    index: int
    alive: bool
    group: tuple[int, ...]
    num_blocks: int
    num_free_blocks: int
    block_size: int
    queued_block_demand: int
    hol_block_demand: int

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


@dataclass(frozen=True)
class ControllerDecision:
    """One plan (``plan``) made at ``now`` on ``views``, with the controller's state before it."""

    now: float
    views: tuple[PressureView, ...]
    groups: tuple[tuple[int, ...], ...]
    layers: dict[int, Layers]
    base_blocks: dict[int, int]
    plan: Plan
    only: tuple[int, ...] | None = None  # --kv-pressure auto: the throttled instances the drop was asked for

    @property
    def kind(self) -> str:
        return "restore" if hasattr(self.plan, "group") else "drop"

    def view(self, index: int) -> PressureView:
        return self.views[index]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "now": self.now, "groups": [list(g) for g in self.groups],
                "views": [{"index": v.index, "used": v.used_blocks, "blocks": v.num_blocks,
                           "queued": v.queued_block_demand, "hol": v.hol_block_demand} for v in self.views],
                **({"only": list(self.only)} if self.only is not None else {}), **self.plan.to_dict()}


DecisionRecorder = Callable[[ControllerDecision], None]


def pressure_views(monitor: GlobalMonitor) -> tuple[PressureView, ...]:
    return tuple(PressureView(r.index, r.alive, r.group, r.status.num_blocks, r.status.num_free_blocks,
                              r.status.block_size, r.status.queued_block_demand,
                              getattr(r.status, "hol_block_demand", 0))
                 for r in monitor.instances)


def capture(ctl: KunServeController, now: float, plan: Plan) -> ControllerDecision:
    """The record of ``plan``, made by ``ctl`` just now (its state is still the one it decided on)."""
    return ControllerDecision(now, pressure_views(ctl.monitor), ctl.groups, dict(ctl.layers), dict(ctl.base_blocks),
                              plan, ctl.gated)


def monitor_of(views: tuple[PressureView, ...]) -> GlobalMonitor:
    mon = GlobalMonitor([InstanceStatus(v.index, v.num_blocks, v.num_free_blocks, v.block_size,
                                        queued_block_demand=v.queued_block_demand,
                                        hol_block_demand=v.hol_block_demand) for v in views])
    for rec, v in zip(mon.instances, views, strict=True):
        rec.alive, rec.group = v.alive, v.group
    return mon


def replay(decision: ControllerDecision, model: ModelMemory, **controller: Any) -> Plan | None:
    """Ask a fresh controller (``controller``: its detector / restore policy, when not the
    defaults) on a monitor rebuilt from the decision's views and state."""
    from tidal.cluster.pressure.controller import KunServeController

    if decision.only is not None:  # the drop was asked for these throttles only (--kv-pressure auto's gate)
        only = set(decision.only)
        controller.setdefault("gate", lambda t: t.index in only)
    ctl = KunServeController(monitor_of(decision.views), model, **controller)
    ctl.base_blocks = dict(decision.base_blocks)
    ctl.groups, ctl.layers = decision.groups, dict(decision.layers)
    return ctl.decide(decision.now)


__all__ = ["ControllerDecision", "DecisionRecorder", "PressureView", "capture", "monitor_of", "pressure_views",
           "replay"]
