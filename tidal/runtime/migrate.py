"""``--kv-pressure migrate`` in the real cluster: the Llumnix-like baseline (KunServe Sec. 2.3, Fig. 3c).

After each instance report the pure :class:`~tidal.cluster.pressure.MigrationController` reads
the global monitor and names running requests to move, with their KV, from a throttled instance
to the one with the most room (the simulator's :mod:`tidal.sim.migrate` asks the same question).
Each move is a :class:`tidal.cluster.moves.Move` of kind ``migrate`` (the machine the simulator's
migrations run through), driven by the front end (:mod:`tidal.runtime.handoffs`):

1. the front end reserves the request's blocks on the destination (the monitor counts them) and
   sends the source ``migrate``;
2. the source worker pauses the request (it stalls; the others run on), says ``handoff`` with its
   snapshot and puts its KV in chunks between its steps;
3. the front end forwards snapshot and chunks to the destination, which imports the request
   paused, writes the chunks and resumes it after the last (``landed``); the source frees it
   after its last chunk. Nothing recomputes.

A destination that refuses (its last report was stale) or dies, or a source that can no longer
move the request (``unmoved``: it finished or was preempted meanwhile), ends the move as the
machine says: the request stays where it is (``stay``) while its source holds it, else it is re-run
from its streamed tokens (recompute). This coordinator only decides and counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.moves import Move, MoveKind, Phase
from tidal.cluster.pressure import MigrationController
from tidal.core.block_hash import block_hashes
from tidal.runtime.front import Front
from tidal.runtime.pressure import PressureLog


class MigrateCoordinator(PressureLog):
    def __init__(self, llm: Front):
        super().__init__()
        self.llm = llm
        self.ctl: MigrationController | None = None  # the monitor exists once the front end is built
        self.moving: dict[str, tuple[int, int, int, int]] = {}  # worker id -> (src, dst, blocks, blocks on dst)
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
        names: dict[str, tuple[bytes, ...]] | None = {} if llm.cache_routing else None
        for t in llm.requests.values():  # decoding requests that can move: one sequence, not moving already
            if t.instance >= 0 and t.handoff is None and t.tokens and t.params.n == 1 and t.wid not in self.moving:
                bs = llm.monitor.instances[t.instance].block_size
                running.setdefault(t.instance, []).append((t.wid, handoff_blocks(len(t.prompt_ids) + len(t.tokens), bs)))
                if names is not None:  # tidal's extension: prefer where the prompt's prefix is cached
                    names[t.wid] = tuple(block_hashes(t.prompt_ids, bs, t.params.cache_salt))
        leaving: Counter[int] = Counter()
        incoming: Counter[int] = Counter()
        for src, dst, blocks, dst_blocks in self.moving.values():
            leaving[src] += blocks
            incoming[dst] += dst_blocks
        for m in self.ctl.decide(now, running, leaving, incoming, names=names):
            t = llm.by_wid[m.request_id]
            self.moving[m.request_id] = (m.src, m.dst, m.blocks, m.dst_blocks)
            # the move machine reserves on m.dst what it needs there (the monitor counts it) and starts the source
            llm.begin_move(t, MoveKind.MIGRATE, m.src, m.dst_blocks, dst=m.dst)

    # ---------------------------------------------------------------- outcomes
    def on_move_end(self, t: Any, move: Move) -> None:
        """``t``'s migration ended: landed (``done``), or not (it stayed, was re-run, or ended)."""
        if self.moving.pop(move.request_id, None) is None:
            return
        if move.phase is Phase.DONE:
            self.num_migrated += 1
        else:
            self.num_failed += 1

    def snapshot(self) -> dict[str, Any]:
        return {"mode": "migrate", "moving": len(self.moving), "migrated": self.num_migrated,
                "failed": self.num_failed, "dropped_layers": {}, "layers": {}, "groups": [],
                "events_total": dict(self.counts), "events": list(self.events[-32:])}


__all__ = ["MigrateCoordinator"]
