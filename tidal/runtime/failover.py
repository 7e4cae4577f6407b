"""The front end's side of a worker that dies or fails: its requests are re-run on the live
instances from their prompt plus the tokens already streamed (their streams continue), the worker
is restarted, and a re-run no live instance can take waits (*parked*) until one is back, up to the
cluster config's ``start_timeout_s``, then fails with :class:`InstanceUnavailableError` (the
server's 503 with ``Retry-After``). A worker that dies ``START_ATTEMPTS`` times in a row before it
is ready is not restarted. A mixin of :class:`~tidal.runtime.cluster.ClusterLLM`: every method runs
under its lock (the I/O thread's handlers, or the coordinators through
:class:`tidal.runtime.front.Front`)."""

from __future__ import annotations

import logging

from tidal.engine.async_engine import EngineDeadError, InstanceUnavailableError
from tidal.runtime import protocol as P
from tidal.runtime.records import Tracked

log = logging.getLogger("tidal.cluster")
START_ATTEMPTS = 3  # a worker that dies this many times in a row before it is ready is not restarted


class FailoverFront:
    """Re-runs, parking and worker deaths of :class:`~tidal.runtime.cluster.ClusterLLM`."""

    def recompute(self, t: Tracked, src: int, abort: bool = True) -> None:
        if abort:
            self.send(src, P.Abort(t.wid))
        self.monitor.on_finish(src, t.rid)
        self.failover(t)

    def failover(self, t: Tracked) -> None:
        self.drop_handoff(t)
        if self.splitter is not None:
            self.splitter.on_finish(t.rid, None)  # its planned parts are void; it runs whole now
        # a new id on the workers: outputs of the old run still in flight from a live instance (one
        # that was told to abort it) must not reach the client twice
        self.by_wid.pop(t.wid, None)
        t.wid = f"{t.rid}~{t.failovers + 1}"
        self.by_wid[t.wid] = t
        t.failovers += 1
        self.num_failovers += 1
        if t.params.n > 1 and t.delivered:  # its sequences' text went out: a re-run would repeat it
            self._give_up(t, "an instance failed under an n > 1 request whose output had begun; retry the request")
            return
        t.instance = -1
        if not self._place(t, fresh=self._fresh(t)):
            self.parked[t.rid] = (t, self.now())  # placed when an instance is back (_unpark)

    @staticmethod
    def _fresh(t: Tracked) -> bool:
        """Nothing of ``t`` reached the client: it starts anew (an ``add``), else it continues (an ``import``)."""
        return not t.tokens and t.text_sent == 0 and not t.delivered

    def _give_up(self, t: Tracked, why: str) -> None:
        self._deliver(t, InstanceUnavailableError(why))
        self.requests.pop(t.rid, None)
        self.by_wid.pop(t.wid, None)
        self.parked.pop(t.rid, None)

    def _unpark(self, now: float) -> None:
        """Place the parked re-runs, oldest first, while an instance takes them; those parked longer
        than ``start_timeout_s``, or while nothing will come back, fail (a 503 the client may retry)."""
        for rid, (t, since) in list(self.parked.items()):
            if self._place(t, fresh=self._fresh(t)):
                del self.parked[rid]
                continue
            coming = self.cluster.restart and any(h is not None for h in self.handles)
            if not coming or now - since > self.cluster.start_timeout_s:
                self._give_up(t, f"the instance serving this request failed and none was back within "
                                 f"{now - since:.0f} s; retry the request")

    def _on_fatal(self, i: int, r: P.Fatal, now: float) -> None:
        """The worker failed (it exits after saying so): counted and failed over like a death."""
        log.error("worker %d failed: %s\n%s", i, r.error, r.traceback)
        if self.handles[i] is not None:
            self._on_worker_death(i, f"it failed: {r.error}")

    def _on_worker_death(self, i: int, why: str) -> None:
        if not self.monitor.instances[i].alive and self.handles[i] is None:
            return
        log.warning("instance %d died (%s); re-running its requests elsewhere", i, why)
        if not self.monitor.instances[i].alive:
            self.unready_deaths[i] += 1
        self.num_failures += 1
        if self.pressure is not None:  # KunServe Sec. 4.4: its pipeline group dissolves
            self.pressure.on_failure(i, self.now())
        lost = self.monitor.on_failure(i)
        if self.splitter is not None:
            self.splitter.on_failure(i)
        self.handles[i].join(1)
        self.handles[i] = None
        self.generation[i] += 1
        affected = [t for t in self.requests.values()
                    if t.rid in lost or t.instance == i
                    or (t.handoff is not None and i in (t.handoff.src, t.handoff.dst))]
        for t in affected:  # a move touching the dead instance ends as its machine says (it may stay)
            if not self.on_instance_failed(t, i, self.now()):
                self.failover(t)
        if self.unready_deaths[i] >= START_ATTEMPTS:  # it cannot start (its error is in the log above)
            log.error("instance %d died %d times before it was ready; not restarting it", i, self.unready_deaths[i])
            if not self._ready.is_set():  # the cluster is starting: start() fails with this
                self.dead = EngineDeadError(f"instance {i} died {self.unready_deaths[i]} times before it was ready "
                                            f"({why}); its error is in the log above")
                self._ready.set()
        elif self.cluster.restart and not self._stop.is_set():
            self.handles[i] = self.backend.start(self._worker_config(i))
            self.num_restarts += 1


__all__ = ["START_ATTEMPTS", "FailoverFront"]
