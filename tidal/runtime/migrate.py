"""``--kv-pressure migrate`` in the real cluster: the Llumnix-like baseline (KunServe Sec. 2.3, Fig. 3c).

After each instance report the pure :class:`~tidal.cluster.pressure.MigrationController` reads
the global monitor and names running requests to move, with their KV, from a throttled instance
to the one with the most room (the simulator's :mod:`tidal.sim.migrate` asks the same question).
A move is the prefill-to-decode hand-off path, run mid-decode:

1. the front end reserves the request's blocks on the destination (the monitor counts them) and
   sends the source ``migrate``;
2. the source worker pauses the request (it stalls; the others run on), says ``handoff`` with its
   snapshot and puts its KV in chunks between its steps;
3. the front end forwards snapshot and chunks to the destination, which imports the request
   paused, writes the chunks and resumes it after the last (``landed``); the source frees it
   after its last chunk. Nothing recomputes.

A destination that refuses (its last report was stale) or dies, or a source that can no longer
move the request (``unmoved``: it finished or was preempted meanwhile), ends the move: the request
stays where it is, or, once its KV has left, is re-run from its streamed tokens (recompute).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.pressure import MigrationController
from tidal.runtime.front import Front
from tidal.runtime.pressure import PressureLog
from tidal.runtime.protocol import Migrate


class MigrateCoordinator(PressureLog):
    def __init__(self, llm: Front):
        super().__init__()
        self.llm = llm
        self.ctl: MigrationController | None = None  # the monitor exists once the front end is built
        self.moving: dict[str, tuple[int, int, int]] = {}  # worker id -> (src, dst, blocks)
        self.num_migrated = 0
        self.num_failed = 0  # refused or cut by a failure: re-run (recompute) or left in place

    # ---------------------------------------------------------------- deciding (under the front end's lock)
    def tick(self, now: float) -> None:
        llm = self.llm
        if not llm.ready:
            return
        if self.ctl is None:
            self.ctl = MigrationController(llm.monitor, recorder=self._record)
        running: dict[int, list[tuple[str, int]]] = {}
        for t in llm.requests.values():  # decoding requests that can move: one sequence, not moving already
            if t.instance >= 0 and t.handoff is None and t.tokens and t.params.n == 1 and t.wid not in self.moving:
                bs = llm.monitor.instances[t.instance].block_size
                running.setdefault(t.instance, []).append((t.wid, handoff_blocks(len(t.prompt_ids) + len(t.tokens), bs)))
        leaving: Counter[int] = Counter()
        incoming: Counter[int] = Counter()
        for src, dst, blocks in self.moving.values():
            leaving[src] += blocks
            incoming[dst] += blocks
        for m in self.ctl.decide(now, running, leaving, incoming):
            t = llm.by_wid[m.request_id]
            self.moving[m.request_id] = (m.src, m.dst, m.blocks)
            llm.monitor.on_handoff_start(t.rid, m.dst, m.blocks)  # reserved there until it lands or fails
            llm.send(m.src, Migrate(m.request_id))

    def target(self, wid: str) -> int | None:
        """Where a hand-off of ``wid`` goes when it is a migration (else None: the dispatcher picks)."""
        move = self.moving.get(wid)
        return None if move is None else move[1]

    # ---------------------------------------------------------------- outcomes
    def on_landed(self, t: Any, dst: int) -> None:
        src, _, _ = self.moving.pop(t.wid)
        mon = self.llm.monitor
        mon.on_reservation_end(t.rid, dst)
        mon.on_move(t.rid, src, dst)
        self.num_migrated += 1

    def forget(self, t: Any) -> bool:
        """``t`` ended (finished, aborted, re-run) or its move did: release its reservation."""
        move = self.moving.pop(t.wid, None)
        if move is not None:
            self.llm.monitor.on_reservation_end(t.rid, move[1])
        return move is not None

    def on_unmoved(self, t: Any) -> None:
        """The source could not start the move (the request finished, or waits preempted): it stays."""
        if self.forget(t):
            self.num_failed += 1

    def on_refused(self, t: Any, dst: int) -> None:
        """The destination had no room after all: the KV is leaving (or left) the source, so the
        request is re-run from its streamed tokens where the router sends it."""
        self.forget(t)
        self.num_failed += 1
        self.llm.recompute(t, t.handoff.src)

    def on_failure(self, i: int, now: float) -> None:
        """Instance ``i`` died: moves into it are void. A request whose KV had not left its source
        stays there; one already handed off is re-run by the front end (its hand-off touches ``i``)."""
        llm = self.llm
        for wid, (src, dst, _) in list(self.moving.items()):
            t = llm.by_wid.get(wid)
            if dst != i or t is None:
                continue
            self.forget(t)
            self.num_failed += 1
            if t.handoff is None:
                llm.recompute(t, src)  # the source may already be exporting it: aborted there

    def snapshot(self) -> dict[str, Any]:
        return {"mode": "migrate", "moving": len(self.moving), "migrated": self.num_migrated,
                "failed": self.num_failed, "dropped_layers": {}, "layers": {}, "groups": [],
                "events_total": dict(self.counts), "events": list(self.events[-32:])}


__all__ = ["MigrateCoordinator"]
