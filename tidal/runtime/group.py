"""KunServe pipeline groups between two workers: the drop, the activation path, the KV exchange.

The front end's ``drop`` command (KunServe Sec. 4.1) makes one worker the *head* of a group and
another its *tail*; the head keeps layers ``[0, k)``, the tail ``[k, L)``. The two workers then
talk over their own ZeroMQ PAIR socket (:class:`PeerLink`): small pickled metadata plus, for
activations, the hidden states as raw bytes (never a pickled tensor). KV goes through the KV
transport (shared memory): only its handles cross the socket.

Sequence (Sec. 4.2's coordinated exchange):

1. tail: its requests move to the head. Each one's KV of the head's layers is put in chunks;
   its KV of the tail's layers stays here as a local copy. It drops the head's layers (its pool
   grows), then says ``hello`` (its pool size, the snapshots, the chunk handles).
2. head: its running requests pause; their KV of the tail's layers is exported (queued as
   chunks); it drops the tail's layers. On ``hello`` both pools take the smaller block count
   (``pool``); the tail's requests are imported paused (their head-layer KV read from the
   chunks) and ``place``d (the tail writes its local copy at the head's block ids). From then
   on the head runs steps through a :class:`ZmqStageLink`, and writes one queued KV chunk per
   loop turn, between steps, so an activation never waits behind the exchange. A request
   resumes when the tail answers ``ok`` for it; others run meanwhile; nothing recomputes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from tidal.engine.stage import TailStage, chunk_meta, microbatch_cost

log = logging.getLogger("tidal.worker")
PEER_TIMEOUT_S = 120.0  # a peer that says nothing this long is gone (the front end sees its death)
WATCH_S = 0.5  # how often a member waiting on its peer checks that the peer's process lives


class PeerLost(RuntimeError):
    """The other member of the group died (Sec. 4.4: the survivor restores its layers)."""


class PeerLink:
    """One PAIR socket between the two members of a group."""

    def __init__(self, ctx: Any, address: str, bind: bool, peer_pid: int | None = None):
        import zmq

        self.zmq, self.peer_pid = zmq, peer_pid
        self._checked = time.monotonic()
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if bind else self.sock.connect)(address)
        self.backlog: deque[tuple[tuple, torch.Tensor | None]] = deque()  # read while waiting for something else

    def _writable(self) -> None:
        """A PAIR socket blocks a send while no peer is connected: wait in slices, watching the
        peer's process (a dead peer raises :class:`PeerLost` instead of hanging the worker)."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while not self.sock.poll(int(1000 * WATCH_S), self.zmq.POLLOUT):
            self.check_peer()
            if time.monotonic() > deadline:
                raise PeerLost(f"the group's peer took no message for {PEER_TIMEOUT_S:.0f} s")

    def send(self, msg: tuple, tensor: torch.Tensor | None = None) -> None:
        self._writable()
        if tensor is None:
            self.sock.send(pickle.dumps((msg, None), protocol=pickle.HIGHEST_PROTOCOL))
            return
        t = tensor.detach().contiguous()
        meta = pickle.dumps((msg, (tuple(t.shape), str(t.dtype).removeprefix("torch."))))
        self.sock.send_multipart([meta, memoryview(t.view(torch.uint8).numpy())], copy=False)

    def check_peer(self, now: float | None = None) -> None:
        """Raise :class:`PeerLost` when the peer's process is gone (a local worker; checked at most
        every ``WATCH_S``)."""
        now = time.monotonic() if now is None else now
        if self.peer_pid is None or now - self._checked < WATCH_S:
            return
        self._checked = now
        try:
            os.kill(self.peer_pid, 0)
        except ProcessLookupError:
            raise PeerLost(f"the group's peer (pid {self.peer_pid}) is gone") from None
        except PermissionError:
            pass

    def recv(self, timeout_s: float | None) -> tuple[tuple, torch.Tensor | None] | None:
        if self.backlog:
            return self.backlog.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # in slices, watching the peer's process meanwhile
            wait = WATCH_S if deadline is None else min(WATCH_S, max(0.0, deadline - time.monotonic()))
            if self.sock.poll(int(1000 * wait)):
                break
            self.check_peer()
            if deadline is not None and time.monotonic() >= deadline:
                return None
        frames = self.sock.recv_multipart()
        msg, spec = pickle.loads(frames[0])
        if spec is None:
            return msg, None
        shape, dtype = spec
        raw = torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8)
        return msg, raw.view(getattr(torch, dtype)).view(shape)

    def wait_for(self, kind: str, timeout_s: float = PEER_TIMEOUT_S) -> tuple[tuple, torch.Tensor | None]:
        """The next message of ``kind``; others read meanwhile wait in the backlog, in order."""
        held: list = []
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                got = self.recv(max(0.0, deadline - time.monotonic()))
                if got is None:
                    raise RuntimeError(f"the group's peer sent no {kind!r} within {timeout_s:.0f} s")
                if got[0][0] == kind:
                    return got
                held.append(got)
        finally:
            self.backlog.extendleft(reversed(held))

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger_ms)


class ZmqStageLink:
    """The head's :class:`~tidal.engine.stage.StageLink` to a tail in another process: send puts
    the microbatch on the wire and returns, so the head computes the next one while the tail
    works (the overlap of Sec. 4.3's microbatches); recv waits for the tail's answer."""

    def __init__(self, peer: PeerLink):
        self.peer = peer

    def send(self, step_id: int, index: int, h: torch.Tensor, chunks: Sequence[Any]) -> None:
        self.peer.send(("act", step_id, index, chunk_meta(chunks)), h)

    def recv(self, step_id: int, index: int) -> torch.Tensor:
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while True:
            msg, t = self.peer.wait_for("act_out", max(0.0, deadline - time.monotonic()))
            if (msg[1], msg[2]) == (step_id, index) and t is not None:
                return t
            log.warning("dropping an unexpected activation %s", msg[:3])


def _requests(engine: Any) -> list[tuple[str, Any]]:
    return list(engine.scheduler.requests.items())


def _running_with_kv(engine: Any) -> list[tuple[str, Any]]:
    """The running requests that hold computed KV (those a restore must carry over)."""
    return [(rid, r) for rid, r in _requests(engine) if r.num_computed_tokens and r in engine.scheduler.running]


def _release_all(transport: Any, handles: dict[str, list]) -> None:
    for hs in handles.values():
        for h in hs:
            transport.release(h)


class GroupHead:
    """The head's side: built by the ``drop`` command, pumped once per worker loop turn."""

    def __init__(self, worker: Any, tail_index: int, address: str, drop: Sequence[int], peer_pid: int | None):
        e = worker.engine
        self.worker, self.engine, self.tail_index = worker, e, tail_index
        self.peer = PeerLink(worker.ctx, address, bind=True, peer_pid=peer_pid)
        self.queue: deque[tuple] = deque()  # ("kv", rid, block_table, handle, last) to send, one per turn
        self.exchanging: set[str] = set()  # paused until the tail says ok
        keep_tail = sorted(drop)
        # Sec. 4.2: every running request pauses; its KV of the tail's layers leaves before the drop
        exports = {}
        for rid, req in _running_with_kv(e):
            e.pause_request(rid)
            exports[rid] = (req.num_computed_tokens, e.export_kv(rid, keep_tail, 0, req.num_computed_tokens))
        n_head = e.drop_layers(keep_tail)
        (hello, _) = self.peer.wait_for("hello")
        _, n_tail, moved = hello
        self.num_blocks = min(n_head, n_tail)
        e.resize_pool(self.num_blocks)
        self.peer.send(("pool", self.num_blocks))
        cost, source = microbatch_cost(e.arch, e.config.scheduler.microbatch_cost)
        log.info("group head %d: microbatch split with %s Eq. 1 coefficients (alpha %.4g, beta %.4g, gamma %.4g)",
                 worker.cfg.index, source, cost.alpha, cost.beta, cost.gamma)
        e.set_stage_link(ZmqStageLink(self.peer), cost, min_tokens=worker.cfg.mb_min_tokens)
        from tidal.runtime.kv_transfer import iter_chunks

        lpc = worker.cfg.layers_per_chunk
        for rid, (n, kv) in exports.items():
            chunks = list(iter_chunks(kv, 0, n, lpc))
            for k, (spec, part) in enumerate(chunks):
                self.queue.append(("kv", rid, None, worker.transport.put(part, spec), k == len(chunks) - 1))
            self.exchanging.add(rid)
        self.num_exchanged = len(exports)  # own requests whose tail-layer KV went to the tail
        self.moved: list[str] = []
        for snap, handles in moved:
            self._land(snap, handles)
        self.reported = False
        self.restoring: _Restore | None = None
        self.restore_stats: dict[str, Any] = {}

    def _land(self, snap: Any, handles: list) -> None:
        """A request that lived on the tail: import it paused, write its head-layer KV, ask the
        tail to write its own (local) copy of the rest at our block ids."""
        from tidal.core.scheduler import RequestRejected

        e, tr = self.engine, self.worker.transport
        rid = snap.request_id
        try:
            e.import_request(snap, paused=bool(snap.num_computed_tokens))
        except (RequestRejected, ValueError):  # no room even now: recompute it here instead
            for h in handles:
                tr.release(h)
            self.peer.send(("forget", rid))
            e.import_request(dataclasses.replace(snap, num_computed_tokens=0, kv={}))
            self.moved.append(rid)
            return
        for h in handles:
            e.import_kv(rid, tr.get(h), h.spec.start)
            tr.release(h)
        self.moved.append(rid)
        if snap.num_computed_tokens:
            self.exchanging.add(rid)
            self.peer.send(("place", rid, list(e.kv_manager.block_table(rid))))

    def forget(self, rid: str) -> None:
        """``rid`` was aborted here: its queued chunks never go (its blocks may be reused)."""
        self.exchanging.discard(rid)
        for item in [q for q in self.queue if q[1] == rid]:
            self.queue.remove(item)
            self.worker.transport.release(item[3])

    def pump(self) -> None:
        """Between steps: read the tail's answers, then write one queued KV chunk."""
        e = self.engine
        while (got := self.peer.recv(0)) is not None:
            msg = got[0]
            if msg[0] == "back" and self.restoring is not None and self.restoring.back is None:
                self.restoring.back = msg[1]
            elif msg[0] == "ok":
                rid = msg[1]
                if rid in self.exchanging:
                    self.exchanging.discard(rid)
                    if rid in e.scheduler.paused:
                        e.resume_request(rid)
            else:
                log.warning("head: unexpected message from the tail %s", msg[0])
        if self.queue:
            _, rid, _, handle, last = self.queue.popleft()
            self.peer.send(("kv", rid, list(e.kv_manager.block_table(rid)), handle, last))
        if not self.reported and not self.exchanging and not self.queue:
            self.reported = True
            self.worker.send("exchange_done", self.tail_index, self.num_exchanged, len(self.moved))

    @property
    def busy(self) -> bool:
        """Chunks to write now, or layers to stage for a restore (requests waiting for the tail's
        ``ok``, or a restore for its KV, are only polled for)."""
        r = self.restoring
        return bool(self.queue) or (r is not None and len(r.staged) < len(r.layers))

    def release_pending(self) -> None:
        """The group ends without a restore (its peer died, or this worker shuts down): release the
        KV chunks the tail sent back that are still here (a restore's answers, read or waiting on
        the socket)."""
        tr = self.worker.transport
        answers = [self.restoring.back] if self.restoring is not None and self.restoring.back else []
        self.restoring = None
        with contextlib.suppress(Exception):  # the peer is gone: read what it sent, no more
            while (got := self.peer.recv(0)) is not None:
                if got[0][0] == "back":
                    answers.append(got[0][1])
        for back in answers:
            _release_all(tr, back)

    def begin_restore(self) -> bool:
        """Sec. 4.4, overlapped with serving: the tail starts sending back its layers' KV of the
        requests running now (tokens computed so far), and the head loads its dropped layers one
        per loop turn, while the group keeps serving as a pipeline (:meth:`advance_restore`). False
        when an exchange is still in flight or a restore already runs."""
        e = self.engine
        if self.queue or self.exchanging or self.restoring is not None:
            return False
        live = {rid: (r.num_computed_tokens, tuple(e.kv_manager.block_table(rid))) for rid, r in _running_with_kv(e)}
        self.restoring = _Restore(live, sorted(e.dropped_weight_bytes), time.perf_counter(), e.num_steps)
        self.peer.send(("export_back", [(rid, list(bt), 0, n) for rid, (n, bt) in live.items()]))
        return True

    def advance_restore(self) -> bool | None:
        """One piece of the restore per loop turn (after the step): stage the next layer; once all
        are staged and the tail's first answer is here, finish (:meth:`_finish_restore`). None:
        still running; True: the group dissolved; False: refused (the group serves on)."""
        r = self.restoring
        assert r is not None
        if len(r.staged) < len(r.layers):
            i = r.layers[len(r.staged)]
            r.staged[i] = self.engine.stage_layer(i)
            return None
        if r.back is None:
            return None
        done = self._finish_restore(r)  # the peer dying meanwhile: release_pending still sees r
        self.restoring = None
        return done

    def _finish_restore(self, r: _Restore) -> bool:
        """The short stop at the end: running requests pause; the tail sends what it computed
        since the first answer (the KV of tokens after each request's first copy, or the whole
        KV of a request whose blocks changed or that started meanwhile); the head shrinks its pool,
        puts the staged layers in, writes the KV, resumes them and runs alone; the tail is told to
        restore too."""
        e, tr = self.engine, self.worker.transport
        t0 = time.perf_counter()
        live = [(rid, req.num_computed_tokens) for rid, req in _running_with_kv(e)]
        for rid, _ in live:
            e.pause_request(rid)
        back = r.back
        asks = []
        for rid, n in live:
            bt = tuple(e.kv_manager.block_table(rid))
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
        self.peer.send(("export_back", asks))
        (msg, _) = self.peer.wait_for("back")
        for rid, hs in msg[1].items():
            back.setdefault(rid, []).extend(hs)
        r.back = None  # from here on every handle is imported or released below
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
        self.peer.send(("dissolve",))
        self.peer.close(linger_ms=5000)  # "dissolve" must still reach the tail
        return True


@dataclasses.dataclass
class _Restore:
    """A restore in progress on the head (Sec. 4.4)."""

    live: dict[str, tuple[int, tuple[int, ...]]]  # request -> (tokens asked of the tail first, its blocks then)
    layers: list[int]
    t0: float
    steps0: int
    staged: dict[int, Any] = dataclasses.field(default_factory=dict)
    back: dict[str, list] | None = None  # the tail's first answer: request -> chunk handles


class GroupTail:
    """The tail's side: hands its requests to the head, then serves activations and KV."""

    def __init__(self, worker: Any, head_index: int, address: str, drop: Sequence[int], peer_pid: int | None):
        e = worker.engine
        self.worker, self.engine, self.head_index = worker, e, head_index
        self.peer = PeerLink(worker.ctx, address, bind=False, peer_pid=peer_pid)
        keep = [i for i in e.model.layer_ids if i not in set(drop)]
        from tidal.runtime.kv_transfer import iter_chunks

        self.local: dict[str, dict] = {}  # moved requests' KV of our layers, until the head places them
        moved, lost = [], []
        for rid, group in list(e._groups.items()):
            if len(group.children) != 1:
                lost.append(rid)  # n > 1: a snapshot moves one sequence; the front end re-runs it
                continue
            req = group.children[0].request
            if req.num_computed_tokens and req in e.scheduler.running:
                e.pause_request(rid)
            snap = e.export_request(rid)
            head_kv = {i: kv for i, kv in snap.kv.items() if i not in keep}
            self.local[rid] = {i: snap.kv[i] for i in keep if i in snap.kv}
            handles = [worker.transport.put(part, spec) for spec, part in
                       iter_chunks(head_kv, 0, snap.num_computed_tokens, worker.cfg.layers_per_chunk)] \
                if snap.num_computed_tokens else []
            snap.kv = {}
            moved.append((snap, handles))
        e.abort_request([s.request_id for s, _ in moved] + lost)
        n_tail = e.drop_layers(sorted(drop))
        self.peer.send(("hello", n_tail, moved))
        (msg, _) = self.peer.wait_for("pool")
        e.resize_pool(msg[1])
        self.stage = TailStage(e)
        self.lost = lost
        self.dissolved = False

    def serve(self, timeout_s: float) -> bool:
        """Handle the head's messages for up to ``timeout_s``; False when none came."""
        got = self.peer.recv(timeout_s)
        if got is None:
            self.peer.check_peer()
            return False
        while got is not None:
            self._handle(*got)
            got = None if self.dissolved else self.peer.recv(0)
        return True

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
            from tidal.runtime.kv_transfer import iter_chunks

            out = {}
            for rid, block_table, start, n in msg[1]:
                kv = self.stage.export_kv(block_table, n, start)
                out[rid] = [self.worker.transport.put(part, spec)
                            for spec, part in iter_chunks(kv, start, n, self.worker.cfg.layers_per_chunk)]
            self.peer.send(("back", out))
        elif kind == "dissolve":
            self.dissolved = True


__all__ = ["GroupHead", "GroupTail", "PeerLink", "PeerLost", "ZmqStageLink"]
