"""The cluster simulator: requests arrive, a router picks an instance, each instance runs the
engine's scheduler against a cost model on a virtual clock.

Events, at equal times in this order: arrivals (0), step ends (1), wake-ups of idle instances
(2). So every request that arrives at ``t`` is queued before any instance plans a step at
``t`` -- the order the engine's own loop has (add what arrived, then step).

Per request the simulator fills a :class:`tidal.metrics.RequestRecord` exactly as the
load client does for a real server (TTFT, per-token gaps, E2E), so the same ``summarize``
gives the same metrics. A request that cannot fit the model's context (prompt + max_tokens) or
an instance's KV pool is refused and counted as failed. Pure: no clock, no threads, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.cluster.router import Router, RouteRequest
from tidal.core.plan import RequestUpdate
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import RequestRejected
from tidal.metrics import RequestRecord
from tidal.sim.instance import SimInstance
from tidal.sim.loop import Event, EventLoop
from tidal.workload import RequestSpec


@dataclass
class SimResult:
    records: list[RequestRecord]
    instances: list[dict[str, Any]]
    timelines: list[dict[str, Any]]
    simulated_time_s: float
    num_events: int
    routed: list[int] = field(default_factory=list)  # instance of each request (-1: refused)


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
        self.sim._apply(self.inst.end_step(self.time), self.time)
        return self.sim._begin(self.inst, self.time)


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
    def __init__(self, instances: Sequence[SimInstance], router: Router, specs: Sequence[RequestSpec],
                 max_model_len: int | None = None, request_ids: Sequence[str] | None = None):
        if not instances:
            raise ValueError("the simulator needs at least one instance")
        self.instances = list(instances)
        self.router = router
        self.specs = list(specs)
        self.max_model_len = max_model_len
        self.ids = list(request_ids) if request_ids is not None else [str(i) for i in range(len(self.specs))]
        self.records = [RequestRecord(i, s.arrival_s, s.prompt_len, s.output_len) for i, s in enumerate(self.specs)]
        self._index = {rid: i for i, rid in enumerate(self.ids)}
        self._last_token: dict[int, float] = {}
        self.routed = [-1] * len(self.specs)
        self.loop = EventLoop()

    # ---------------------------------------------------------------- events
    def _arrive(self, i: int, now: float) -> Event | None:
        spec, rec = self.specs[i], self.records[i]
        rec.send_s = now
        if self.max_model_len is not None and spec.prompt_len + spec.output_len > self.max_model_len:
            return self._refuse(rec, now, f"context: prompt {spec.prompt_len} + max_tokens {spec.output_len} "
                                          f"exceeds the model's context of {self.max_model_len} tokens")
        k = self.router.route(RouteRequest(self.ids[i], spec.prompt_len, spec.output_len), self.instances)
        inst = self.instances[k]
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
        req = Request(self.ids[i], [0] * spec.prompt_len, params, arrival_time=now)
        try:
            inst.add_request(req)
        except RequestRejected as e:
            return self._refuse(rec, now, f"rejected: {e}")
        self.routed[i] = k
        if inst.busy or inst.wake_pending:
            return None
        inst.wake_pending = True
        return _Wake(now, self, inst)

    @staticmethod
    def _refuse(rec: RequestRecord, now: float, error: str) -> None:
        rec.end_s, rec.success, rec.status, rec.error = now, False, 400, error.split(":")[0]
        return None

    def _begin(self, inst: SimInstance, now: float) -> Event | None:
        dt, updates = inst.begin_step(now)
        if updates:
            self._apply(updates, now)
        if dt is None:
            return None
        ev = inst.end_event  # one step in flight per instance: its event object is reused
        if ev is None:
            ev = inst.end_event = _StepEnd(now + dt, self, inst)
        else:
            ev.time = now + dt
        return ev

    def _apply(self, updates: list[RequestUpdate], now: float) -> None:
        records, last = self.records, self._last_token
        for upd in updates:
            i = self._index[upd.request_id]
            rec = records[i]
            n = len(upd.new_token_ids)
            if n:
                if rec.ttft_s is None:
                    rec.ttft_s = now - rec.send_s
                    rec.itl_s.extend([0.0] * (n - 1))
                else:
                    gap = (now - last[i]) / n
                    rec.itl_s.extend([gap] * n)
                last[i] = now
                rec.counted_tokens += n
                rec.num_chunks += 1
            if upd.finished:
                last.pop(i, None)
                rec.end_s = now
                rec.e2e_s = now - rec.send_s
                rec.output_tokens = rec.counted_tokens
                rec.success = upd.finish_reason in ("length", "stop")
                rec.status = 200
                if not rec.success:
                    rec.error = upd.finish_reason or "aborted"

    # ---------------------------------------------------------------- run
    def run(self, until: float | None = None, progress: Callable[[float], None] | None = None) -> SimResult:
        for i, spec in enumerate(self.specs):
            self.loop.push(_Arrival(spec.arrival_s, self, i))
        self.loop.run(until=until, progress=progress)
        for rec in self.records:
            if rec.end_s is None:
                rec.error = rec.error or "unfinished"
        return SimResult(
            records=self.records, instances=[inst.stats() for inst in self.instances],
            timelines=[inst.timeline.to_dict() for inst in self.instances],
            simulated_time_s=self.loop.now, num_events=self.loop.num_fired, routed=self.routed)
