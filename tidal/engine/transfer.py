"""The engine's KV-transfer interface: what moves a request's KV in or out of an engine.

A runtime worker (P/D hand-offs, migration, DynaServe's split, KunServe's exchange) exports,
imports, pauses, resumes and frees a request's KV through :class:`KVTransfer` and reads what it
needs to plan chunks (layers, block tables, tokens with KV) here, never the scheduler's or the
block manager's fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.core.request import FinishReason, Request, RequestClass
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import RequestRejected
from tidal.core.validation import check_request_id
from tidal.engine.engine_core import EngineCore
from tidal.engine.output_processor import OutputProcessor

KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) [tokens, kv_heads, head_dim]


@dataclass
class RequestSnapshot:
    """A request in flight, as plain data: what export_request gives and import_request takes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int
    kv: KV
    priority: int = 0
    request_class: str = "online"
    text_sent: int | None = None  # characters of output text the client already has (None: all of it)
    # how long before the export the client sent it: the importer's arrival time is its own clock
    # less this (the request keeps its place in FCFS and its latency; machines need not share a clock)
    age_s: float = 0.0


class KVTransfer:
    def __init__(self, core: EngineCore, outputs: OutputProcessor, clock: Callable[[], float],
                 eos_token_ids: tuple[int, ...]):
        self.core, self.outputs, self.clock, self.eos_token_ids = core, outputs, clock, eos_token_ids
        self.scheduler, self.kv_manager, self.kv_cache = core.scheduler, core.kv_manager, core.kv_cache
        self.reused: dict[str, int] = {}  # paused imports: tokens of their KV this pool already held

    # ------------------------------------------------------------------ what a mover reads
    @property
    def layer_ids(self) -> list[int]:
        """The decoder layers whose KV this engine holds."""
        return list(self.core.model.layer_ids)

    @property
    def num_blocks(self) -> int:
        return self.kv_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv_manager.block_size

    def block_table(self, request_id: str) -> list[int]:
        return list(self.kv_manager.block_table(request_id))

    def request_ids(self) -> list[str]:
        """The requests this engine holds, by the ids they were added (or imported) with."""
        return list(self.outputs)

    def num_sequences(self, request_id: str) -> int:
        """The sequences of ``request_id`` (its ``n``); 0 for a request not here."""
        state = self.outputs.states.get(request_id)
        return 0 if state is None else len(state.sequences)

    def running_with_kv(self) -> dict[str, int]:
        """Running sequences that hold computed KV -> their tokens with KV (what a regroup, a
        restore or a collapse carries over)."""
        running = set(map(id, self.scheduler.running))
        return {rid: r.num_computed_tokens for rid, r in self.scheduler.requests.items()
                if r.num_computed_tokens and id(r) in running}

    def computed_tokens(self, request_id: str) -> int | None:
        """Tokens of ``request_id`` with KV here; None when it is not here (finished, aborted)."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.num_computed_tokens

    def sampled(self, request_id: str) -> tuple[list[int], float | None] | None:
        """The tokens ``request_id`` sampled and when its last one was; None when it is not here."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else (list(req.output_token_ids), req.last_token_time)

    def is_paused(self, request_id: str) -> bool:
        return request_id in self.scheduler.paused

    def is_movable(self, request_id: str) -> bool:
        """A hand-off or a migration can take it with its KV: one sequence, running, past its
        prefill with a sampled token, not finished."""
        req = self.scheduler.requests.get(request_id)
        return (self.num_sequences(request_id) == 1 and req is not None and req in self.scheduler.running
                and bool(req.output_token_ids) and not req.in_prefill and not req.is_finished)

    def drain_reached_pause(self) -> list[str]:
        """The alpha parts (``pause_at``) that reached their split point since the last call."""
        return self.scheduler.drain_reached_pause()

    # ------------------------------------------------------------------ out
    def pause(self, request_id: str) -> None:
        """Stop scheduling a running request (n=1), keeping its KV (a hand-off is reading it)."""
        self.scheduler.pause(request_id)

    def resume(self, request_id: str) -> None:
        self.reused.pop(request_id, None)
        self.scheduler.resume(request_id)

    def cancel_pause(self, request_id: str) -> None:
        """DynaServe's unsplit: an alpha part keeps the whole request (no split point; resumed if
        it already paused there)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return
        req.pause_at = None
        if request_id in self.scheduler.paused:
            self.resume(request_id)

    def export_request(self, request_id: str, layers: list[int] | None = None) -> RequestSnapshot:
        """Everything needed to continue ``request_id`` elsewhere: its tokens, parameters and the
        KV of its computed tokens as plain CPU tensors (by layer). The request stays here until
        freed, so a failed import loses nothing."""
        state = self.outputs.states[request_id]
        if len(state.sequences) != 1:
            raise ValueError("only n=1 requests can be exported")
        seq = state.sequences[0]
        req = seq.request
        kv = self.kv_cache.export(self.kv_manager.block_table(req.request_id), layers, 0, req.num_computed_tokens)
        return RequestSnapshot(request_id, state.prompt, list(req.prompt_token_ids), list(req.output_token_ids),
                               state.params, req.num_computed_tokens, kv, req.priority, req.request_class.value,
                               text_sent=seq.sent, age_s=max(0.0, self.clock() - req.arrival_time))

    def export_kv(self, request_id: str, layers: list[int], start: int, end: int) -> KV:
        """KV of ``layers`` for tokens ``[start, end)`` of a request (one chunk of a hand-off)."""
        return self.kv_cache.export(self.kv_manager.block_table(request_id), layers, start, end)

    def free(self, request_ids: str | list[str]) -> None:
        """Drop requests and their KV here (moved elsewhere, or aborted): the scheduler frees
        their blocks; they produce no more output."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = self.clock()
        for rid in request_ids:
            self.reused.pop(rid, None)
            state = self.outputs.remove(rid)
            if state is not None:
                self.core.finish([s.request.request_id for s in state.sequences], FinishReason.ABORT, now)

    # ------------------------------------------------------------------ in
    def import_request(self, snap: RequestSnapshot, paused: bool = False, hold_tokens: int | None = None) -> None:
        """Continue a request exported by another engine.

        With KV (``num_computed_tokens > 0``) its blocks are allocated at once and ``snap.kv`` is
        written into them; with ``paused`` the request waits, holding its blocks, for its KV to
        arrive in chunks (:meth:`import_kv`) until :meth:`resume`. Without KV
        (``num_computed_tokens == 0``) it queues like a new request and recomputes prompt and
        outputs (fail-over). Either way it continues its text where the client's stream stopped.
        ``hold_tokens`` (paused imports): blocks for only that many tokens now, the rest grown by
        :meth:`grow_import` as chunks arrive.
        """
        check_request_id(snap.request_id, self.outputs)
        req = Request(snap.request_id, list(snap.prompt_token_ids), snap.params, arrival_time=self.clock() - snap.age_s,
                      eos_token_ids=self.eos_token_ids, priority=snap.priority,
                      request_class=RequestClass(snap.request_class))
        req.output_token_ids = list(snap.output_token_ids)
        req.num_computed_tokens = snap.num_computed_tokens
        if snap.num_computed_tokens == 0:
            self.scheduler.add_request(req)
        else:
            # a paused import shares the blocks of the prefix this pool holds cached: only the KV past
            # them is written (import_kv), so a decode instance holding a conversation's history
            # takes in only the new turn (issue 52)
            reused = self.scheduler.add_imported(req, hold_tokens if paused else None, reuse_cached=paused)
            if reused is None:
                raise RequestRejected("no room in the KV cache for the imported request")
            if reused:
                self.reused[req.request_id] = reused
        if paused and snap.num_computed_tokens:
            self.scheduler.pause(req.request_id)
        if snap.kv:
            self.import_kv(req.request_id, snap.kv, 0)
        self.outputs.add_request(snap.request_id, snap.prompt, snap.params, [req], req.arrival_time)
        self.outputs.continue_text(snap.request_id, snap.text_sent)

    def reserve_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       num_kv_tokens: int, priority: int = 0, request_class: str = "online",
                       hold_tokens: int | None = None) -> None:
        """DynaServe Sec. 4.3: take in a beta micro-request whose first ``num_kv_tokens`` of KV
        arrive in chunks (:meth:`import_kv`) while its alpha part still computes; the output tokens
        alpha sampled come last, with :meth:`finish_import`, which also resumes it. It holds blocks
        for ``hold_tokens`` of that KV now (default: all of it); :meth:`grow_import` adds the rest
        chunk by chunk, so a long split does not fill the pool before its KV exists."""
        self.import_request(RequestSnapshot(request_id, None, list(prompt_token_ids), [], params, num_kv_tokens, {},
                                            priority, request_class, text_sent=0), paused=True,
                            hold_tokens=hold_tokens)

    def grow_import(self, request_id: str, num_tokens: int) -> bool:
        """Blocks so a paused import holds its first ``num_tokens`` tokens of KV; False: no room now."""
        req = self.scheduler.paused.get(request_id)
        if req is None:
            raise ValueError(f"{request_id!r} is not a paused import")
        if num_tokens > req.num_computed_tokens:
            raise ValueError(f"{request_id}: KV up to token {num_tokens} is past its {req.num_computed_tokens}")
        return self.kv_manager.allocate(request_id, num_tokens) is not None

    def import_kv(self, request_id: str, kv: KV, start: int) -> None:
        """Write one arriving chunk of a request imported with ``paused=True``: only its tokens past
        the prefix this pool already held (shared blocks are never written)."""
        skip = self.reused.get(request_id, 0) - start
        if skip > 0:
            kv = {layer: (k[skip:], v[skip:]) for layer, (k, v) in kv.items()}
            start += skip
            if not next(iter(kv.values()))[0].shape[0]:
                return
        self.kv_cache.import_(self.kv_manager.block_table(request_id), kv, start=start)

    def import_reused(self, request_id: str) -> int:
        """Tokens of a paused import's KV that were here already (its chunks below need not be read)."""
        return self.reused.get(request_id, 0)

    def finish_import(self, request_id: str, output_token_ids: list[int], text_sent: int | None,
                      last_token_time: float | None = None) -> None:
        """Complete a :meth:`reserve_import`: set the tokens alpha sampled (the client already has
        ``text_sent`` characters of their text; alpha sampled the last one at ``last_token_time``,
        on this engine's clock: a TBT-aware policy counts the hand-off gap) and resume it."""
        req = self.outputs.states[request_id].sequences[0].request
        if len(req.prompt_token_ids) + len(output_token_ids) < req.num_computed_tokens:
            raise ValueError(f"{request_id}: {len(output_token_ids)} output tokens cannot cover "
                             f"{req.num_computed_tokens} tokens of KV")
        if self.kv_manager.num_blocks_of(request_id) * self.kv_manager.block_size < req.num_computed_tokens:
            raise ValueError(f"{request_id}: its KV has not all arrived (blocks for "
                             f"{self.kv_manager.num_blocks_of(request_id) * self.kv_manager.block_size} of "
                             f"{req.num_computed_tokens} tokens)")
        req.output_token_ids = list(output_token_ids)
        if last_token_time is not None:
            req.last_token_time = last_token_time
        self.outputs.continue_text(request_id, text_sent)
        self.resume(request_id)
