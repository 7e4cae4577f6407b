"""The front end's side of moving a request between workers with its KV: a prefill-to-decode
hand-off (BucketServe's disaggregation), a migration (``--kv-pressure migrate``) and a DynaServe
split's beta part (``--mode split``). Each is a :class:`~tidal.cluster.moves.Move`, the pure
machine the simulator drives too: this mixin feeds it the workers' replies and carries out the
commands it returns.

How the machine's commands are carried out here (the protocol's messages in brackets):

- ``Pause``: a migration's source is told to start (``Migrate``); a prefill worker pauses a
  request itself at its first token and a split's alpha at its split point (its ``Add`` said
  where), so for those there is nothing to send;
- ``Reserve``: the dispatcher's decode pick (a hand-off), or the reservation on the destination
  the coordinator chose (a migration; a split's beta gets ``Reserve``); the monitor counts it.
  A destination that cannot hold the copy answers ``Refused`` later. A hand-off while no decode
  instance is alive is ``unplaceable``: the request stays on its prefill instance (``Stay``), which
  decodes it to its end (P/D degrades to colocated while the decode role is down);
- ``SendChunk``: the snapshot (``Import``) and the chunks the source put (``KVChunk``) go on to
  the destination, now and as they come; the destination resumes the request after the last one
  and says ``Landed``;
- ``Resume`` of the source (the move fell back while the source still holds the request): ``Stay``;
  ``Release``/``FreeSource``: ``Abort`` there; ``FailOver``: re-run from prompt + streamed tokens.

The source frees a request itself after its last chunk (a ``KVChunk`` with ``last``, or a split's
``SplitDone``): that is the machine's ``source_freed``. Every step has a deadline (the cluster
config's ``move_timeout_s``), checked on every turn of the I/O loop: a move never hangs. A mixin
of :class:`~tidal.runtime.cluster.ClusterLLM`: every method runs under its lock."""

from __future__ import annotations

from collections import deque
from typing import Any

from tidal.cluster.moves import (
    Command,
    FailOver,
    FreeSource,
    Move,
    MoveDeadlines,
    MoveKind,
    MoveRecord,
    Pause,
    Phase,
    Release,
    Reserve,
    Resume,
    Retry,
    SendChunk,
)
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
    move_deadlines: MoveDeadlines
    moves_ended: dict[str, int]  # by how each ended (done / stayed / failed_over / dropped), for the stats
    move_records: deque[MoveRecord]  # the latest moves as they ended (the same-decision tests read them)

    def send(self, i: int, cmd: Any) -> None: ...
    def now(self) -> float: ...
    def failover(self, t: Tracked) -> None: ...

    # ---------------------------------------------------------------- driving the machine
    def begin_move(self, t: Tracked, kind: MoveKind, src: int, blocks: int, num_chunks: int = 0,
                   dst: int | None = None, meta: Any = None, split: int | None = None, started: bool = False) -> None:
        """Start moving ``t`` from ``src`` (``dst`` known for a migration and a split)."""
        move = Move(t.wid, kind, src, blocks, num_chunks, dst=dst, deadlines=self.move_deadlines)
        t.handoff = Handoff(move, meta, split=split, started=started)
        self.carry_out(t, move.start(self.now()))

    def carry_out(self, t: Tracked, cmds: list[Command]) -> None:
        """Do what the machine says, feeding back what that causes at once; end the move when it
        is over."""
        h = t.handoff
        if h is None:
            return
        todo = list(cmds)
        while todo and t.handoff is h:
            todo += self._command(t, h, todo.pop(0))
        if h.move.over and not h.ended:
            self._ended(t, h)

    def _command(self, t: Tracked, h: Handoff, c: Command) -> list[Command]:
        move, now = h.move, self.now()
        if isinstance(c, Pause):
            if move.kind is MoveKind.MIGRATE:
                self.send(c.instance, P.Migrate(t.wid))
                h.told = True
            return []  # a prefill worker and an alpha part pause themselves
        if isinstance(c, Reserve):
            if c.dst is None:  # a hand-off: the dispatcher's decode instance (it records the reservation)
                if not self.dispatcher.can_hand_off():  # every decode instance is down: it decodes where it is
                    self.monitor.on_handoff_cancel(t.rid)
                    return move.unplaceable(now)
                dst = self.dispatcher.choose_decode(t.rid, c.blocks, now)
                if dst is None:
                    return []  # waits (the monitor shows it), asked again on the next report
                h.forwarded, h.imported = 0, False  # a new destination: everything goes to it
                return move.reserved(dst, now)
            self.monitor.on_handoff_start(t.rid, c.dst, c.blocks)
            h.forwarded, h.imported = 0, False
            if move.kind is MoveKind.SPLIT:
                self.send(c.dst, P.Reserve(t.wid, t.prompt_ids, t.params, t.priority, t.request_class, h.split))
            return move.reserved(c.dst, now)  # a refusal comes back as ``Refused``
        if isinstance(c, SendChunk):
            self._forward(t, h)
            return []
        if isinstance(c, Resume):
            if c.instance == move.src and (h.started or h.told):  # fell back: the source keeps it (even one
                self.send(c.instance, P.Stay(t.wid))  # that has not started yet, but will: its destination died)
            return []  # a destination resumes the request itself after its last chunk
        if isinstance(c, Release):
            if h.imported or h.split is not None:  # it holds a copy (or a split's reservation)
                self.send(c.instance, P.Abort(t.wid))
            self.monitor.on_reservation_end(t.rid, c.instance)
            return []
        if isinstance(c, FreeSource):
            self.send(c.instance, P.Abort(t.wid))
            self.monitor.on_finish(c.instance, t.rid)
            return move.source_freed(now)
        if isinstance(c, FailOver):
            self.failover(t)  # ends the move (drop_handoff)
            return []
        assert isinstance(c, Retry)
        return []  # a hand-off asks again at the next report (``tick_moves``)

    def _forward(self, t: Tracked, h: Handoff) -> None:
        """The snapshot and every chunk not yet sent go to the destination."""
        dst = h.move.dst
        if dst is None or h.move.phase is not Phase.SENDING:
            return
        if not h.imported and h.meta is not None:
            self.send(dst, P.Import(h.meta, True))
            h.imported = True
        if not h.imported and h.split is None:
            return  # a migration whose source has not started yet
        for k in range(h.forwarded, len(h.handles)):
            self.send(dst, P.KVChunk(t.wid, h.handles[k], h.last_put and k == len(h.handles) - 1))
        h.forwarded = len(h.handles)

    def _ended(self, t: Tracked, h: Handoff) -> None:
        move = h.move
        self._record_end(t, h)
        self.monitor.on_handoff_cancel(t.rid)  # no longer waiting for a decode instance, however it ended
        if move.phase is Phase.DONE:
            assert move.dst is not None
            if move.kind is MoveKind.MIGRATE:
                self.monitor.on_reservation_end(t.rid, move.dst)
                self.monitor.on_move(t.rid, move.src, move.dst)
            else:
                self.monitor.on_handoff(t.rid, move.src, move.dst, ok=True)
            h.handles.clear()  # the destination released the chunks it read
            t.instance, t.handoff = move.dst, None
        elif move.phase is Phase.STAYED:
            self._release_handoff(t)
            t.instance, t.handoff = move.src, None
            if move.kind is MoveKind.SPLIT and t.split_log is not None:
                t.split_log["whole_on"] = move.src
        # FAILED_OVER: ``failover`` already let the move go

    def tick_moves(self, now: float) -> None:
        """Every move past its step's deadline falls back; waiting hand-offs ask again."""
        for t in list(self.requests.values()):
            h = t.handoff
            if h is None:
                continue
            self.carry_out(t, h.move.tick(now))
            if t.handoff is h and h.move.phase is Phase.RESERVING and h.move.kind is MoveKind.HANDOFF:
                self.carry_out(t, [Reserve(h.move.blocks)])

    def _record_end(self, t: Tracked, h: Handoff) -> None:
        """The move ended (or was dropped unfinished): recorded, counted, and its coordinator told."""
        h.ended = True
        self.record_moves([MoveRecord.of(h.move, t.rid)])
        if self.pressure is not None and h.move.kind is MoveKind.MIGRATE:
            self.pressure.on_move_end(t, h.move)

    def record_moves(self, records: Any) -> None:
        """Moves that ended, here or on a worker (a KunServe group's head runs its exchange's moves)."""
        for rec in records:
            self.move_records.append(rec)
            self.moves_ended[rec.outcome] = self.moves_ended.get(rec.outcome, 0) + 1

    def drop_handoff(self, t: Tracked) -> None:
        """End ``t``'s move from outside the machine (the request finished, was aborted or is
        re-run): its reservation on the destination goes, and the chunks in flight."""
        h = t.handoff
        if h is None:
            return
        self.monitor.on_handoff_cancel(t.rid)  # it may have waited for a decode instance
        if not h.move.over:
            if h.move.dst is not None:
                self.monitor.on_reservation_end(t.rid, h.move.dst)
            self._record_end(t, h)
        self._release_handoff(t)
        t.handoff = None

    def _release_handoff(self, t: Tracked) -> None:
        if t.handoff is not None:
            for handle in t.handoff.handles:
                self.transport.release(handle)
            t.handoff.handles.clear()

    # ---------------------------------------------------------------- replies
    def _on_handoff(self, i: int, r: P.HandoffStarted, now: float) -> None:
        """The source paused the request and its chunks follow: a prefill's hand-off begins, or a
        migration's source started."""
        t = self.by_wid.get(r.request_id)
        if t is None:
            return
        h = t.handoff
        if h is None:
            if self.monitor.instances[i].role == "prefill":  # a prefill's hand-off: the dispatcher picks the decode instance
                self.begin_move(t, MoveKind.HANDOFF, i, r.blocks, r.num_chunks, meta=r.snapshot, started=True)
            # else a migration that fell back before its source started (its destination died): the
            # ``Stay`` after it resumes the request there (its chunks are released as they come)
            return
        h.meta, h.move.num_chunks, h.started = r.snapshot, r.num_chunks, True  # a migration's source began
        self._forward(t, h)

    def _on_kv(self, i: int, r: P.KVChunk, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is None or t.handoff is None:
            self.transport.release(r.handle)  # aborted meanwhile
            if t is not None and r.last and t.instance == i:  # it stayed, but the source let it go already
                self.monitor.on_finish(i, t.rid)
                self.failover(t)
            return
        h = t.handoff
        h.handles.append(r.handle)
        h.last_put = r.last  # after its last chunk the source freed the request
        self.kv_bytes_moved += r.handle.nbytes
        if t.split_log is not None:
            t.split_log["kv_bytes"] += r.handle.nbytes
        self._forward(t, h)
        if r.last:
            self.carry_out(t, h.move.source_freed(now))

    def _on_split_done(self, i: int, r: P.SplitDone, now: float) -> None:
        self.split.on_split_done(i, r.request_id, r.tokens, r.last_token_time)

    def _on_landed(self, i: int, r: P.Landed, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is not None and t.handoff is not None and t.handoff.move.dst == i:
            self.carry_out(t, t.handoff.move.all_landed(now))

    def _on_refused(self, i: int, r: P.Refused, now: float) -> None:
        t = self.by_wid.get(r.request_id)
        if t is None:
            return
        h = t.handoff
        if h is not None and h.move.dst == i:  # the destination cannot hold the copy, or read its KV
            self.monitor.on_reservation_end(t.rid, i)
            if r.kv_lost:  # the same chunks would fail the same way anywhere: the move cannot finish
                self.carry_out(t, h.move.lost(now))
            else:
                self.carry_out(t, h.move.refused(i, now))  # a hand-off's chunks wait for the next destination
        elif h is None:  # a fail-over's import found no room here, or a source told to keep a request it let go
            self.monitor.on_finish(i, t.rid)
            self.failover(t)

    def _on_unmoved(self, i: int, r: P.Unmoved, now: float) -> None:
        """A migration's source could not start (the request finished, or waits preempted): it stays."""
        t = self.by_wid.get(r.request_id)
        if t is not None and t.handoff is not None:
            t.handoff.told = False  # it did not start, and will not
            self.carry_out(t, t.handoff.move.refused(None, now))

    def on_instance_failed(self, t: Tracked, i: int, now: float) -> bool:
        """Instance ``i`` died under ``t``'s move: the machine says whether the request stays on its
        source, lands, or is re-run. Returns False when ``t`` has no move touching ``i``."""
        h = t.handoff
        if h is None or i not in (h.move.src, h.move.dst):
            return False
        if h.move.dst == i and not h.move.over:
            self.monitor.on_reservation_end(t.rid, i)
        self.carry_out(t, h.move.failed(i, now))
        return True


__all__ = ["HandoffFront"]
