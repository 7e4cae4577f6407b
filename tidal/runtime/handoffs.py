"""The front end's side of moving a request between workers with its KV: a prefill-to-decode
hand-off (BucketServe's disaggregation), a migration (``--kv-pressure migrate``) and a DynaServe
split's beta part (``--mode split``). The source pauses the request and says ``HandoffStarted``
with its snapshot; its KV chunks (``KVChunk``) are forwarded to the destination once one is
chosen (the dispatcher's decode pick, or the migration's target); the destination answers
``Landed`` or ``Refused``. A mixin of :class:`~tidal.runtime.cluster.ClusterLLM`: every method
runs under its lock."""

from __future__ import annotations

from typing import Any

from tidal.runtime import protocol as P
from tidal.runtime.records import Handoff, Tracked


class HandoffFront:
    monitor: Any
    by_wid: dict[str, Tracked]
    requests: dict[str, Tracked]
    transport: Any
    dispatcher: Any
    pressure: Any
    split: Any
    kv_bytes_moved: int

    def send(self, i: int, cmd: Any) -> None: ...
    def now(self) -> float: ...
    def failover(self, t: Tracked) -> None: ...
    def recompute(self, t: Tracked, src: int, abort: bool = True) -> None: ...

    def drop_handoff(self, t: Tracked) -> None:
        """Forget ``t``'s hand-off: its reservation on the target, and the chunks in flight."""
        h = t.handoff
        if h is not None and h.dst is not None:
            self.monitor.on_handoff(t.rid, h.src, h.dst, ok=False)
        self._release_handoff(t)
        t.handoff = None

    def _release_handoff(self, t: Tracked) -> None:
        if t.handoff is not None:
            for h in t.handoff.handles:
                self.transport.release(h)
            t.handoff.handles.clear()

    def _try_handoff(self, t: Tracked) -> None:
        h = t.handoff
        if h is None or h.dst is not None:
            return
        dst = self.pressure.target(t.wid) if self.pressure is not None else None  # a migration's own target
        if dst is None:
            dst = self.dispatcher.choose_decode(t.rid, h.blocks, self.now())
        if dst is None:
            return  # waits, visible in the monitor's pending hand-offs
        h.dst = dst
        self.send(dst, P.Import(h.meta, True))
        for k, handle in enumerate(h.handles):
            self.send(dst, P.KVChunk(t.wid, handle, k == h.num_chunks - 1))

    def _on_handoff(self, i: int, r: P.HandoffStarted, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is None:
            return
        t.handoff = Handoff(i, r.snapshot, r.blocks, r.num_chunks)
        self._try_handoff(t)

    def _on_kv(self, i: int, r: P.KVChunk, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is None or t.handoff is None:
            self.transport.release(r.handle)  # aborted meanwhile
            return
        t.handoff.handles.append(r.handle)
        self.kv_bytes_moved += r.handle.nbytes
        if t.split_log is not None:
            t.split_log["kv_bytes"] += r.handle.nbytes
        if t.handoff.dst is not None:
            self.send(t.handoff.dst, r)

    def _on_split_done(self, i: int, r: P.SplitDone, now: float) -> None:
        self.split.on_split_done(i, r.request_id, r.tokens, r.last_token_time)

    def _on_landed(self, i: int, r: P.Landed, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is not None and t.handoff is not None:
            if self.pressure is not None and self.pressure.target(t.wid) == i:
                self.pressure.on_landed(t, i)  # a migration
            else:
                self.monitor.on_handoff(t.rid, t.handoff.src, i, ok=True)
            t.instance, t.handoff = i, None  # the decode worker released the chunks it read

    def _on_refused(self, i: int, r: P.Refused, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is not None and t.handoff is not None and t.handoff.split is not None and t.handoff.dst == i:
            self.split.unsplit(t)
        elif t is not None and t.handoff is not None and t.handoff.dst == i and self.pressure is not None \
                and self.pressure.target(t.wid) == i:
            self.pressure.on_refused(t, i)
        elif t is not None and t.handoff is not None and t.handoff.dst == i and r.kv_lost:
            self.recompute(t, t.handoff.src)  # its chunks cannot be read: a retry would be refused again
        elif t is not None and t.handoff is not None and t.handoff.dst == i:
            self.monitor.on_handoff(t.rid, t.handoff.src, i, ok=False)
            t.handoff.dst = None  # retried when an instance reports room
        elif t is not None:  # a fail-over import found no room here: try again elsewhere
            self.monitor.on_finish(i, t.rid)
            self.failover(t)

    def _on_unmoved(self, i: int, r: P.Unmoved, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is not None and self.pressure is not None:  # a migration the source could not start
            self.pressure.on_unmoved(t)


__all__ = ["HandoffFront"]
