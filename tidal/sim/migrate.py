"""``tidal sim --kv-pressure migrate``: the Llumnix-like baseline (KunServe Sec. 2.3, Fig. 3c).

At a throttled instance's step end, :class:`tidal.cluster.pressure.MigrationController` picks
decoding requests (what the runtime's workers can move: past their prefill, a token sampled; their
blocks counted as the runtime's coordinator counts them) to move with their KV to the instances
with the most room. Each moves as a
prefill-to-decode hand-off does in :mod:`tidal.sim.simulator`: the destination allocates its
blocks at once and holds it paused, the source pauses it (it stalls), its KV goes in chunks
(``latency + bytes / bandwidth`` each) one after the other on the source's link; on landing the
source frees it and the destination resumes it. Only an instance's own step end starts its
migrations, so no request is taken out of a step in flight. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.moves import (
    NO_DEADLINES,
    Command,
    FailOver,
    FreeSource,
    Move,
    MoveKind,
    MoveRecord,
    Pause,
    Phase,
    Release,
    Reserve,
    Resume,
    SendChunk,
    moved_request,
)
from tidal.cluster.pressure import Migration, MigrationController
from tidal.core.scheduler import RequestRejected
from tidal.sim.loop import Event
from tidal.sim.pressure import Call, LinkQueue, PressureHandler, kv_chunk_bytes

if TYPE_CHECKING:
    from tidal.sim.instance import SimInstance
    from tidal.sim.simulator import ClusterSimulator


def movable_requests(inst: SimInstance) -> list[Any]:
    """What the runtime may move off ``inst`` (its worker's ``is_movable``: decoding, a token sampled);
    each needs what the runtime's coordinator counts: its tokens and the next one's slot."""
    return [r for r in inst.scheduler.running if r.output_token_ids and not r.in_prefill]


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
        self.moves: dict[str, Move] = {}  # the moves in flight, by request
        self.shared: dict[str, int] = {}  # of a move's blocks, those its destination's cache holds (planned)

    def after_step(self, inst: SimInstance, now: float) -> list[Event]:
        self.watch(now)
        assert self.sim is not None
        if inst.index not in self._hot:
            return []
        bs = inst.kv.block_size
        movable = movable_requests(inst)
        running = {inst.index: [(r.request_id, handoff_blocks(r.num_tokens, bs)) for r in movable]}
        out: list[Event] = []
        names = None
        if self.sim.dispatcher.router.uses_cache:  # tidal's extension: prefer where the prompt's prefix is
            self.sim._sync_cache_views()
            names = {r.request_id: tuple(inst.kv.hashes(r, r.num_prompt_tokens // bs * bs)) for r in movable}
        for m in self.ctl.decide(now, running, dict(enumerate(self.leaving)), dict(enumerate(self.incoming)),
                                 names=names):
            self.shared[m.request_id] = m.shared
            ev = self._start(m, now)
            if ev is not None:
                out.append(ev)
        return out

    def _start(self, m: Migration, now: float) -> Event | None:
        """Drive one move of the pure machine (:class:`tidal.cluster.moves.Move`), the one the
        runtime's moves follow too: reserve on the destination, pause the source, send the chunks."""
        assert self.sim is not None
        req = self.sim.instances[m.src].scheduler.requests[m.request_id]
        chunks = kv_chunk_bytes(self.cfg, (0, self.cfg.model.num_layers), req.num_computed_tokens)
        move = Move(m.request_id, MoveKind.MIGRATE, m.src, m.blocks, len(chunks), dst=m.dst,
                    deadlines=NO_DEADLINES)
        self.moves[m.request_id] = move
        return self._run(move, move.start(now), now, chunks)

    def _run(self, move: Move, cmds: list[Command], now: float, chunks: list[int] | None = None) -> Event | None:
        """Carry out the machine's commands; feed back what they cause at once (a reservation's
        answer, the source freed). Returns the landing of the chunks sent, if any."""
        assert self.sim is not None
        sim, rid = self.sim, move.request_id
        event: Event | None = None
        sent: list[int] = []
        while cmds:
            c = cmds.pop(0)
            if isinstance(c, Reserve):
                src, dst = sim.instances[move.src], sim.instances[c.dst]
                req = src.scheduler.requests[rid]
                try:  # the destination shares what its prefix cache holds of the KV (the engine's import)
                    reused = dst.scheduler.add_imported(moved_request(req, with_kv=True), reuse_cached=True)
                except RequestRejected:
                    reused = None
                ok = reused is not None
                if ok:
                    dst.scheduler.pause(rid)  # its blocks are held until the KV lands
                    if reused:  # it reads only the chunks reaching past the shared prefix
                        assert chunks is not None
                        chunks[:] = kv_chunk_bytes(self.cfg, (0, self.cfg.model.num_layers), req.num_computed_tokens,
                                                   reused)
                        move.num_chunks = len(chunks)
                cmds += move.reserved(c.dst, now) if ok else move.refused(c.dst, now)
            elif isinstance(c, Pause):
                sim.instances[c.instance].scheduler.pause(rid)
                self.leaving[move.src] += move.blocks
                self.incoming[move.dst] += move.blocks - self.shared.get(rid, 0)
            elif isinstance(c, SendChunk):
                sent.append(c.index)
            elif isinstance(c, FreeSource):
                sim.instances[c.instance].scheduler.abort_requests([rid], now)  # its KV is on dst now
                cmds += move.source_freed(now)
            elif isinstance(c, Resume):
                sim.instances[c.instance].scheduler.resume(rid)
            elif isinstance(c, Release):  # the destination's paused copy goes
                sim.instances[c.instance].scheduler.abort_requests([rid], now)
            elif isinstance(c, FailOver):  # its source died: recompute it elsewhere from its tokens so far
                event = sim.failover(sim.instances[move.src].scheduler.requests[rid], now)
            else:  # the simulator has no deadlines to miss: nothing else is asked
                raise AssertionError(f"unexpected move command {c!r}")
        if sent:
            assert chunks is not None
            end = self.links.send(move.src, now, [chunks[k] for k in sent])
            self.moved_bytes += sum(chunks[k] for k in sent)
            self.stall_s += end - now
            event = Call(end, lambda t, move=move, sent=tuple(sent): self._land(move, sent, t))
        if move.over:
            self.moves.pop(rid, None)
            sim.move_records.append(MoveRecord.of(move))
            shared = self.shared.pop(rid, 0)
            if move.paused:  # its blocks no longer leave nor come
                self.leaving[move.src] -= move.blocks
                self.incoming[move.dst] -= move.blocks - shared
        return event

    def _land(self, move: Move, sent: tuple[int, ...], now: float) -> list[Event]:
        assert self.sim is not None
        sim = self.sim
        if move.over:  # it ended meanwhile (an instance failed): nothing lands
            return []
        cmds: list[Command] = []
        for k in sent:
            cmds += move.chunk_landed(k, now)
        landed = move.phase is Phase.LANDED
        self._run(move, cmds, now)
        assert landed and move.phase is Phase.DONE and move.dst is not None
        sim.monitor.on_move(move.request_id, move.src, move.dst)
        self.moved += 1
        src, dst = sim.instances[move.src], sim.instances[move.dst]
        return [e for e in (sim._wake(dst, now), sim._wake(src, now)) if e is not None]

    def on_failure(self, index: int, request_id: str, now: float) -> list[Event] | None:
        """A move of ``request_id`` touching dead ``index`` ends as the machine says: it stays on its
        source (the destination died) or is recomputed elsewhere (the source died)."""
        move = self.moves.get(request_id)
        if move is None or index not in (move.src, move.dst):
            return None
        assert self.sim is not None
        sim, ends = self.sim, [self._run(move, move.failed(index, now), now)]
        assert move.over
        ends += [sim._wake(sim.instances[i], now) for i in (move.src, move.dst) if i != index and i is not None]
        return [e for e in ends if e is not None]

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update({"migrated": self.moved, "migrated_bytes": self.moved_bytes,
                    "mean_stall_ms": 1000 * self.stall_s / self.moved if self.moved else None})
        return out


__all__ = ["MigrateHandler", "movable_requests"]
