"""``tidal sim --kv-pressure migrate``: the Llumnix-like baseline (KunServe Sec. 2.3, Fig. 3c).

At a throttled instance's step end, :class:`tidal.cluster.pressure.MigrationController` picks
running requests to move with their KV to the instances with the most room. Each moves as a
prefill-to-decode hand-off does in :mod:`tidal.sim.simulator`: the destination allocates its
blocks at once and holds it paused, the source pauses it (it stalls), its KV goes in chunks
(``latency + bytes / bandwidth`` each) one after the other on the source's link; on landing the
source frees it and the destination resumes it. Only an instance's own step end starts its
migrations, so no request is taken out of a step in flight. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.cluster.pressure import Migration, MigrationController
from tidal.core.scheduler import RequestRejected
from tidal.sim.loop import Event
from tidal.sim.pressure import Call, LinkQueue, PressureHandler, copy_request, kv_chunk_bytes

if TYPE_CHECKING:
    from tidal.sim.instance import SimInstance
    from tidal.sim.simulator import ClusterSimulator


class MigrateHandler(PressureHandler):
    mode = "migrate"

    def attach(self, sim: ClusterSimulator) -> None:
        super().attach(sim)
        n = len(sim.instances)
        self.ctl = MigrationController(sim.monitor, self.detector, self.record)
        self.links = LinkQueue(self.cfg.link, n, self.cfg.tp)
        self.leaving = [0] * n  # blocks migrating out of / into each instance
        self.incoming = [0] * n
        self.moved = 0
        self.moved_bytes = 0
        self.stall_s = 0.0

    def after_step(self, inst: SimInstance, now: float) -> list[Event]:
        self.watch(now)
        assert self.sim is not None
        if inst.index not in self._hot:
            return []
        running = {inst.index: [(r.request_id, inst.kv.num_blocks_of(r.request_id)) for r in inst.scheduler.running
                                if r.num_computed_tokens > 0]}
        out: list[Event] = []
        for m in self.ctl.decide(now, running, dict(enumerate(self.leaving)), dict(enumerate(self.incoming))):
            ev = self._start(m, now)
            if ev is not None:
                out.append(ev)
        return out

    def _start(self, m: Migration, now: float) -> Event | None:
        assert self.sim is not None
        src, dst = self.sim.instances[m.src], self.sim.instances[m.dst]
        req = src.scheduler.requests[m.request_id]
        try:
            ok = dst.scheduler.add_running(copy_request(req, now, with_kv=True))
        except RequestRejected:
            ok = False
        if not ok:
            return None
        dst.scheduler.pause(m.request_id)
        src.scheduler.pause(m.request_id)
        self.leaving[m.src] += m.blocks
        self.incoming[m.dst] += m.blocks
        chunks = kv_chunk_bytes(self.cfg, (0, self.cfg.model.num_layers), req.num_computed_tokens)
        end = self.links.send(m.src, now, chunks)
        self.moved_bytes += sum(chunks)
        self.stall_s += end - now
        return Call(end, lambda t, m=m: self._land(m, t))

    def _land(self, m: Migration, now: float) -> list[Event]:
        assert self.sim is not None
        sim = self.sim
        src, dst = sim.instances[m.src], sim.instances[m.dst]
        src.scheduler.abort_requests([m.request_id], now)  # its KV is on dst now: free it here
        dst.scheduler.resume(m.request_id)
        sim.monitor.on_move(m.request_id, m.src, m.dst)
        self.leaving[m.src] -= m.blocks
        self.incoming[m.dst] -= m.blocks
        self.moved += 1
        return [e for e in (sim._wake(dst, now), sim._wake(src, now)) if e is not None]

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update({"migrated": self.moved, "migrated_bytes": self.moved_bytes,
                    "mean_stall_ms": 1000 * self.stall_s / self.moved if self.moved else None})
        return out


__all__ = ["MigrateHandler"]
