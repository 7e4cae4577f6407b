"""``tidal sim --kv-pressure drop``: KunServe in the simulator (Sec. 3-4).

The pure :class:`tidal.cluster.pressure.KunServeController` reads the monitor at every step end
and answers with a drop plan or a restore plan; this module executes them on the simulated
instances:

- **drop** (Sec. 4.1): the instances of each new group finish the step they are in (they
  drain), then one :class:`tidal.sim.pipeline.GroupInstance` takes over at the first stage's
  index: its pool is the members' pools grown by the weights they dropped; the dispatcher sends
  the group's new requests there (``monitor.on_groups``);
- **exchange** (Sec. 4.2): each running request keeps its computed KV, but the layers its old
  instance no longer holds go to the stage that now holds them
  (:func:`tidal.cluster.pressure.kv_moves`), in chunks on the sender's link; the request stalls
  (paused) until its last chunk lands, while the group runs the others. Queued requests move
  with no KV;
- **restore** (Sec. 4.4): the members pull the layers they dropped from their peers over the
  link while the group keeps running ("we overlap restoring with the normal request
  processing"); then the group drains and splits: each running request goes to the member with
  the most room and gathers its KV there (the request stalls meanwhile), queued ones are spread;
- the **autoscale** signal is logged (no instance is added: that is the runtime's to do).

A new plan is made only when no exchange, restore or drain is under way. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.cluster.moves import (
    NO_DEADLINES,
    FailOver,
    Move,
    MoveKind,
    MoveRecord,
    Phase,
    Release,
    Reserve,
    Resume,
    SendChunk,
)
from tidal.cluster.pressure import DropPlan, KunServeController, RestorePlan, RestorePolicy, kv_moves
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import RequestRejected, Scheduler
from tidal.sim.instance import SimInstance
from tidal.sim.loop import Event
from tidal.sim.pipeline import GroupInstance
from tidal.sim.pressure import Call, LinkQueue, PressureHandler, copy_request, kv_chunk_bytes

if TYPE_CHECKING:
    from tidal.sim.simulator import ClusterSimulator


def by_state(s: Scheduler) -> tuple[list[Request], list[Request]]:
    """(running requests, with their KV; the queued ones -- waiting, swapped -- oldest first)."""
    running = [r for r in [*s.running, *s.paused.values()] if r.status is RequestStatus.RUNNING]
    queued = sorted([*s.waiting, *s.swapped], key=lambda r: (r.priority, r.arrival_time))
    return running, queued


class DropHandler(PressureHandler):
    mode = "drop"

    def attach(self, sim: ClusterSimulator) -> None:
        super().attach(sim)
        self.base: list[SimInstance] = list(sim.instances)
        self.execs: list[SimInstance] = list(sim.instances)  # who executes each index's work now
        self.ctl = KunServeController(sim.monitor, self.cfg.model, detector=self.detector,
                                      restore=RestorePolicy(self.cfg.restore_threshold), recorder=self.record)
        self.links = LinkQueue(self.cfg.link, len(sim.instances), self.cfg.tp)
        self.plan: DropPlan | RestorePlan | None = None  # being executed
        self.draining: list[SimInstance] = []
        self.loading = False  # a restore's weights are on their way
        self.in_flight = 0  # requests waiting for their KV
        self.moves_started = 0.0
        self.moves_of: tuple[int, ...] = ()  # the instances whose KV moves are in flight
        self.exchange_bytes = 0
        self.retired: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- the handler's hooks
    def can_step(self, inst: SimInstance) -> bool:
        return self.execs[inst.index] is inst and inst not in self.draining

    def after_step(self, inst: SimInstance, now: float) -> list[Event]:
        if self.draining:
            return self._drained(now)
        if self.plan is not None or self.in_flight:
            self.ctl.observe(now)  # keeps the throttle and autoscale log current; no plan while one runs
            return []
        plan = self.ctl.decide(now)
        if isinstance(plan, DropPlan):
            self.plan = plan
            self.draining = list({id(e): e for g in plan.changed for i in g for e in [self.execs[i]]}.values())
            return self._drained(now)
        if isinstance(plan, RestorePlan):
            self.plan, self.loading = plan, True
            t = max(self.links.send(i, now, [b]) for i, b in plan.load_bytes.items())
            return [Call(t, self._loaded)]
        return []

    def _drained(self, now: float) -> list[Event]:
        if any(e.busy for e in self.draining):
            return []
        self.draining = []
        plan = self.plan
        assert plan is not None
        if isinstance(plan, DropPlan):
            return self._drop(plan, now)
        return self._restore(plan, now)

    def _loaded(self, now: float) -> list[Event]:
        plan = self.plan
        assert isinstance(plan, RestorePlan)
        self.loading = False
        self.draining = [self.execs[plan.group[0]]]
        return self._drained(now)

    # ---------------------------------------------------------------- drop + exchange (Sec. 4.1-4.2)
    def _drop(self, plan: DropPlan, now: float) -> list[Event]:
        assert self.sim is not None
        sim, out = self.sim, []
        L = self.cfg.model.num_layers
        for g in plan.changed:
            olds = list({id(e): e for i in g for e in [self.execs[i]]}.values())
            grp = GroupInstance([self.base[i] for i in g], plan.layers, self.cfg, self.base[g[0]].scheduler.config,
                                self.base[g[0]].cost_model, self.cfg.overhead_s, now)
            after = {i: plan.layers[i] for i in g}
            nbytes, nreq = 0, 0
            for old in olds:
                members = old.group if isinstance(old, GroupInstance) else (old.index,)
                before = {i: plan.previous_layers.get(i, (0, L)) for i in members}
                nreq += len(old.scheduler.requests)
                nbytes += self._hand_over(old, grp, before, after, now)
                if isinstance(old, GroupInstance):
                    self.retired.append({**old.stats(), "ended_s": now})
            self._install(g, grp, now)
            self.exchange_bytes += nbytes
            self.note("exchange", now, g, requests=nreq, bytes=nbytes, pool_blocks=grp.kv.num_blocks)
            out.append(sim._wake(grp, now))
        self.ctl.applied(plan, now)
        self.plan = None
        self.moves_started, self.moves_of = now, tuple(i for g in plan.changed for i in g)
        return [e for e in out if e is not None]

    def _hand_over(self, old: SimInstance, new: SimInstance, before: dict[int, tuple[int, int]],
                   after: dict[int, tuple[int, int]], now: float) -> int:
        """Move every request of ``old`` to ``new``: the running ones keep their KV, whose layers
        move as ``kv_moves(before, after)`` says (stalled till they land); returns the bytes."""
        running, queued = by_state(old.scheduler)
        moves = kv_moves(before, after)
        total = 0
        for req in running:
            total += self._move(old, new, req, moves, now)[0]
        for req in queued:
            new.scheduler.add_request(copy_request(req, now, with_kv=False))
        for rid in list(old.scheduler.requests):
            if self.sim is not None and old.index != new.index:
                self.sim.monitor.on_move(rid, old.index, new.index)
        old.scheduler.abort_requests(list(old.scheduler.requests), now)
        return total

    @staticmethod
    def _admit(inst: SimInstance, req: Request) -> bool:
        try:
            return inst.scheduler.add_running(req)
        except RequestRejected:
            return False

    def _move(self, src: SimInstance, dst: SimInstance, req: Request, layer_moves: list, now: float,
              fits: bool = True) -> tuple[int, bool]:
        """One running request of an exchange (or a restore) moving to ``dst`` with its KV: a move
        of the one machine (:class:`tidal.cluster.moves.Move`, kind ``exchange``): ``dst`` holds a
        paused copy and the KV ``layer_moves`` name goes on each sender's link, or (no room, or
        ``fits`` False) the request recomputes there. Returns the bytes sent and whether its KV moved."""
        assert self.sim is not None
        rid, tokens = req.request_id, req.num_computed_tokens
        chunks = [(m.src, c) for m in layer_moves if (c := kv_chunk_bytes(self.cfg, m.layers, tokens))]
        move = Move(rid, MoveKind.EXCHANGE, src.index, src.kv.num_blocks_of(rid), len(chunks), dst=dst.index,
                    deadlines=NO_DEADLINES)
        todo, sent = move.start(now), []
        while todo:
            c = todo.pop(0)
            if isinstance(c, Reserve):
                ok = fits and self._admit(dst, copy_request(req, now, with_kv=True))
                todo += move.reserved(dst.index, now) if ok else move.refused(dst.index, now)
            elif isinstance(c, SendChunk):
                sent.append(chunks[c.index])
            elif isinstance(c, FailOver):  # the source retired into the group: it recomputes there
                dst.scheduler.add_request(copy_request(req, now, with_kv=False))
            elif isinstance(c, Resume):
                dst.scheduler.resume(rid)
            else:  # Release: the refused copy was never admitted
                assert isinstance(c, Release), f"unexpected move command {c!r}"
        if move.phase is Phase.SENDING and not sent:  # nothing of its KV has to move
            move.all_landed(now)
        if not sent:
            self.sim.move_records.append(MoveRecord.of(move))
            return 0, move.phase is Phase.DONE
        dst.scheduler.pause(rid)  # stalled until its last chunk lands
        end = max(self.links.send(s, now, c) for s, c in sent)
        self.in_flight += 1
        self.sim.loop.push(Call(end, lambda t: self._landed(dst, move, t)))
        return sum(sum(c) for _, c in sent), True

    def _landed(self, inst: SimInstance, move: Move, now: float) -> Event | None:
        assert self.sim is not None
        for c in move.all_landed(now):
            if isinstance(c, Resume) and move.request_id in inst.scheduler.paused:
                inst.scheduler.resume(move.request_id)
        self.sim.move_records.append(MoveRecord.of(move))
        self.in_flight -= 1
        if not self.in_flight:
            self.note("exchange-done", now, self.moves_of, seconds=round(now - self.moves_started, 4))
        return self.sim._wake(inst, now) if self.execs[inst.index] is inst else None

    def _install(self, group: tuple[int, ...], inst: SimInstance, now: float) -> None:
        """``inst`` executes for every index of ``group``: the first stage's slot, the others parked."""
        assert self.sim is not None
        for i in group:
            self.execs[i] = inst
            self.sim.instances[i] = inst if i == inst.index else self.base[i]
            self.sim.monitor.on_status(self.sim.instances[i], now)  # type: ignore[arg-type]  (live status)

    # ---------------------------------------------------------------- restore (Sec. 4.4)
    def _restore(self, plan: RestorePlan, now: float) -> list[Event]:
        assert self.sim is not None
        grp = self.execs[plan.group[0]]
        assert isinstance(grp, GroupInstance)
        members = [self.base[i] for i in plan.group]
        before = dict(grp.layers)
        running, queued = by_state(grp.scheduler)
        room = {m.index: m.kv.num_blocks - self.detector.reserve(m.kv.num_blocks) for m in members}
        nbytes = 0
        for req in sorted(running, key=lambda r: (-grp.kv.num_blocks_of(r.request_id), r.request_id)):
            need = grp.kv.num_blocks_of(req.request_id)
            home = max(room, key=lambda i: (room[i], -i))
            dst = self.base[home]
            sent, moved = self._move(grp, dst, req, kv_moves(before, {home: (0, self.cfg.model.num_layers)}), now,
                                     fits=room[home] >= need)  # no member holds it: it recomputes there
            room[home] -= need if moved else 0
            nbytes += sent
            self.sim.monitor.on_move(req.request_id, grp.index, home)
        for req in queued:
            dst = min(members, key=lambda m: (m.queued_block_demand + m.kv.num_blocks - m.kv.num_free_blocks, m.index))
            dst.scheduler.add_request(copy_request(req, now, with_kv=False))
            self.sim.monitor.on_move(req.request_id, grp.index, dst.index)
        grp.scheduler.abort_requests(list(grp.scheduler.requests), now)
        self.retired.append({**grp.stats(), "ended_s": now})
        for m in members:
            self._install((m.index,), m, now)
        self.ctl.applied(plan, now)
        self.plan = None
        self.moves_started, self.moves_of = now, plan.group
        self.exchange_bytes += nbytes
        self.note("restore-done", now, plan.group, requests=len(running) + len(queued), bytes=nbytes)
        return [e for m in members if (e := self.sim._wake(m, now)) is not None]

    # ---------------------------------------------------------------- end
    def finish(self, now: float) -> None:
        assert self.sim is not None
        seen = set()
        for e in self.execs:
            if isinstance(e, GroupInstance) and id(e) not in seen:
                seen.add(id(e))
                self.retired.append({**e.stats(), "ended_s": None})
        self.sim.instances[:] = self.base

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update({"groups": self.retired, "exchange_bytes": self.exchange_bytes,
                    "link_bytes": sum(self.links.bytes)})
        return out


__all__ = ["DropHandler"]
