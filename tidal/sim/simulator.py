"""The cluster simulator: requests arrive, the dispatcher picks an instance, each instance runs
the engine's scheduler against a cost model on a virtual clock.

Placement goes through the same pure objects as the real runtime (``tidal.runtime.cluster``):
a :class:`~tidal.cluster.monitor.GlobalMonitor` (fed the live instances: no report delay) and a
:class:`~tidal.cluster.dispatch.Dispatcher` with the router. Colocated, that is all. With
``--mode disaggregate`` (BucketServe Sec. III, P/D Scheduler) new requests go to the prefill
instances; when a prefill instance samples a request's first token it pauses the request and
``Dispatcher.choose_decode`` picks a decode instance (None: the hand-off waits, retried when a
decode instance ends a step or a hand-off lands; the request keeps its blocks on the prefill
instance). The decode instance imports it at once, blocks allocated and paused
(``Scheduler.add_imported`` + ``pause``), sharing the blocks of the prefix its cache holds (a
conversation's history it decoded); the chunks reaching past them (``tidal.cluster.handoff``) go one
after the other on the prefill instance's link (:mod:`tidal.sim.pd`), while both instances
keep stepping; when the last chunk lands, the prefill instance frees the request, the decode
instance resumes it and the monitor hears ``on_handoff``.

Events, at equal times in this order: arrivals (0), step ends and hand-off landings (1),
wake-ups of idle instances (2). So every request that arrives at ``t`` is queued before any
instance plans a step at ``t`` -- the order the engine's own loop has (add what arrived, then step).

Per request the simulator fills a :class:`tidal.metrics.RequestRecord` exactly as the
load client does for a real server (TTFT, per-token gaps, E2E), so the same ``summarize``
gives the same metrics. A request that cannot fit the model's context (prompt + max_tokens) or
an instance's KV pool is refused and counted as failed. Pure: no clock, no threads, no torch.

Conversations (:mod:`tidal.workload.conversation`) run as a closed loop, as the load client runs
them: a turn arrives ``think_s`` after its previous turn finished (its record's ``arrival_s`` is
then that time). When a turn fails (refused, aborted, never admitted) the rest of its conversation
is dropped: never sent, counted as failed with the error ``dropped`` (a user has no answer to go on
from). The fast path runs an instance ahead only until the next arrival it can know of: the next
one scheduled, or the soonest a turn still waiting on its predecessor could come (now plus the
shortest think time among them).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import inf
from typing import Any

from tidal.cluster.decisions import Decision
from tidal.cluster.dispatch import ClusterLayout, Dispatcher
from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.monitor import GlobalMonitor
from tidal.cluster.moves import (
    NO_DEADLINES,
    FreeSource,
    Move,
    MoveKind,
    MoveRecord,
    Pause,
    Reserve,
    Resume,
    Retry,
    SendChunk,
    moved_request,
)
from tidal.cluster.router import Router, RouteRequest
from tidal.core.plan import RequestUpdate
from tidal.core.request import Request
from tidal.core.validation import RequestRejected, check_context
from tidal.metrics import RequestRecord
from tidal.sim.instance import SimInstance, sim_names, sim_request
from tidal.sim.loop import Event, EventLoop
from tidal.sim.pd import Handoff, HandoffConfig
from tidal.sim.pressure import PressureHandler
from tidal.workload import RequestSpec
from tidal.workload.conversation import successors


@dataclass
class SimResult:
    records: list[RequestRecord]
    instances: list[dict[str, Any]]
    timelines: list[dict[str, Any]]
    simulated_time_s: float
    num_events: int
    routed: list[int] = field(default_factory=list)  # instance of each request (-1: refused)
    mode: str = "colocate"
    handoffs: list[Handoff] = field(default_factory=list)
    max_pending_handoffs: int = 0
    handoff_timeline: dict[str, list] = field(default_factory=dict)  # t, pending, in_flight
    splits: list[Any] = field(default_factory=list)  # --mode split: tidal.sim.split.SplitTransfer per request
    split_load: dict[str, list] = field(default_factory=dict)  # --mode split: the planner's predicted loads
    pressure: dict[str, Any] | None = None  # --kv-pressure: its decisions and their summary
    moves: list[MoveRecord] = field(default_factory=list)  # every request move, as it ended (tidal.cluster.moves)


class _Arrival(Event):
    __slots__ = ("sim", "index")
    priority = 0

    def __init__(self, time: float, sim: ClusterSimulator, index: int):
        super().__init__(time)
        self.sim, self.index = sim, index

    def fire(self, loop: EventLoop):
        return self.sim._arrive(self.index, self.time)


class _StepEnd(Event):
    __slots__ = ("sim", "inst")
    priority = 1

    def __init__(self, time: float, sim: ClusterSimulator, inst: SimInstance):
        super().__init__(time)
        self.sim, self.inst = sim, inst

    def fire(self, loop: EventLoop):
        return self.sim._step_end(self.inst, self.time)


class _Landed(Event):
    __slots__ = ("sim", "handoff")
    priority = 1

    def __init__(self, time: float, sim: ClusterSimulator, handoff: Handoff):
        super().__init__(time)
        self.sim, self.handoff = sim, handoff

    def fire(self, loop: EventLoop):
        return self.sim._land(self.handoff, self.time)


class _Tick(Event):
    """Only moves the clock: the end of a step run ahead by the fast path with nothing after it."""

    __slots__ = ()
    priority = 1

    def fire(self, loop: EventLoop):
        return None


class _Wake(Event):
    __slots__ = ("sim", "inst")
    priority = 2

    def __init__(self, time: float, sim: ClusterSimulator, inst: SimInstance):
        super().__init__(time)
        self.sim, self.inst = sim, inst

    def fire(self, loop: EventLoop):
        self.inst.wake_pending = False
        if self.inst.busy:
            return None
        return self.sim._begin(self.inst, self.time)


class ClusterSimulator:
    """``layout`` (default: all colocated) gives the roles; disaggregated needs ``handoff`` (the
    link and the KV shape). ``recorder`` receives the dispatcher's decisions."""

    def __init__(self, instances: Sequence[SimInstance], router: Router, specs: Sequence[RequestSpec],
                 max_model_len: int | None = None, request_ids: Sequence[str] | None = None,
                 layout: ClusterLayout | None = None, handoff: HandoffConfig | None = None,
                 recorder: Callable[[Decision], None] | None = None, timeline_interval: float = 0.0,
                 pressure: PressureHandler | None = None, fast_forward: bool = True):
        if not instances:
            raise ValueError("the simulator needs at least one instance")
        self.instances = list(instances)
        self.layout = layout or ClusterLayout(len(self.instances))
        if self.layout.instances != len(self.instances):
            raise ValueError(f"the layout has {self.layout.instances} instances, the simulator {len(self.instances)}")
        if self.layout.disaggregated and handoff is None:
            raise ValueError("a disaggregated cluster needs a HandoffConfig (the link and the KV shape)")
        for inst, role in zip(self.instances, self.layout.roles(), strict=True):
            inst.role = role
        self.router = router
        self.monitor = GlobalMonitor(self.instances, self.layout.roles(),  # type: ignore[arg-type]  (live statuses)
                                     learn_steps=getattr(router, "uses_cache", False))
        self.dispatcher = Dispatcher(self.layout, self.monitor, router, recorder)
        self.handoff = handoff
        self.handoffs: list[Handoff] = []
        self._pending: dict[int, Handoff] = {}  # request index -> hand-off waiting for a decode instance
        self.move_records: list[MoveRecord] = []  # every move as it ended, for the same-decision tests
        self._moves: dict[int, Move] = {}  # request index -> its move (tidal.cluster.moves), until it lands
        self._in_flight = 0
        self._max_pending = 0
        self._link_free = [0.0] * len(self.instances)  # when each prefill instance's link is free again
        self._htl: dict[str, list] = {"t": [], "pending": [], "in_flight": []}
        self._htl_interval = timeline_interval
        self.specs = list(specs)
        self.max_model_len = max_model_len
        self.ids = list(request_ids) if request_ids is not None else [str(i) for i in range(len(self.specs))]
        self.records = [RequestRecord(i, s.arrival_s, s.prompt_len, s.output_len) for i, s in enumerate(self.specs)]
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self._last_token: dict[int, float] = {}
        self.routed = [-1] * len(self.specs)
        self.loop = EventLoop()
        # arrivals fire in time order: the next one's time bounds the fast path (see _begin); a
        # conversation's later turn is scheduled when its predecessor ends (``_turn_ended``)
        self._next_turn = successors(self.specs)
        self._arrival_times = sorted(s.arrival_s for s in self.specs if s.after is None)  # a heap
        self._turns_waiting = set(self._next_turn.values())  # turns waiting on their predecessor
        self._thinks = sorted((self.specs[j].think_s, j) for j in self._turns_waiting)  # a heap, cleared lazily
        self._live: dict[int, Request] = {}  # request index -> its request, until its first token
        self._dead: set[int] = set()  # instances that failed (``fail``): they never step again
        self.num_failovers = 0
        self.fast_forward = fast_forward and self.layout.mode == "colocate" and pressure is None
        self._fast = False  # set by run()
        self.pressure = pressure  # what a throttled instance does beyond preempting (tidal.sim.pressure)
        if pressure is not None:
            if self.layout.disaggregated:
                raise ValueError("--kv-pressure needs colocated instances")
            pressure.attach(self)

    # ---------------------------------------------------------------- events
    def _arrive(self, i: int, now: float) -> Event | None:
        spec, rec = self._arrived(i, now)
        try:  # before dispatch: a request too long for the context reaches no instance
            check_context(spec.prompt_len, spec.output_len, self.max_model_len)
        except RequestRejected as e:
            return self._refuse(rec, now, f"context: {e}")
        names = None
        if self.dispatcher.router.uses_cache:
            self._sync_cache_views()
        if self.instances[0].kv.enable_caching:
            names = sim_names(self.ids[i], spec, self.instances[0].kv.block_size)
        route_names = ()  # the prompt's blocks (a conversation turn's names run on into its answer)
        if names is not None and self.dispatcher.router.uses_cache:
            route_names = tuple(names[:(spec.prompt_len - 1) // self.instances[0].kv.block_size])
        k = self.dispatcher.dispatch(RouteRequest(self.ids[i], spec.prompt_len, spec.output_len, route_names), now)
        if k is None:
            return self._refuse(rec, now, "unavailable: no instance is alive")
        inst = self.instances[k]
        req = sim_request(self.ids[i], spec, now, inst.kv.block_size, inst.kv.enable_caching, names)
        try:
            inst.add_request(req)
        except RequestRejected as e:
            self.monitor.on_finish(k, self.ids[i])
            return self._refuse(rec, now, f"rejected: {e}")
        self.routed[i] = k
        self._live[i] = req
        return self._wake(inst, now)

    def _sync_cache_views(self) -> None:
        """The names every instance's pools gained and lost since the last dispatch, into the
        monitor's views (as the runtime's step reports carry them; here without their lag)."""
        for inst, rec in zip(self.instances, self.monitor.instances, strict=True):
            delta = inst.kv.drain_delta()
            if not delta.empty:
                rec.cache.apply(delta)

    def _arrived(self, i: int, now: float) -> tuple[RequestSpec, RequestRecord]:
        """Request ``i`` arrives at ``now``: its spec and record (sent now)."""
        heapq.heappop(self._arrival_times)  # the earliest: this one's time
        rec = self.records[i]
        rec.send_s = now
        return self.specs[i], rec

    def _run_ahead_bound(self, now: float) -> float:
        """The earliest time a request can arrive after ``now`` (see the module docstring)."""
        bound = self._arrival_times[0] if self._arrival_times else inf
        thinks, waiting = self._thinks, self._turns_waiting
        while thinks and thinks[0][1] not in waiting:
            heapq.heappop(thinks)
        return min(bound, now + thinks[0][0]) if thinks else bound

    def _turn_ended(self, i: int, now: float, ok: bool) -> None:
        """Request ``i`` ended at ``now``: its conversation's next turn arrives ``think_s`` later,
        or (it failed) the rest of the conversation is dropped."""
        j = self._next_turn.get(i)
        if j is None:
            return
        if ok:
            self._turns_waiting.discard(j)
            t = now + self.specs[j].think_s
            self.records[j].arrival_s = t
            heapq.heappush(self._arrival_times, t)
            self.loop.push(_Arrival(t, self, j))
            return
        while j is not None:
            self._turns_waiting.discard(j)
            rec = self.records[j]
            rec.success, rec.error = False, "dropped"
            j = self._next_turn.get(j)

    def _wake(self, inst: SimInstance, now: float) -> Event | None:
        if inst.busy or inst.wake_pending:
            return None
        inst.wake_pending = True
        return _Wake(now, self, inst)

    def _refuse(self, rec: RequestRecord, now: float, error: str) -> None:
        rec.end_s, rec.success, rec.status, rec.error = now, False, 400, error.split(":")[0]
        self._live.pop(rec.index, None)
        self._turn_ended(rec.index, now, False)
        return None

    def _begin(self, inst: SimInstance, now: float) -> Event | None:
        if self._dead and inst.index in self._dead:
            return None
        if self.pressure is not None and not self.pressure.can_step(inst):
            return None  # draining before its layers change, or parked in a pipeline group
        ran_ahead = False
        if self._fast:
            # Fast path: decode-only steps that end before the next arrival run here and now, each at
            # its own times. Until that arrival nothing reads this instance (colocated, no KV pressure:
            # another instance's events touch only that instance, the monitor and its own records), so
            # every record, block and timeline sample is what running them one event each would give.
            before = self._run_ahead_bound(now)
            start, now = now, inst.run_decodes(now, before, lambda updates, t: self._apply(inst, updates, t),
                                               self._apply_run)
            ran_ahead = now != start
            dt = inst.begin_crossing(now)  # the decode-only step that ends after that arrival, if any
        else:
            dt = None
        if dt is None:
            dt, updates = inst.begin_step(now)
            if updates:
                self._apply(inst, updates, now)
        if dt is None:
            return _Tick(now) if ran_ahead else None  # the clock still reaches the last step's end
        ev = inst.end_event  # one step in flight per instance: its event object is reused
        if ev is None:
            ev = inst.end_event = _StepEnd(now + dt, self, inst)
        else:
            ev.time = now + dt
        return ev

    def _step_end(self, inst: SimInstance, now: float) -> Event | list[Event] | None:
        if self._dead and inst.index in self._dead:
            return None  # the step in flight died with its instance: its tokens never came
        updates = inst.end_step(now)
        if inst.last_plan is not None and self.monitor.instances[inst.index].steps is not None:
            shape = inst.last_step_shape()  # as a worker's step report carries it (the router's step fit)
            if shape is not None:
                self.monitor.on_step(inst.index, *shape, inst.step_time_s or 0.0)
        self._apply(inst, updates, now)
        if inst.role == "colocated":
            if self.pressure is None:
                return self._begin(inst, now)
            after = self.pressure.after_step(inst, now)  # may drain or retire inst, or start moves
            return [e for e in (*after, self._begin(inst, now)) if e is not None]
        out: list[Event | None] = []
        if inst.role == "prefill":  # as the prefill worker does after a step: pause, hand off
            for upd in updates:
                if upd.new_token_ids and not upd.finished:
                    out.extend(self._start_handoff(inst, upd.request_id, now))
        elif inst.role == "decode" and self._pending:  # a decode instance reported: retry the waiting ones
            out.extend(self._retry(now))
        out.append(self._begin(inst, now))
        return [e for e in out if e is not None]

    # ---------------------------------------------------------------- failures
    def fail(self, index: int, now: float) -> list[Event]:
        """Instance ``index`` dies, as a worker process does in the runtime (``tidal.runtime.cluster``,
        not restarted): its step in flight is lost, it never steps again and the monitor skips it;
        each request it held, in arrival order, ends its move as the move machine says (a migration
        touching it: the pressure handler's) or is re-run elsewhere (``failover``). Colocated
        instances without pipeline groups, on the event-by-event loop (the fast path runs ahead)."""
        if self._fast or self.layout.mode != "colocate" or (self.pressure is not None and self.pressure.mode == "drop"):
            raise ValueError("a failure is simulated on colocated instances without pipeline groups, "
                             "with fast_forward off")
        if index in self._dead:
            return []
        self._dead.add(index)
        self.monitor.on_failure(index)
        inst, out = self.instances[index], []
        for rid in sorted(inst.scheduler.requests, key=self._index.__getitem__):
            req = inst.scheduler.requests.get(rid)
            moved = self.pressure.on_failure(index, rid, now) if self.pressure is not None else None
            if moved is not None:
                out.extend(moved)
            elif req is not None:
                out.append(self.failover(req, now))
        inst.scheduler.abort_requests(list(inst.scheduler.requests), now)
        return [e for e in out if e is not None]

    def failover(self, req: Request, now: float) -> Event | None:
        """Re-run ``req`` from its prompt and the tokens it had (recompute), on the instance the
        dispatcher picks, as the runtime's fail-over does."""
        i = self._index[req.request_id]
        k = self.dispatcher.dispatch(RouteRequest(req.request_id, req.num_tokens, self.specs[i].output_len), now)
        if k is None:
            return self._refuse(self.records[i], now, "unavailable: no instance is alive")
        try:
            self.instances[k].add_request(moved_request(req, with_kv=False))
        except RequestRejected as e:
            self.monitor.on_finish(k, req.request_id)
            return self._refuse(self.records[i], now, f"rejected: {e}")
        self.num_failovers += 1
        return self._wake(self.instances[k], now)

    # ---------------------------------------------------------------- P/D hand-offs
    def _start_handoff(self, src: SimInstance, rid: str, now: float) -> list[Event | None]:
        """``rid`` sampled its first token on prefill instance ``src`` (n = 1: every simulated
        request). The move is the pure machine both shells drive (:class:`tidal.cluster.moves.Move`)."""
        assert self.handoff is not None
        req = src.scheduler.requests[rid]
        nchunks, nbytes, duration = self.handoff.cost(req.num_computed_tokens)
        h = Handoff(rid, self._index[rid], src.index, handoff_blocks(req.num_computed_tokens, src.block_size),
                    req.num_computed_tokens, nchunks, nbytes, duration, now)
        self.handoffs.append(h)
        self._moves[h.index] = Move(rid, MoveKind.HANDOFF, src.index, h.blocks, nchunks, deadlines=NO_DEADLINES)
        cmds = self._moves[h.index].start(now)  # pause on src, then ask for a decode instance
        assert isinstance(cmds[0], Pause) and isinstance(cmds[1], Reserve)
        src.scheduler.pause(rid)
        self._pending[h.index] = h
        self._max_pending = max(self._max_pending, len(self._pending))
        out = self._try(h, now)
        self._sample_handoffs(now)
        return out

    def _try(self, h: Handoff, now: float) -> list[Event | None]:
        """The machine's ``Reserve``: the dispatcher's decode instance holds a paused copy, or
        (none has room) the hand-off stays pending, or (the copy does not fit) it is refused."""
        dst_index = self.dispatcher.choose_decode(h.request_id, h.blocks, now)
        if dst_index is None:
            return []  # pending: the monitor shows it; the request keeps its blocks on src
        move = self._moves[h.index]
        src, dst = self.instances[h.src], self.instances[dst_index]
        try:  # the decode instance shares what its prefix cache holds of the KV (the engine's import)
            reused = dst.scheduler.add_imported(moved_request(src.scheduler.requests[h.request_id], with_kv=True),
                                                reuse_cached=True)
        except RequestRejected:
            reused = None
        ok = reused is not None
        if not ok:  # refused (the runtime's "refused"): the machine retries at the next report
            assert isinstance(move.refused(dst_index, now)[0], Retry)
            self.monitor.on_handoff(h.request_id, h.src, dst_index, ok=False)
            h.refusals += 1
            return []
        dst.scheduler.pause(h.request_id)  # its blocks are held until the last chunk lands
        if reused:  # only the chunks past the shared prefix are read (as a worker skips the others)
            h.num_chunks, h.nbytes, h.duration_s = self.handoff.cost(h.num_tokens, cached=reused)
            move.num_chunks, h.reused_tokens = h.num_chunks, reused
        sends = move.reserved(dst_index, now)
        assert len(sends) == h.num_chunks and all(isinstance(c, SendChunk) for c in sends)
        del self._pending[h.index]
        h.dst, h.chosen_s = dst_index, now
        h.start_s = max(now, self._link_free[h.src])  # chunks one after the other on src's link
        h.end_s = h.start_s + h.duration_s
        self._link_free[h.src] = h.end_s
        self._in_flight += 1
        return [_Landed(h.end_s, self, h)]

    def _retry(self, now: float) -> list[Event | None]:
        """Retry the waiting hand-offs in request order. One that needs more blocks than any decode
        instance has room for is skipped: ``choose_decode`` would answer None and change nothing."""
        out: list[Event | None] = []
        room = self._max_room()
        for i in sorted(self._pending):
            h = self._pending[i]
            if h.blocks <= room:
                got = self._try(h, now)
                if got:
                    out.extend(got)
                    room = self._max_room()
        self._sample_handoffs(now)
        return out

    def _max_room(self) -> int:
        return max((r.handoff_room for r in self.monitor.alive("decode") if r.role == "decode"), default=-1)

    def _land(self, h: Handoff, now: float) -> list[Event]:
        assert h.dst is not None
        move = self._moves.pop(h.index)
        cmds = [c for k in range(h.num_chunks) for c in move.chunk_landed(k, now)]
        assert cmds == [Resume(h.dst), FreeSource(h.src)]
        src, dst = self.instances[h.src], self.instances[h.dst]
        dst.scheduler.resume(h.request_id)
        receive = getattr(dst.cost_model, "receive_time", None)
        if receive is not None:  # a blocking receive (tidal.sim.jitter): dst's next step waits for it
            dst.stall_s += receive(h.nbytes)
        src.scheduler.abort_requests([h.request_id], now)  # after its last chunk the prefill frees it
        move.source_freed(now)
        self.move_records.append(MoveRecord.of(move))
        self.monitor.on_handoff(h.request_id, h.src, h.dst, ok=True)
        h.landed = True
        self._in_flight -= 1
        out = [self._wake(dst, now), self._wake(src, now)]
        if self._pending:
            out.extend(self._retry(now))
        else:
            self._sample_handoffs(now)
        return [e for e in out if e is not None]

    def _sample_handoffs(self, now: float) -> None:
        tl = self._htl
        if tl["t"] and now - tl["t"][-1] < self._htl_interval:
            tl["pending"][-1] = max(tl["pending"][-1], len(self._pending))  # keep the peak of the interval
            tl["in_flight"][-1] = max(tl["in_flight"][-1], self._in_flight)
            return
        tl["t"].append(now)
        tl["pending"].append(len(self._pending))
        tl["in_flight"].append(self._in_flight)

    # ---------------------------------------------------------------- records
    def _apply(self, inst: SimInstance, updates: list[RequestUpdate], now: float) -> None:
        records, last = self.records, self._last_token
        for upd in updates:
            i = self._index[upd.request_id]
            rec = records[i]
            n = len(upd.new_token_ids)
            if n:
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.send_s
                    if self.pressure is not None:
                        self.pressure.on_first_token(upd.request_id, now)
                    rec.itl_s.extend([0.0] * (n - 1))
                    req = self._live.pop(i, None)
                    if req is not None:  # what its first admission found in the prefix cache
                        rec.cached_tokens = req.num_cached_tokens
                elif n == 1:  # a decode step: the common case
                    rec.itl_s.append(now - last[i])
                else:
                    gap = (now - last[i]) / n
                    rec.itl_s.extend([gap] * n)
                last[i] = now
                rec.counted_tokens += n
                rec.num_chunks += 1
            if upd.finished:
                self.monitor.on_finish(inst.index, upd.request_id)
                last.pop(i, None)
                rec.end_s = now
                rec.e2e_s = now - rec.send_s
                rec.output_tokens = rec.counted_tokens
                rec.success = upd.finish_reason in ("length", "stop")
                rec.status = 200
                if not rec.success:
                    rec.error = upd.finish_reason or "aborted"
                    self._live.pop(i, None)
                if self._next_turn:
                    self._turn_ended(i, now, rec.success)

    def _apply_run(self, request_ids: list[str], ends: list[float]) -> None:
        """What ``_apply`` records for a run of decode steps that finished nobody, ending at ``ends``:
        each request (past its first token) took one token a step."""
        records, last, index = self.records, self._last_token, self._index
        gaps = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
        n, first, final = len(ends), ends[0], ends[-1]
        for rid in request_ids:
            i = index[rid]
            rec = records[i]
            rec.itl_s.append(first - last[i])
            rec.itl_s.extend(gaps)
            last[i] = final
            rec.counted_tokens += n
            rec.num_chunks += n

    # ---------------------------------------------------------------- run
    def run(self, until: float | None = None, progress: Callable[[float], None] | None = None) -> SimResult:
        for i, spec in enumerate(self.specs):
            if spec.after is None:  # later turns arrive when their predecessor ends (_turn_ended)
                self.loop.push(_Arrival(spec.arrival_s, self, i))
        self._fast = self.fast_forward and until is None  # a run cut at ``until`` must not run ahead of it
        self.loop.run(until=until, progress=progress)
        if self.pressure is not None:
            self.pressure.finish(self.loop.now)
        for rec in self.records:
            if rec.end_s is None:
                rec.error = rec.error or "unfinished"
        return SimResult(
            records=self.records, instances=[inst.stats() for inst in self.instances],
            timelines=[{**inst.timeline.to_dict(), "role": inst.role} for inst in self.instances],
            simulated_time_s=self.loop.now, num_events=self.loop.num_fired, routed=self.routed,
            mode=self.layout.mode, handoffs=self.handoffs, max_pending_handoffs=self._max_pending,
            handoff_timeline=self._htl, pressure=self.pressure.summary() if self.pressure is not None else None,
            moves=self.move_records)
