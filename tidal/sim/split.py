"""DynaServe's micro-requests in the simulator (``--mode split``), pure.

On arrival, :class:`tidal.cluster.split.SplitPlanner` (the object the real front end drives)
picks a pair and a split point ``s`` (Alg. 1). The request goes to the pair's alpha instance with
``Request.pause_at = s`` (or whole to one instance when the split leaves the other side nothing):

1. alpha's own scheduler (whatever ``--batching`` says; DynaServe's is ``slo-compose``, Alg. 2)
   runs it and computes no KV past ``s``;
2. **chunked KV transfer** (Sec. 4.3): the KV alpha computes goes to beta as it is computed. At
   each of alpha's step ends, a request's KV computed so far and not yet sent goes on alpha's
   link once it fills ``stream_tokens`` tokens (one KV block by default), in the chunks of
   :class:`tidal.sim.pd.HandoffConfig` (layer groups), after what is already on the link; so
   while alpha computes chunk k + 1, chunk k travels, and only the tail is on the critical path.
   Beta holds blocks for the KV that has arrived, growing them chunk by chunk (the engine's
   ``reserve_import``); when beta has no room yet the KV waits on alpha, retried when beta ends
   a step. A request's streamed KV is on both instances (alpha still attends to all of it), so
   with ``stream_lead`` alpha starts pushing only once it is within that many tokens of ``s``
   (None: from its first chunk, as Sec. 4.3);
3. when alpha reaches ``s`` its scheduler pauses the request (``drain_reached_pause``); the
   planner hears ``on_handoff``; the tail is pushed; when the last chunk lands, alpha frees the
   request and beta resumes it with alpha's sampled tokens (the engine's ``finish_import``).

The planner's ledgers follow progress the way a front end can: before each decision, every part
on the candidate instances reports what it has computed and sampled (``on_progress``, totals).
The planner's step-time model is :class:`~tidal.sim.step_grid.ProfileGrid`, an offline profile of
the simulator's own cost model on a grid, interpolated (DynaServe's "offline profiling ... table
lookups", Sec. 4.1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.moves import (
    NO_DEADLINES,
    Command,
    FreeSource,
    Move,
    MoveKind,
    MoveRecord,
    Pause,
    Reserve,
    Resume,
)
from tidal.cluster.split import SplitDecision, SplitPlanner, SplitRecord
from tidal.cluster.split_predict import MicroRequest
from tidal.core.request import Request
from tidal.core.validation import RequestRejected, check_context
from tidal.metrics import distribution
from tidal.sim.instance import SimInstance, sim_names, sim_request
from tidal.sim.loop import Event
from tidal.sim.pd import HandoffConfig
from tidal.sim.simulator import ClusterSimulator, SimResult, _Landed
from tidal.sim.step_grid import ProfileGrid
from tidal.workload import RequestSpec

LENGTH_MODES = ("max-tokens", "predict", "oracle")
@dataclass
class SplitTransfer:
    """One request's split and, when both parts exist, its KV's way from alpha to beta."""

    request_id: str
    index: int
    alpha: int
    beta: int
    prompt_len: int
    predicted_output: int
    split: int
    phi: float
    probes: int
    cold_start: bool
    handoff: bool  # both parts exist
    t_alpha: float
    t_beta: float
    decided_s: float
    sent_tokens: int = 0  # KV tokens pushed on alpha's link so far
    nbytes: int = 0
    num_chunks: int = 0
    reserved_s: float | None = None  # beta holds blocks for its first chunk (the first could go)
    paused_s: float | None = None  # alpha reached s
    last_end_s: float | None = None  # the last chunk pushed so far lands
    landed_s: float | None = None  # beta resumed it
    whole_transfer_s: float = 0.0  # the same KV sent in one go after the pause (no streaming)
    finished_on_alpha: bool = False  # the request ended before its split point
    stayed_on_alpha: bool = False  # beta refused its part (it can never hold it): alpha ran it whole

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SplitSimulator(ClusterSimulator):
    """``--mode split``: the planner places and splits every request (module docstring)."""

    def __init__(self, instances: Sequence[SimInstance], planner: SplitPlanner, specs: Sequence[RequestSpec],
                 handoff: HandoffConfig, max_model_len: int | None = None, request_ids: Sequence[str] | None = None,
                 length_mode: str = "max-tokens", stream_tokens: int = 16, stream_lead: int | None = None,
                 timeline_interval: float = 0.0,
                 recorder: Callable[[SplitRecord], None] | None = None, cache_aware: bool = False):
        """``cache_aware`` (``--router cache-aware`` with prefix caching; the instances track their
        cached names): the planner sees each instance's cached prefix of a prompt, so a request's
        alpha goes where its prefix is unless load says otherwise (:meth:`SplitPlanner.choose_pair`)."""
        from tidal.cluster.router import build_router

        if length_mode not in LENGTH_MODES:
            raise ValueError(f"length mode must be one of {', '.join(LENGTH_MODES)}; got {length_mode!r}")
        if stream_tokens < 1:
            raise ValueError(f"stream_tokens must be >= 1, got {stream_tokens}")
        layout = ClusterLayout(len(instances), "split")
        super().__init__(instances, build_router("round-robin"), specs, max_model_len=max_model_len,
                         request_ids=request_ids, layout=layout, handoff=handoff, timeline_interval=timeline_interval)
        self.planner, self.pairs = planner, layout.pairs()
        self.cache_aware = cache_aware
        if stream_lead is not None and stream_lead < 0:
            raise ValueError(f"stream_lead must be >= 0, got {stream_lead}")
        self.length_mode, self.stream_tokens, self.stream_lead = length_mode, stream_tokens, stream_lead
        if recorder is not None:
            planner.recorder = recorder
        self.transfers: dict[int, SplitTransfer] = {}  # request index -> its split
        self._parts: dict[str, tuple[MicroRequest | None, MicroRequest | None, int]] = {}  # alpha, beta, alpha's samples
        self._streaming: dict[int, dict[str, int]] = {i: {} for i in range(len(instances))}  # alpha -> rid -> unsent
        self._waiting_room: dict[str, SplitTransfer] = {}  # KV ready but no room on beta yet
        self._moves: dict[str, Move] = {}  # beta's parts in flight (tidal.cluster.moves), by request
        self.load_timeline: dict[str, list] = {"t": [], "instance": [], "load_s": []}

    # ---------------------------------------------------------------- arrival: Alg. 1
    def _arrive(self, i: int, now: float) -> Event | None:
        spec, rec = self._arrived(i, now)
        rid = self.ids[i]
        try:  # the engine's and the simulator's one check (tidal.core.validation)
            check_context(spec.prompt_len, spec.output_len, self.max_model_len)
        except RequestRejected as e:
            return self._refuse(rec, now, f"context: {e}")
        for a, b in self.planner.live_pairs(self.pairs):
            self._sync(a)
            self._sync(b)
        max_tokens = spec.output_len  # what the client asked for (the simulated requests ignore EOS)
        predicted = None
        if self.length_mode == "predict":  # the planner sees no cap: its history decides
            max_tokens = (self.max_model_len or 1 << 30) - spec.prompt_len
        elif self.length_mode == "oracle":
            predicted = spec.output_len
        names, cached = None, None
        if self.instances[0].kv.enable_caching:
            names = sim_names(rid, spec, self.instances[0].kv.block_size)
            if self.cache_aware:  # alpha where the prefix is (the monitor's cache views, as the runtime's)
                self._sync_cache_views()
                prompt_names = tuple(names[:(spec.prompt_len - 1) // self.instances[0].kv.block_size])
                cached = {k: rec_.cached_tokens(prompt_names) for k, rec_ in enumerate(self.monitor.instances)}
        dec = self.planner.plan(rid, spec.prompt_len, max_tokens, None, now, predicted_output=predicted,
                                candidates=self.pairs, cached=cached)
        a, b = dec.pair
        for inst in (a, b):
            self.load_timeline["t"].append(now)
            self.load_timeline["instance"].append(inst)
            self.load_timeline["load_s"].append(dec.t_alpha if inst == a else dec.t_beta)
        first = a if dec.alpha is not None else b
        req = sim_request(rid, spec, now, self.instances[first].kv.block_size, self.instances[first].kv.enable_caching,
                          names)
        if dec.handoff:
            req.pause_at = dec.split
        try:
            self.instances[first].add_request(req)
        except RequestRejected as e:
            self.planner.on_finish(rid)
            return self._refuse(rec, now, f"rejected: {e}")
        self.monitor.on_dispatch(first, rid, now)
        self.routed[i] = first
        self._live[i] = req
        self.transfers[i] = self._transfer(i, dec, now)
        a_samples = dec.alpha.decode_tokens if dec.handoff and dec.alpha is not None else 0
        self._parts[rid] = (dec.alpha, dec.beta, a_samples)
        if dec.handoff:
            self._streaming[a][rid] = 0
            # beta's part is a move (tidal.cluster.moves), as in the runtime: beta reserved now (the
            # monitor counts it), its blocks held chunk by chunk as the KV arrives (``_hold``)
            blocks = handoff_blocks(dec.split, self.instances[b].block_size)
            self._moves[rid] = move = Move(rid, MoveKind.SPLIT, a, blocks, 0, dst=b, deadlines=NO_DEADLINES)
            self._carry_out(move, move.start(now), now)
        return self._wake(self.instances[first], now)

    def _carry_out(self, move: Move, cmds: list[Command], now: float) -> None:
        """Do what beta's move says (the runtime's front end does the same: tidal.runtime.handoffs)."""
        rid, todo = move.request_id, list(cmds)
        while todo:
            c = todo.pop(0)
            if isinstance(c, Reserve):
                assert c.dst is not None
                self.monitor.on_handoff_start(rid, c.dst, c.blocks)
                todo += move.reserved(c.dst, now)  # beta answers a refusal later (``_hold``)
            elif isinstance(c, Resume) and c.instance == move.src:  # fell back: alpha keeps it whole
                req = self.instances[c.instance].scheduler.requests.get(rid)
                if req is not None:
                    req.pause_at = None
                    if rid in self.instances[c.instance].scheduler.paused:
                        self.instances[c.instance].scheduler.resume(rid)
                self._streaming[move.src].pop(rid, None)
                self._waiting_room.pop(rid, None)
                self.transfers[self._index[rid]].stayed_on_alpha = True
            elif isinstance(c, Resume):
                self.instances[c.instance].scheduler.resume(rid)  # beta runs it with alpha's tokens
            elif isinstance(c, FreeSource):
                self.instances[c.instance].scheduler.abort_requests([rid], now)  # its KV is on beta now
                todo += move.source_freed(now)
            else:  # Pause: alpha pauses itself at s (its pause_at); nothing fails or times out here
                assert isinstance(c, Pause), f"unexpected move command {c!r}"
        if move.over:
            self._moves.pop(rid, None)
            self.move_records.append(MoveRecord.of(move))

    def _transfer(self, i: int, dec: SplitDecision, now: float) -> SplitTransfer:
        t = SplitTransfer(dec.request_id, i, dec.pair[0], dec.pair[1], dec.prompt_len, dec.predicted_output,
                          dec.split, dec.phi, dec.probes, dec.cold_start, dec.handoff, dec.t_alpha, dec.t_beta, now)
        if dec.handoff:
            assert self.handoff is not None
            t.whole_transfer_s = self.handoff.cost(dec.split)[2]
        return t

    def _sync(self, inst: int) -> None:
        """Every part on ``inst`` reports its progress to the planner (totals)."""
        sched = self.instances[inst].scheduler
        self.planner.on_budget(inst, sched.last_caps.token_budget)  # the predictor's budget: recent steps'
        for rid in self.planner.request_ids(inst):
            req = sched.requests.get(rid)
            parts = self._parts.get(rid)
            if req is None or parts is None or rid in sched.paused:
                continue
            alpha, beta, a_samples = parts
            on_alpha = alpha is not None and inst == self.transfers[self._index[rid]].alpha
            part = alpha if on_alpha else beta
            if part is None:
                continue
            done = min(max(req.num_computed_tokens - part.context, 0), part.prefill_tokens)
            sampled = len(req.output_token_ids) - (0 if on_alpha else a_samples)
            self.planner.on_progress(inst, rid, prefill_done=done, decoded=max(sampled, 0))

    # ---------------------------------------------------------------- steps, streaming, pauses
    def _step_end(self, inst: SimInstance, now: float) -> Event | list[Event] | None:
        plan = inst.plan  # the step that just ended
        updates = inst.end_step(now)
        self._apply(inst, updates, now)
        out: list[Event | None] = []
        for upd in updates:
            if upd.finished:
                out.extend(self._finished(upd.request_id, now))
        streaming = self._streaming[inst.index]
        if plan is not None and streaming:
            for c in plan.chunks:
                if c.request_id in streaming:
                    streaming[c.request_id] += c.num_tokens
        paused = set(inst.scheduler.drain_reached_pause())
        lead, reqs = self.stream_lead, inst.scheduler.requests
        for rid in list(streaming):
            if rid in paused:
                out.extend(self._push(rid, now, final=True))
            elif streaming[rid] >= self.stream_tokens and (
                    lead is None or self.transfers[self._index[rid]].split - reqs[rid].num_computed_tokens <= lead):
                out.extend(self._push(rid, now, final=False))
        if self._waiting_room:
            out.extend(self._retry_rooms(inst.index, now))
        out.append(self._begin(inst, now))
        return [e for e in out if e is not None]

    def _unsent(self, t: SplitTransfer) -> int:
        # alpha's KV of [0, s) goes once: what a recompute after a preemption recomputes was sent already
        return min(self._streaming[t.alpha].get(t.request_id, 0), t.split - t.sent_tokens)

    def _push(self, rid: str, now: float, final: bool) -> list[Event | None]:
        """Send alpha's computed, unsent KV of ``rid``, once beta holds blocks for it."""
        t = self.transfers[self._index[rid]]
        if final:
            t.paused_s = now
            self.planner.on_handoff(rid)
        n = self._unsent(t)
        if n > 0 and not self._hold(t, t.sent_tokens + n, now):
            if not t.stayed_on_alpha:
                self._waiting_room[rid] = t
            return []
        self._waiting_room.pop(rid, None)
        return self._send(t, now, final)

    def _send(self, t: SplitTransfer, now: float, final: bool) -> list[Event | None]:
        assert self.handoff is not None
        n = self._unsent(t)
        if n > 0:
            chunks, nbytes, dur = self.handoff.cost(n)
            start = max(now, self._link_free[t.alpha])  # behind what is already on alpha's link
            self._link_free[t.alpha] = t.last_end_s = start + dur
            t.sent_tokens += n
            t.nbytes += nbytes
            t.num_chunks += chunks
        streaming = self._streaming[t.alpha]
        if not final:
            if t.request_id in streaming:
                streaming[t.request_id] = 0
            return []
        streaming.pop(t.request_id, None)
        return [_Landed(max(now, t.last_end_s or now), self, t)]  # type: ignore[arg-type]

    def _hold(self, t: SplitTransfer, tokens: int, now: float) -> bool:
        """Beta holds blocks for the first ``tokens`` of KV (the engine's reserve_import, grown
        chunk by chunk as they arrive); False: no room yet."""
        dst = self.instances[t.beta].scheduler
        if t.reserved_s is not None:
            if dst.kv.allocate(t.request_id, tokens) is None:
                return False
            dst.requests[t.request_id].num_computed_tokens = tokens
            return True
        src = self.instances[t.alpha].scheduler.requests[t.request_id]
        req = Request(t.request_id, src.prompt_token_ids, src.sampling_params, arrival_time=src.arrival_time)
        req.block_hashes = list(src.block_hashes)
        req.num_computed_tokens = tokens
        try:
            ok = dst.add_running(req)
        except RequestRejected:  # beta can never hold it: the move falls back (alpha keeps it whole)
            self.monitor.on_handoff(t.request_id, t.alpha, t.beta, ok=False)
            move = self._moves[t.request_id]
            self._carry_out(move, move.refused(t.beta, now), now)
            return False
        if not ok:
            return False  # no room yet: the KV waits on alpha, retried when beta ends a step
        dst.pause(t.request_id)
        t.reserved_s = now
        return True

    def _retry_rooms(self, index: int, now: float) -> list[Event | None]:
        out: list[Event | None] = []
        for rid, t in list(self._waiting_room.items()):
            if t.beta != index:
                continue
            n = self._unsent(t)
            if n <= 0 or self._hold(t, t.sent_tokens + n, now):
                del self._waiting_room[rid]
                out.extend(self._send(t, now, final=t.paused_s is not None))
            elif t.stayed_on_alpha:
                out.append(self._wake(self.instances[t.alpha], now))
        return out

    def _land(self, t: SplitTransfer, now: float) -> list[Event]:  # type: ignore[override]
        src, dst = self.instances[t.alpha], self.instances[t.beta]
        sreq = src.scheduler.requests.get(t.request_id)
        dreq = dst.scheduler.requests.get(t.request_id)
        move = self._moves.get(t.request_id)
        if sreq is None or dreq is None or move is None:  # ended meanwhile
            return []
        dreq.output_token_ids = list(sreq.output_token_ids)  # the engine's finish_import
        dreq.last_token_time = sreq.last_token_time
        self._carry_out(move, move.all_landed(now), now)  # beta resumes it, alpha frees it
        self.monitor.on_handoff(t.request_id, t.alpha, t.beta, ok=True)
        t.landed_s = now
        return [e for e in (self._wake(dst, now), self._wake(src, now)) if e is not None]

    def _finished(self, rid: str, now: float) -> list[Event | None]:
        i = self._index[rid]
        t = self.transfers.get(i)
        self.planner.on_finish(rid, self.records[i].counted_tokens)
        self._parts.pop(rid, None)
        move = self._moves.pop(rid, None)  # ended from outside its move (the runtime's drop_handoff)
        if move is not None:
            self.move_records.append(MoveRecord.of(move))
        if t is None or not t.handoff or t.landed_s is not None or t.stayed_on_alpha:
            return []
        # it ended on alpha before its split point (a shorter output than predicted): beta lets go
        t.finished_on_alpha = True
        self._streaming[t.alpha].pop(rid, None)
        self._waiting_room.pop(rid, None)
        if t.reserved_s is not None:
            self.instances[t.beta].scheduler.abort_requests([rid], now)
        self.monitor.on_handoff(rid, t.alpha, t.beta, ok=False)  # beta's reservation goes
        return []


    def run(self, until: float | None = None, progress: Callable[[float], None] | None = None) -> SimResult:
        res = super().run(until, progress)
        res.splits = [self.transfers[i] for i in sorted(self.transfers)]
        res.split_load = self.load_timeline
        return res


def summarize_splits(transfers: Sequence[SplitTransfer]) -> dict[str, Any]:
    """Where requests were split (s - P, phi), how much KV moved and how much of its transfer
    was not hidden behind alpha's compute (pause to landing) against sending it after the pause."""
    ts = list(transfers)
    hand = [t for t in ts if t.handoff]
    landed = [t for t in hand if t.landed_s is not None and t.paused_s is not None]
    exposed = sum(t.landed_s - t.paused_s for t in landed)  # type: ignore[operator]
    whole = sum(t.whole_transfer_s for t in landed)
    return {
        "count": len(ts), "handoffs": len(hand), "landed": len(landed),
        "whole_on_alpha": sum(t.handoff is False and t.split >= t.prompt_len for t in ts),
        "whole_on_beta": sum(t.handoff is False and t.split < t.prompt_len for t in ts),
        "inside_prompt": sum(t.handoff and t.split < t.prompt_len for t in ts),
        "at_prompt_end": sum(t.handoff and t.split == t.prompt_len for t in ts),
        "inside_output": sum(t.handoff and t.split > t.prompt_len for t in ts),
        "cold_starts": sum(t.cold_start for t in ts),
        "finished_on_alpha": sum(t.finished_on_alpha for t in ts),
        "stayed_on_alpha": sum(t.stayed_on_alpha for t in ts),
        "phi": distribution(t.phi for t in ts),
        "split_minus_prompt": distribution(t.split - t.prompt_len for t in ts),
        "probes": distribution(t.probes for t in ts),
        "kv_bytes_total": sum(t.nbytes for t in ts),
        "kv_bytes": distribution(t.nbytes for t in landed),
        "exposed_transfer_ms": distribution(((t.landed_s - t.paused_s) for t in landed), 1000.0),  # type: ignore[operator]
        "whole_transfer_ms": distribution((t.whole_transfer_s for t in landed), 1000.0),
        "exposed_vs_whole": (exposed / whole) if whole > 0 else None,
    }


__all__ = ["LENGTH_MODES", "ProfileGrid", "SplitSimulator", "SplitTransfer", "summarize_splits"]
