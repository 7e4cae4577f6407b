"""KunServe pipeline groups of n >= 2 workers: forming one, the activation path, the KV exchange,
the restore.

The front end's ``group`` command (one Fig. 6 merge, KunServe Sec. 4.1) goes to every member of
the new group with its :class:`GroupSpec`: the members in stage order and the layers each keeps.
The first member is the *head*: it keeps the scheduler, every request of the group, the embedding,
the LM head and the first stage's layers. Every other member is a *stage* (:class:`GroupTail`): it
runs its layers on the head's hidden states over a mirror of the head's KV pool (the head's block
ids). The head has one link to each stage (:mod:`tidal.runtime.peer`); stages never talk to each
other. KV goes through the KV transport (shared memory): only its handles cross the links.

Forming a group (Sec. 4.2's coordinated exchange), from instances that ran alone, groups that
merge (Fig. 6 merges groups, not only instances), or both:

0. A member that heads a group *collapses* it first: its stages send back their layers' KV of its
   running requests and are released (``handover``); they join the new group without requests.
1. Every member but the head: its requests move to the head (snapshots). Each one's KV is cut
   by the layers the new members keep: what this member keeps stays here as a local copy, the
   rest goes into chunks addressed to their owners. It drops the layers it no longer keeps (and
   loads any it now needs, from its host copy), then says ``hello`` (its pool, the snapshots,
   the chunk handles).
2. The head: its running requests pause; their KV of the other members' layers is exported
   (queued as chunks); it drops those layers. On every ``hello`` the pools take the smallest
   block count (``pool``); the moved requests are imported paused; chunks of the head's layers
   are written here, the others queued to their owners, and each member that kept a local copy
   is told where to write it (``place``). From then on the head runs its steps through a
   :class:`~tidal.runtime.peer.HubStageLink` and writes one queued chunk per loop turn, between
   steps, so an activation never waits behind the exchange. A request resumes when every member
   that had its KV to write answered ``ok``; others run meanwhile; nothing recomputes. Each running
   request's part is a move of the one machine (:mod:`tidal.cluster.moves`, kind ``exchange``, as
   in the simulator): the head's own from the head to the group, a member's from it to the head (a
   queued one comes with no KV: no move); ``exchange_done`` brings their records to the front end.

Restore (Sec. 4.4) gathers the group on its head while it keeps serving: every stage sends back
its layers' KV, the head stages its dropped layers one per loop turn, then reloads them and runs
alone; the stages reload theirs. The head's pool must hold all of the group's KV, so a group of
n > 2 waits until the KV in use fits one instance's pool (for n = 2 the paper's 50 % rule already
ensures it); a restore that does not fit is refused and decided again later. The paper, and the
simulator (:mod:`tidal.sim.kunserve`), spread the requests over the members instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from tidal.cluster.moves import (
    NO_DEADLINES,
    FailOver,
    Move,
    MoveKind,
    MoveRecord,
    Release,
    Reserve,
    Resume,
    SendChunk,
)
from tidal.engine.stage import TailStage, microbatch_cost
from tidal.runtime.kv_transfer import iter_chunks
from tidal.runtime.peer import PEER_TIMEOUT_S, WATCH_S, HubStageLink, PeerLink, PeerLost
from tidal.runtime.protocol import ExchangeDone

log = logging.getLogger("tidal.worker")
KV = dict[int, tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """A pipeline group to form: ``members`` in stage order (the head first), the decoder layers
    ``[start, end)`` each keeps, the address of each stage's link (the head binds it) and each
    member's pid (a local worker's, watched by its peers; None: only timeouts)."""

    members: tuple[int, ...]
    layers: Mapping[int, tuple[int, int]]
    addresses: Mapping[int, str]
    pids: Mapping[int, int | None]

    @property
    def head(self) -> int:
        return self.members[0]

    @property
    def stages(self) -> tuple[int, ...]:
        return self.members[1:]

    def keeps(self, member: int) -> set[int]:
        return set(range(*self.layers[member]))

    def split(self, kv: KV) -> dict[int, KV]:
        """``kv`` cut by the member that keeps each layer."""
        out: dict[int, KV] = {}
        for m in self.members:
            lo, hi = self.layers[m]
            part = {layer: x for layer, x in kv.items() if lo <= layer < hi}
            if part:
                out[m] = part
        return out


# KV a head hands its stages per loop turn during an exchange (Sec. 4.2). The chunks are in shared
# memory already; a stage copies them in between its steps at memory speed (a few ms for this much),
# so an activation waits that long at most behind them. One chunk a turn paced the exchange by the
# group's steps (a recorded pair of CPU workers exchanged for 13.3 s, its requests paused throughout).
EXCHANGE_TURN_BYTES = 32 * 1024 * 1024


def _running_with_kv(engine: Any) -> list[tuple[str, int]]:
    """The running requests that hold computed KV (those a regroup or restore must carry over),
    with their tokens of KV."""
    return list(engine.transfer.running_with_kv().items())


def _release_all(transport: Any, handles: dict[str, list]) -> None:
    for hs in handles.values():
        for h in hs:
            transport.release(h)


def _relayer(engine: Any, keep: set[int]) -> int:
    """Hold exactly the decoder layers ``keep``: drop the others (the pool grows by their bytes,
    Sec. 4.1's local memory manager) and load the missing ones from the host copy. Returns the
    pool's block count."""
    present = set(engine.transfer.layer_ids)
    if present - keep:
        engine.drop_layers(sorted(present - keep))
    if keep - present:
        engine.restore_layers(sorted(keep - present))
    return engine.transfer.num_blocks


def _put(worker: Any, kv: KV, num_tokens: int) -> list:
    return [worker.transport.put(part, spec)
            for spec, part in iter_chunks(kv, 0, num_tokens, worker.cfg.layers_per_chunk)]


class GroupHead:
    """The head's side: built by the ``group`` command, pumped once per worker loop turn."""

    def __init__(self, worker: Any, spec: GroupSpec, pieces: dict[str, KV]):
        e = worker.engine
        self.worker, self.engine, self.spec = worker, e, spec
        self.links = {m: PeerLink(worker.ctx, spec.addresses[m], bind=True, peer_pid=spec.pids.get(m))
                      for m in spec.stages}
        try:  # a member dying meanwhile: the links close (and queued chunks go) before the worker restores alone
            self._form(pieces)
        except BaseException:
            for item in getattr(self, "queue", ()):
                worker.transport.release(item[2])
            self.close()
            raise

    def _form(self, pieces: dict[str, KV]) -> None:
        worker, e, spec = self.worker, self.engine, self.spec
        self.queue: deque[tuple[int, str, Any, bool]] = deque()  # (member, request, handle, last), one per turn
        self.moves: dict[str, Move] = {}  # the paused requests still waiting for a member's ``ok``
        self.records: list[MoveRecord] = []  # the moves that ended, for the front end (``ExchangeDone``)
        self.moved: list[str] = []
        keep = spec.keeps(spec.head)
        # Sec. 4.2: every running request pauses; its KV of the other members' layers leaves before the drop
        own = {}
        for rid, n in _running_with_kv(e):
            e.pause_request(rid)
            gone = [layer for layer in e.transfer.layer_ids if layer not in keep]
            kv = e.export_kv(rid, gone, 0, n) if gone else {}
            own[rid] = (n, {**kv, **pieces.get(rid, {})})
        n_head = _relayer(e, keep)
        hellos = {m: self.links[m].wait_for("hello")[0] for m in spec.stages}
        self.num_blocks = min([n_head] + [h[1] for h in hellos.values()])
        e.resize_pool(self.num_blocks)
        for link in self.links.values():
            link.send(("pool", self.num_blocks))
        cost, source = microbatch_cost(e.arch, e.config.scheduler.microbatch_cost)
        log.info("group head %d: microbatch split with %s Eq. 1 coefficients (alpha %.4g, beta %.4g, gamma %.4g)",
                 worker.cfg.index, source, cost.alpha, cost.beta, cost.gamma)
        e.set_stage_link(HubStageLink([self.links[m] for m in spec.stages]), cost, min_tokens=worker.cfg.mb_min_tokens)
        for rid, (n, kv) in own.items():
            parts = spec.split(kv)
            if spec.head in parts:  # layers loaded here whose KV was elsewhere (a collapsed stage's)
                e.import_kv(rid, parts.pop(spec.head), 0)
            for m, part in parts.items():
                self._queue(rid, m, _put(worker, part, n))
            self._keep(rid, len(parts))
        self.num_exchanged = len(own)  # own requests whose KV of other layers went to their members
        for m, hello in hellos.items():
            for snap, handles in hello[2]:
                self._land(m, snap, handles)
        self.reported = False
        self.restoring: _Restore | None = None
        self.restore_stats: dict[str, Any] = {}

    def _queue(self, rid: str, member: int, handles: list) -> None:
        for k, h in enumerate(handles):
            self.queue.append((member, rid, h, k == len(handles) - 1))

    def _keep(self, rid: str, members: int) -> None:
        """One of our own running requests stays here while its KV of the layers we dropped goes to
        the ``members`` that keep them: a move of the one machine from the head to the group it
        heads (kind ``exchange``, as the simulator's exchange of its first stage's requests). It is
        reserved already (its blocks are here); each member's ``ok`` lands one chunk, and the last
        resumes it."""
        head, now = self.spec.head, time.monotonic()
        move = Move(rid, MoveKind.EXCHANGE, head, 0, members, dst=head, deadlines=NO_DEADLINES)
        assert all(isinstance(c, Reserve) for c in move.start(now))
        move.reserved(head, now)  # the chunks are queued already
        self.moves[rid] = move
        self._landed_one(rid, 0)

    def _land(self, sender: int, snap: Any, handles: dict[int, list]) -> None:
        """A request that lived on ``sender`` moves here: a move of the one machine
        (:class:`tidal.cluster.moves.Move`, kind ``exchange``, as the simulator's exchange). Its
        reservation is the paused import; its chunks are our layers' KV (written now), the other
        members' (queued to them) and the sender's own part (``place``: written there at our
        block ids); each member's ``ok`` lands one, and the last resumes it. No room even now: it
        recomputes here (the sender retired it into the group)."""
        from tidal.core.scheduler import RequestRejected

        e, tr, head = self.engine, self.worker.transport, self.spec.head
        rid = snap.request_id
        self.moved.append(rid)
        if not snap.num_computed_tokens:  # it queued there: it queues here, with no KV to move (no move)
            e.import_request(snap)
            return
        others = [m for m, hs in handles.items() if m != head and hs]
        move = Move(rid, MoveKind.EXCHANGE, sender, 0, len(others) + 1, dst=head,
                    deadlines=NO_DEADLINES)  # the peer links' watch is its deadline: a lost member ungroups
        todo = move.start(time.monotonic())
        while todo:
            c = todo.pop(0)
            if isinstance(c, Reserve):
                try:
                    e.import_request(snap, paused=True)
                    todo += move.reserved(head, time.monotonic())
                except RequestRejected:
                    todo += move.refused(head, time.monotonic())
            elif isinstance(c, FailOver):  # no room even now: recompute it here instead
                _release_all(tr, handles)
                self.links[sender].send(("forget", rid))
                e.import_request(dataclasses.replace(snap, num_computed_tokens=0, kv={}))
                self.records.append(MoveRecord.of(move))
                return
            elif not isinstance(c, (Release, SendChunk)):  # the chunks go below, the refused copy is none
                raise AssertionError(f"unexpected move command {c!r}")
        for h in handles.get(head, []):
            e.import_kv(rid, tr.get(h), h.spec.start)
            tr.release(h)
        for m in others:
            self._queue(rid, m, handles[m])
        self.links[sender].send(("place", rid, e.transfer.block_table(rid)))
        self.moves[rid] = move
        self._landed_one(rid, 0)

    def _landed_one(self, rid: str, n: int = 1) -> None:
        """A member wrote its part of ``rid`` (``ok``): the last one resumes it here."""
        move, now = self.moves[rid], time.monotonic()
        cmds = [c for _ in range(n) for c in move.chunk_landed(len(move.landed), now)]
        if not move.num_chunks:  # none of its KV had to move
            cmds += move.all_landed(now)
        for c in cmds:
            if isinstance(c, Resume) and self.engine.transfer.is_paused(rid):
                self.engine.resume_request(rid)
        if move.over:
            del self.moves[rid]
            self.records.append(MoveRecord.of(move))

    def forget(self, rid: str) -> None:
        """``rid`` was aborted here: its queued chunks never go (its blocks may be reused)."""
        self.moves.pop(rid, None)
        for item in [q for q in self.queue if q[1] == rid]:
            self.queue.remove(item)
            self.worker.transport.release(item[2])

    def pump(self) -> None:
        """Between steps: read the stages' answers, then hand the stages queued KV chunks, up to
        :data:`EXCHANGE_TURN_BYTES` a turn."""
        r = self.restoring
        for m, link in self.links.items():
            while (got := link.recv(0)) is not None:
                msg = got[0]
                if msg[0] == "back" and r is not None and m not in r.back:
                    r.back[m] = msg[1]
                elif msg[0] == "ok":
                    if msg[1] in self.moves:
                        self._landed_one(msg[1])
                else:
                    log.warning("head: unexpected message from stage %d: %s", m, msg[0])
        budget = EXCHANGE_TURN_BYTES  # at least one chunk a turn; the queue empties in a few turns
        while self.queue and budget > 0:
            m, rid, handle, last = self.queue.popleft()
            self.links[m].send(("kv", rid, self.engine.transfer.block_table(rid), handle, last))
            budget -= handle.nbytes
        if not self.reported and not self.moves and not self.queue:
            self.reported = True
            self.worker.send(ExchangeDone(self.spec.members, self.num_exchanged, len(self.moved), tuple(self.records)))

    @property
    def busy(self) -> bool:
        """Chunks to write now, or layers to stage for a restore (requests waiting for an ``ok``,
        or a restore for its KV, are only polled for)."""
        r = self.restoring
        return bool(self.queue) or (r is not None and len(r.staged) < len(r.layers))

    def release_pending(self) -> None:
        """The group ends without a restore (a member died, or this worker shuts down): release
        the KV chunks the stages sent back that are still here (a restore's answers, read or
        waiting on the links)."""
        tr = self.worker.transport
        answers = list(self.restoring.back.values()) if self.restoring is not None else []
        self.restoring = None
        with contextlib.suppress(Exception):  # a member is gone: read what the others sent, no more
            for link in self.links.values():
                while (got := link.recv(0)) is not None:
                    if got[0][0] == "back":
                        answers.append(got[0][1])
        for back in answers:
            _release_all(tr, back)

    def close(self, linger_ms: int = 0) -> None:
        for link in self.links.values():
            link.close(linger_ms)

    def collapse(self) -> dict[str, KV]:
        """This group merges into a bigger one (Fig. 6 merges groups): every stage sends back its
        layers' KV of the running requests (all their tokens) and is released to join the new
        group; this worker runs no pipeline meanwhile. Returns request -> that KV."""
        e, tr = self.engine, self.worker.transport
        if self.queue or self.moves or self.restoring is not None:
            raise RuntimeError("a group merges only once its exchange is done and no restore runs")
        asks = [(rid, e.transfer.block_table(rid), 0, n) for rid, n in _running_with_kv(e)]
        for link in self.links.values():
            link.send(("export_back", asks))
        pieces: dict[str, KV] = {}
        for link in self.links.values():
            (msg, _) = link.wait_for("back")
            for rid, hs in msg[1].items():
                for h in hs:
                    pieces.setdefault(rid, {}).update(tr.get(h))
                    tr.release(h)
        for link in self.links.values():
            link.send(("handover",))
        self.close(linger_ms=5000)  # "handover" must still reach every stage
        e.set_stage_link(None)
        return pieces

    def begin_restore(self) -> bool:
        """Sec. 4.4, overlapped with serving: the stages start sending back their layers' KV of
        the requests running now (tokens computed so far), and the head loads its dropped layers
        one per loop turn, while the group keeps serving as a pipeline (:meth:`advance_restore`).
        False when an exchange is still in flight or a restore already runs."""
        e = self.engine
        if self.queue or self.moves or self.restoring is not None:
            return False
        live = {rid: (n, tuple(e.transfer.block_table(rid))) for rid, n in _running_with_kv(e)}
        self.restoring = _Restore(live, sorted(e.dropped_weight_bytes), time.perf_counter(), e.num_steps)
        for link in self.links.values():
            link.send(("export_back", [(rid, list(bt), 0, n) for rid, (n, bt) in live.items()]))
        return True

    def advance_restore(self) -> bool | None:
        """One piece of the restore per loop turn (after the step): stage the next layer; once all
        are staged and every stage's first answer is here, finish (:meth:`_finish_restore`). None:
        still running; True: the group dissolved; False: refused (the group serves on)."""
        r = self.restoring
        assert r is not None
        if len(r.staged) < len(r.layers):
            i = r.layers[len(r.staged)]
            r.staged[i] = self.engine.stage_layer(i)
            return None
        if len(r.back) < len(self.links):
            return None
        done = self._finish_restore(r)  # a member dying meanwhile: release_pending still sees r
        self.restoring = None
        return done

    def _finish_restore(self, r: _Restore) -> bool:
        """The short stop at the end: running requests pause; the stages send what they computed
        since their first answer (the KV of tokens after each request's first copy, or the whole
        KV of a request whose blocks changed or that started meanwhile); the head shrinks its pool,
        puts the staged layers in, writes the KV, resumes them and runs alone; the stages are told
        to restore too."""
        e, tr = self.engine, self.worker.transport
        t0 = time.perf_counter()
        live = _running_with_kv(e)
        for rid, _ in live:
            e.pause_request(rid)
        back: dict[str, list] = {}
        for answer in r.back.values():
            for rid, hs in answer.items():
                back.setdefault(rid, []).extend(hs)
        r.back = {}  # from here on every handle is imported or released below
        asks = []
        for rid, n in live:
            bt = tuple(e.transfer.block_table(rid))
            first = r.live.get(rid)
            start = first[0] if first is not None and rid in back and bt[:len(first[1])] == first[1] \
                and n >= first[0] else 0
            if start == 0:  # no usable first copy: the whole KV now
                for h in back.pop(rid, []):
                    tr.release(h)
            if n > start:
                asks.append((rid, list(bt), start, n))
        for rid in set(back) - {rid for rid, _ in live}:  # finished meanwhile
            for h in back.pop(rid):
                tr.release(h)
        for link in self.links.values():
            link.send(("export_back", asks))
        for link in self.links.values():
            (msg, _) = link.wait_for("back")
            for rid, hs in msg[1].items():
                back.setdefault(rid, []).extend(hs)
        try:
            e.restore_layers(r.layers, r.staged)
        except ValueError as err:
            log.warning("restore refused: %s", err)
            _release_all(tr, back)
            for rid, _ in live:
                e.resume_request(rid)
            return False
        for rid, hs in back.items():  # by token: the shrink's relocations do not matter
            for h in hs:
                e.import_kv(rid, tr.get(h), h.spec.start)
                tr.release(h)
        e.set_stage_link(None)
        for rid, _ in live:
            e.resume_request(rid)
        self.num_back = len(live)  # requests that live through the restore (their KV came back)
        self.restore_stats = {"overlapped_s": round(t0 - r.t0, 4), "overlapped_steps": e.num_steps - r.steps0,
                              "stall_s": round(time.perf_counter() - t0, 4)}
        for link in self.links.values():
            link.send(("dissolve",))
        self.close(linger_ms=5000)  # "dissolve" must still reach every stage
        return True


@dataclasses.dataclass
class _Restore:
    """A restore in progress on the head (Sec. 4.4)."""

    live: dict[str, tuple[int, tuple[int, ...]]]  # request -> (tokens asked of the stages first, its blocks then)
    layers: list[int]
    t0: float
    steps0: int
    staged: dict[int, Any] = dataclasses.field(default_factory=dict)
    back: dict[int, dict[str, list]] = dataclasses.field(default_factory=dict)  # stage -> its first answer


class GroupTail:
    """A stage's side (every member but the head): hands its requests to the head, then serves
    activations and KV."""

    def __init__(self, worker: Any, spec: GroupSpec, pieces: dict[str, KV]):
        e = worker.engine
        me = worker.cfg.index
        self.worker, self.engine, self.spec = worker, e, spec
        self.peer = PeerLink(worker.ctx, spec.addresses[me], bind=False, peer_pid=spec.pids.get(spec.head))
        try:  # the head dying meanwhile: the link closes before the worker restores alone
            self._form(pieces)
        except BaseException:
            self.close()
            raise

    def _form(self, pieces: dict[str, KV]) -> None:
        worker, e, spec, me = self.worker, self.engine, self.spec, self.worker.cfg.index
        self.local: dict[str, KV] = {}  # moved requests' KV of our layers, until the head places them
        moved, lost = [], []
        with_kv = e.transfer.running_with_kv()
        for rid in e.request_ids():
            if e.num_sequences(rid) != 1:
                lost.append(rid)  # n > 1: a snapshot moves one sequence; the front end re-runs it
                continue
            if rid in with_kv:
                e.pause_request(rid)
            snap = e.export_request(rid)
            parts = spec.split({**snap.kv, **pieces.get(rid, {})}) if snap.num_computed_tokens else {}
            if me in parts:
                self.local[rid] = parts.pop(me)
            snap.kv = {}
            moved.append((snap, {m: _put(worker, part, snap.num_computed_tokens) for m, part in parts.items()}))
        e.abort_request([s.request_id for s, _ in moved] + lost)
        self.peer.send(("hello", _relayer(e, spec.keeps(me)), moved))
        (msg, _) = self.peer.wait_for("pool")
        e.resize_pool(msg[1])
        self.stage = TailStage(e)
        self.lost = lost
        self.dissolved = self.handed_over = False

    def serve(self, timeout_s: float) -> bool:
        """Handle the head's messages for up to ``timeout_s``; False when none came."""
        got = self.peer.recv(timeout_s)
        if got is None:
            self.peer.check_peer()
            return False
        while got is not None:
            self._handle(*got)
            got = None if self.dissolved or self.handed_over else self.peer.recv(0)
        return True

    def until_handover(self) -> None:
        """This group merges into a bigger one: serve the head (its collapse asks for our KV)
        until it releases us."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while not self.handed_over:
            if not self.serve(WATCH_S) and time.monotonic() > deadline:
                raise PeerLost(f"the group's head did not release this stage within {PEER_TIMEOUT_S:.0f} s")
        self.close()

    def close(self, linger_ms: int = 0) -> None:
        self.peer.close(linger_ms)

    def _handle(self, msg: tuple, t: torch.Tensor | None) -> None:
        kind = msg[0]
        if kind == "act":  # activations first: they are never queued behind anything here
            _, step_id, index, meta = msg
            self.peer.send(("act_out", step_id, index), self.stage.forward(t, meta))
        elif kind == "kv":
            _, rid, block_table, handle, last = msg
            tr = self.worker.transport
            self.stage.import_kv(block_table, tr.get(handle), handle.spec.start)
            tr.release(handle)
            if last:
                self.peer.send(("ok", rid))
        elif kind == "place":
            _, rid, block_table = msg
            kv = self.local.pop(rid, None)
            if kv:
                self.stage.import_kv(block_table, kv)
            self.peer.send(("ok", rid))
        elif kind == "forget":
            self.local.pop(msg[1], None)
        elif kind == "export_back":  # Sec. 4.4: our layers' KV of the head's requests goes back
            out = {}
            for rid, block_table, start, n in msg[1]:
                kv = self.stage.export_kv(block_table, n, start)
                out[rid] = [self.worker.transport.put(part, spec)
                            for spec, part in iter_chunks(kv, start, n, self.worker.cfg.layers_per_chunk)]
            self.peer.send(("back", out))
        elif kind == "dissolve":
            self.dissolved = True
        elif kind == "handover":
            self.handed_over = True


__all__ = ["GroupHead", "GroupSpec", "GroupTail"]
