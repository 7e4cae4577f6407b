"""A worker's KV moves (:class:`KVMover`, a mixin of :class:`tidal.runtime.worker.Worker`): the
chunks it exports (a prefill worker's hand-off, a migration, a DynaServe alpha part streaming its
KV as it computes) and the chunks it imports (a paused import growing its blocks chunk by chunk as
they land, DynaServe Sec. 4.3's chunked transfer). Exports are written a time budget at a time
between steps (``CHUNK_BUDGET_S``), so the worker keeps computing while its chunks are in flight."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tidal.runtime import protocol as P

CHUNK_BUDGET_S = 0.01  # time a worker spends putting hand-off chunks between two steps
# an alpha part streams its KV once this many new tokens are computed (and at its split point), as
# the simulator's split does (tidal.sim.split: stream_tokens, one KV block): a chunk per decode step
# made thousands of tiny chunks a request, each paying a shared-memory segment's fixed cost
STREAM_TOKENS = 16


@dataclass
class _Export:
    """A hand-off being written: the chunks still to put. A streamed alpha part (``stream``) grows
    as it computes (``sent``: tokens queued so far) until it reaches its split point (``done``)."""

    request_id: str
    chunks: deque = field(default_factory=deque)
    stream: bool = False
    sent: int = 0
    done: bool = False

    @property
    def ready(self) -> bool:
        """Something to do now: a chunk to put, or a finished stream to close."""
        return bool(self.chunks) or (self.stream and self.done)


class KVMover:
    """The export and import side of :class:`~tidal.runtime.worker.Worker` (its engine, transport,
    ``exports``, ``waiting_kv`` and ``send`` are the worker's)."""

    # ---------------------------------------------------------------- imports
    def land_arrived(self) -> None:
        """Write the chunks that arrived for paused imports, oldest import first, growing each
        one's blocks chunk by chunk (DynaServe Sec. 4.3's chunked transfer: beta holds only the KV
        that has landed); a chunk with no room waits (retried after each step) and so does what
        came after it for that request. The last chunk of a hand-off, or a beta part's
        ``finish``, resumes the request."""
        from tidal.runtime.kv_transfer import KVChunkGone

        e = self.engine
        t0 = time.perf_counter()
        for rid, q in list(self.waiting_kv.items()):
            while q:
                msg = q[0]
                if isinstance(msg, P.KVChunk):
                    handle, last = msg.handle, msg.last
                    if not e.grow_import(rid, handle.spec.end):
                        break
                    if handle.spec.end > e.import_reused(rid):  # else its tokens are all cached here: not read
                        try:
                            kv = self.transport.get(handle)
                        except KVChunkGone as gone:  # the request was aborted: its abort is on its way
                            self._give_back_import(rid, str(gone), kv_lost=True)
                            break
                        e.import_kv(rid, kv, handle.spec.start)
                    self.transport.release(handle)
                    self._io[2] += 1
                    q.popleft()
                    if not last:
                        continue
                    e.resume_request(rid)
                else:  # P.Finish: alpha's tokens, the text sent, alpha's last token time
                    e.finish_import(rid, msg.tokens, msg.text_sent, msg.last_token_time)
                    q.popleft()
                self.importing.discard(rid)
                self.send(P.Landed(rid))
            if not q:
                self.waiting_kv.pop(rid, None)
        self._io[0] += time.perf_counter() - t0

    def refuse_stuck_import(self) -> None:
        """Nothing here can free blocks (no request runs or waits, no export drains) and arrived
        KV still has no room: partly grown imports would wait on each other forever. Give the
        youngest one back (``refused``: its alpha keeps the request, or it is recomputed)."""
        self._give_back_import(next(reversed(self.waiting_kv)), "no room in the KV cache for the rest of its KV")

    def _give_back_import(self, rid: str, why: str, kv_lost: bool = False) -> None:
        """Drop a paused import and what arrived for it, and say so (``refused``; the front end
        ignores it for a request it already aborted, and releases the chunks' handles otherwise)."""
        self.waiting_kv.pop(rid, None)
        self.importing.discard(rid)
        self.engine.abort_request(rid)
        self.send(P.Refused(rid, why, kv_lost))

    # ---------------------------------------------------------------- hand-offs (prefill role)
    def start_handoffs(self, outs: list) -> None:
        for o in outs:
            if o.finished or o.request_id in self.handing_off or o.request_id in self.kept or len(o.outputs) != 1:
                continue  # n > 1 requests stay here: a hand-off moves one sequence
            self.hand_off(o.request_id)

    def hand_off(self, rid: str) -> None:
        """Pause ``rid``, send its snapshot (``handoff``) and queue its KV as chunks; after the
        last one it is freed here."""
        from tidal.cluster.handoff import handoff_blocks
        from tidal.runtime.kv_transfer import plan_chunks

        e = self.engine
        e.pause_request(rid)
        meta = e.export_request(rid, layers=[])
        self.handing_off.add(rid)
        chunks = plan_chunks(e.transfer.layer_ids, 0, meta.num_computed_tokens, self.cfg.layers_per_chunk,
                             self.cfg.tokens_per_chunk or None)
        blocks = handoff_blocks(meta.num_computed_tokens, e.transfer.block_size)
        self.send(P.HandoffStarted(rid, meta, blocks, len(chunks)))
        self.exports.append(_Export(rid, deque(chunks)))

    def migrate(self, rid: str) -> None:
        """The ``migrate`` baseline (Llumnix-like, KunServe Sec. 2.3): move a decoding request with
        its KV to another instance, as a hand-off. Only a running request that has sampled a token
        and holds one sequence moves; otherwise ``unmoved`` (it finished, or waits preempted)."""
        if rid in self.handing_off or rid in self.importing or not self.engine.is_movable(rid):
            self.send(P.Unmoved(rid))
            return
        self.hand_off(rid)

    def stream_splits(self) -> None:
        """After a step: queue the KV each alpha part computed as chunks (DynaServe Sec. 4.3: chunk
        k is pushed while chunk k+1 computes); mark the parts that reached their split point."""
        from tidal.runtime.kv_transfer import plan_chunks

        e = self.engine
        reached = set(e.transfer.drain_reached_pause())
        for ex in self.exports:
            if not ex.stream or ex.done:
                continue
            upto = e.transfer.computed_tokens(ex.request_id)
            if upto is None:  # finished (or aborted) before its split point: nothing to hand over
                ex.done, ex.chunks = True, deque()
                continue
            at_split = ex.request_id in reached
            if upto - ex.sent < STREAM_TOKENS and not at_split:
                continue  # too few new tokens for a chunk of their own yet
            ex.chunks.extend(plan_chunks(e.transfer.layer_ids, ex.sent, upto, self.cfg.layers_per_chunk,
                                         self.cfg.tokens_per_chunk or None))
            ex.sent = upto
            ex.done = at_split

    def write_chunks(self, budget_s: float = CHUNK_BUDGET_S) -> int:
        """Put chunks between two steps for at most ``budget_s`` (at least one): the sender keeps
        computing while its chunks are read, yet a hand-off's last chunks, which the request
        waits on, do not each wait for one more step (a step here lasts 30-250 ms, a chunk's
        copy a few ms). Returns the chunks put."""
        t0, n = time.perf_counter(), 0
        while self.write_one_chunk():
            n += 1
            if time.perf_counter() - t0 >= budget_s:
                break
        self._io[1] += time.perf_counter() - t0
        self._io[3] += n
        return n

    def write_one_chunk(self) -> bool:
        """Put the next chunk of the oldest hand-off that has one; after its last, free the request
        here (a streamed alpha part then also says ``split_done`` with the tokens it sampled)."""
        ex = next((x for x in self.exports if x.ready), None)
        if ex is None:
            return False
        e = self.engine
        if ex.chunks:
            spec = ex.chunks.popleft()
            handle = self.transport.put(e.export_kv(ex.request_id, list(spec.layers), spec.start, spec.end), spec)
            last = not ex.chunks and not ex.stream
            self.send(P.KVChunk(ex.request_id, handle, last))
            if not last:
                return True
        self.exports.remove(ex)
        self.handing_off.discard(ex.request_id)
        if ex.stream:
            sampled = e.transfer.sampled(ex.request_id)
            if sampled is None:
                return True  # it finished here: its outputs said so
            self.send(P.SplitDone(ex.request_id, *sampled))
        e.abort_request(ex.request_id)  # its KV now lives in the chunks
        return True

    # ---------------------------------------------------------------- loop


__all__ = ["CHUNK_BUDGET_S", "STREAM_TOKENS", "KVMover"]
