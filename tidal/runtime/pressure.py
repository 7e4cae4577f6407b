"""``--kv-pressure drop`` in the real cluster: the front end's side of KunServe.

After each instance report the pure :class:`~tidal.cluster.pressure.KunServeController` reads
the global monitor (throttle detection, Sec. 3; the Fig. 6 drop plan). Each group a plan forms,
of any size and from instances that ran alone or groups that merge, is executed here: every
member gets a ``group`` command with the stage order and its layers; the first stage becomes the
group's head, the others its stages (the workers then talk directly, :mod:`tidal.runtime.group`).
The dispatcher stops routing to the other members at once (the group is seen through its head,
whose pool is the group's); when the head reports ``grouped`` their requests are the head's, and
once every new group's head did, the plan is applied. When the controller decides a restore
(Sec. 4.4: KV use below half of the undropped pools; only once the group's exchange is done),
the head gets ``restore``: the stages' KV comes back, every member reloads its dropped layers
from the checkpoint and the group dissolves. A worker failure in a group restores the survivors.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Any

from tidal.cluster.pressure import (
    DecisionRecorder,
    DropPlan,
    KunServeController,
    ModelMemory,
    PressureDecision,
    RestorePlan,
)
from tidal.runtime.front import Front
from tidal.runtime.group import GroupSpec
from tidal.runtime.protocol import Group, Restore, Ungroup

log = logging.getLogger("tidal.cluster")
EVENT_LOG = 256  # pressure events kept for /admin/state


RETRY_RESTORE_S = 2.0  # after a refused restore (the blocks in use did not fit), wait this long


def model_memory(arch: Any, dtype_bytes: int) -> ModelMemory:
    return ModelMemory(arch.num_layers, arch.params_per_layer() * dtype_bytes, arch.kv_bytes_per_token(dtype_bytes))


class PressureLog:
    """A ``--kv-pressure`` mode's coordinator: the replies it hears from the front end (each a
    no-op unless the mode overrides it), and its decisions and events, for ``/admin/state`` and
    ``/metrics``."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()

    def _record(self, d: PressureDecision) -> None:
        self.counts[d.kind] += 1
        self.events.append(d.to_dict())
        del self.events[:-EVENT_LOG]

    def on_first_token(self, rid: str, now: float) -> None:
        """Request ``rid`` streamed its first token (``auto`` learns from it)."""

    def tick(self, now: float) -> None:
        """After an instance report (under the front end's lock): decide, and act."""

    def on_layer_bytes(self, layer_bytes: int) -> None:
        """A worker's ready message: what dropping one of its layers frees."""

    def on_grouped(self, i: int, role: str, members: tuple[int, ...], request_ids: list[str], num_blocks: int,
                   layer_ids: list[int], now: float) -> None: ...

    def on_exchange_done(self, i: int, members: tuple[int, ...], exchanged: int, moved: int, now: float) -> None: ...

    def on_ungrouped(self, i: int, lost: list[str], num_blocks: int, now: float) -> None: ...

    def on_restored(self, i: int, role: str, num_blocks: int, layer_ids: list[int], num_back: int,
                    stats: dict[str, Any], now: float) -> None: ...

    def on_failure(self, i: int, now: float) -> None: ...

    def on_move_end(self, t: Any, move: Any) -> None:
        """A move this mode started (a migration) ended, however it ended."""

    def snapshot(self) -> dict[str, Any]:
        raise NotImplementedError


class DropCoordinator(PressureLog):
    def __init__(self, llm: Front, model: ModelMemory):
        super().__init__()
        self.llm, self.model = llm, model
        self.ctl: KunServeController | None = None
        self.executing: DropPlan | None = None
        self.waiting_heads: set[int] = set()
        self.exchanging: set[int] = set()  # heads whose KV exchange is not done yet
        self.restoring: RestorePlan | None = None
        self.no_restore_until = 0.0
        self.dropped: dict[int, int] = {}  # instance -> decoder layers it dropped
        self.layers: dict[int, list[int]] = {}  # instance -> [start, end) it holds, once grouped
        self.formed = 0  # groups formed so far (each gets fresh link addresses)
        self.decisions: DecisionRecorder | None = None  # each plan with the view it was made on (a test's log)
        # Sec. 4.3: the heads split their steps with tidal profile's Eq. 1 coefficients (--profile), else FLOP ratios
        self.microbatch_cost = "profiled" if llm.config.scheduler.microbatch_cost is not None else "FLOP ratios"
        log.info("--kv-pressure drop: a group's microbatch split uses %s Eq. 1 coefficients%s", self.microbatch_cost,
                 f" {llm.config.scheduler.microbatch_cost}" if self.microbatch_cost == "profiled" else "")

    def on_layer_bytes(self, layer_bytes: int) -> None:
        """A worker's ready message: what dropping one of its layers really frees (its parameters and
        any 4-bit copies, which ``params x dtype`` misses). Taken before the controller is built."""
        if self.ctl is None and layer_bytes > 0 and layer_bytes != self.model.layer_bytes:
            log.info("--kv-pressure drop: a decoder layer frees %d bytes (parameters %d + 4-bit copies)",
                     layer_bytes, self.model.layer_bytes)
            self.model = replace(self.model, layer_bytes=layer_bytes)

    def tick(self, now: float) -> None:
        """After a report (under the front end's lock): decide, and execute a new plan."""
        llm = self.llm
        if not llm.ready or not all(r.alive for r in llm.monitor.instances):
            return
        if self.ctl is None:  # the undropped pools are the first real reports
            self.ctl = KunServeController(llm.monitor, self.model, recorder=self._record,
                                          decisions=self.decisions)
        if self.executing is not None or self.exchanging or self.restoring is not None or now < self.no_restore_until:
            self.ctl.observe(now)  # one change at a time: throttles and autoscale are still logged
            return
        plan = self.ctl.decide(now)
        if isinstance(plan, RestorePlan):
            head = plan.group[0]
            st = llm.monitor.instances[head].status
            if st.num_blocks - st.num_free_blocks > self.ctl.base_blocks[head]:  # n > 2: not yet on one pool
                self._defer_restore(plan, now)
                return
            self.restoring = plan
            llm.send(head, Restore())  # the head drives it and gathers the group (tidal.runtime.group)
            return
        if plan is None:
            return
        self.executing = plan
        llm.monitor.on_groups(plan.groups)  # from now on each group takes requests through its head
        for g in plan.changed:
            self.formed += 1
            spec = GroupSpec(tuple(g), {i: tuple(plan.layers[i]) for i in g},
                             {m: llm.group_address(f"group-{self.formed}-{m}") for m in g[1:]},
                             {i: llm.worker_pid(i) for i in g})  # each member watches its peers' processes
            for m in g:
                llm.send(m, Group(spec))
            self.waiting_heads.add(g[0])
            self.exchanging.add(g[0])
            self.ctl.note("exchange", now, tuple(g), layers={i: list(plan.layers[i]) for i in g})

    def on_grouped(self, i: int, role: str, members: tuple[int, ...], request_ids: list[str], num_blocks: int,
                   layer_ids: list[int], now: float) -> None:
        llm = self.llm
        self.dropped[i] = self.model.num_layers - len(layer_ids)
        self.layers[i] = [min(layer_ids), max(layer_ids) + 1]
        if role == "tail":  # n > 1 requests a stage could not move: re-run them (recompute)
            for rid in request_ids:
                t = llm.by_wid.get(rid)
                if t is not None:
                    llm.recompute(t, t.instance, abort=False)
            return
        for rid in request_ids:  # the other members' requests now run on the head
            t = llm.by_wid.get(rid)
            if t is not None and t.instance in members and t.instance != i:
                llm.monitor.on_finish(t.instance, t.rid)
                llm.monitor.on_dispatch(i, t.rid, now)
                t.instance = i
        self.waiting_heads.discard(i)
        if not self.waiting_heads and self.executing is not None and self.ctl is not None:
            self.ctl.applied(self.executing, now)
            self.executing = None

    def on_exchange_done(self, i: int, members: tuple[int, ...], exchanged: int, moved: int, now: float) -> None:
        self.exchanging.discard(i)
        if self.ctl is not None:
            self.ctl.note("exchange-done", now, tuple(members), requests_exchanged=exchanged, requests_moved=moved)

    def on_restored(self, i: int, role: str, num_blocks: int, layer_ids: list[int], num_back: int,
                    stats: dict[str, Any], now: float) -> None:
        """A member reloaded its layers (``role`` head / tail) or the head refused (the blocks in use
        would not fit its whole pool: the group stays and the restore is decided again later).
        ``stats``: the head's restore, overlapped with serving (seconds and steps) and its stall."""
        plan, ctl = self.restoring, self.ctl
        if role == "refused":
            self._defer_restore(plan, now)
            return
        self.dropped.pop(i, None)
        self.layers.pop(i, None)
        if role == "head" and plan is not None and ctl is not None and ctl.pending is plan:
            ctl.applied(plan, now)
            ctl.note("restore-done", now, plan.group, num_blocks=num_blocks, requests_exchanged_back=num_back,
                     **stats)
            self.restoring = None

    def _defer_restore(self, plan: RestorePlan | None, now: float) -> None:
        """The restore is not run now (refused, or the group's KV does not fit its head yet): the
        group stays, and the controller decides again after ``RETRY_RESTORE_S``."""
        if self.ctl is not None:
            self.ctl.withdraw(plan)
        self.restoring, self.no_restore_until = None, now + RETRY_RESTORE_S

    def on_failure(self, i: int, now: float) -> None:
        """Worker ``i`` died (Sec. 4.4): its group dissolves; each survivor is told to restore its
        layers (it may have noticed first: then the command is a no-op there)."""
        if self.ctl is None:
            return
        survivors = set(self.ctl.group_of(i))
        if self.executing is not None and any(i in g for g in self.executing.changed):
            forming = next(g for g in self.executing.changed if i in g)
            survivors.update(forming)  # the group being formed dissolves, and every group merging into it
            for m in forming:
                if m != i and len(self.ctl.group_of(m)) > 1:
                    self.ctl.on_failure(m, now)
            self.executing = None
            self.waiting_heads.clear()
        if self.restoring is not None and i in self.restoring.group:
            self.restoring = None
        self.exchanging.clear()
        self.ctl.on_failure(i, now)
        self.dropped.pop(i, None)
        self.layers.pop(i, None)
        for s in sorted(survivors - {i}):
            self.llm.send(s, Ungroup())

    def on_ungrouped(self, i: int, lost: list[str], num_blocks: int, now: float) -> None:
        """A survivor restored its layers; the requests it held lost their KV of the peer's layers
        and are re-run from their streamed tokens (recompute)."""
        llm = self.llm
        self.dropped.pop(i, None)
        self.layers.pop(i, None)
        if self.ctl is not None and len(self.ctl.group_of(i)) > 1:  # it noticed before the front end did
            self.ctl.on_failure(i, now)
        for rid in lost:
            t = llm.by_wid.get(rid)
            if t is not None and t.instance == i:
                llm.recompute(t, i, abort=False)

    def snapshot(self) -> dict[str, Any]:
        groups = [list(g) for g in self.ctl.groups if len(g) > 1] if self.ctl is not None else []
        return {"mode": "drop", "groups": groups, "dropped_layers": {str(k): v for k, v in self.dropped.items()},
                "layers": {str(k): v for k, v in self.layers.items()}, "events_total": dict(self.counts),
                "events": list(self.events[-32:]), "executing": self.executing is not None,
                "restoring": self.restoring is not None, "microbatch_cost": self.microbatch_cost}


def build_coordinator(mode: str, llm: Any, dtype: str) -> PressureLog | None:
    """The coordinator of ``--kv-pressure mode`` (None for preempt: the workers' schedulers alone)."""
    if mode == "migrate":  # the Llumnix-like baseline
        from tidal.runtime.migrate import MigrateCoordinator

        return MigrateCoordinator(llm)
    if mode not in ("drop", "auto"):
        return None
    dtype_bytes = {"float32": 4}.get(dtype, 2)
    model = model_memory(llm.engine.arch, dtype_bytes)
    if mode == "auto":  # each throttle onset chooses recompute, swap, migrate or drop
        from tidal.runtime.auto import AutoCoordinator

        return AutoCoordinator(llm, model, dtype_bytes)
    return DropCoordinator(llm, model)


__all__ = ["DropCoordinator", "PressureLog", "build_coordinator", "model_memory"]
