"""Instance scheduler: continuous batching with a token budget, chunked prefill and preemption.

Pure decision code: it sees requests and block ids, never tensors or clocks (``now`` is an
argument). Each ``schedule`` returns a :class:`StepPlan` saying how many tokens each request
advances; each ``update`` applies the executor's :class:`StepResult`. The engine and the
simulator drive the very same object.

Two step shapes (``SchedulerConfig.scheduling``):

- ``chunked`` (the default, vLLM v1): the running requests first (decodes and unfinished
  prefills, a prefill in chunks within the token budget), then admissions, in one step.
- ``prefill-first`` (vLLM v0's default scheduler): a step is either all prefills or all
  decodes. While nothing is swapped out, the prefills go first: running requests still in
  prefill, then admissions, each prefill whole (a recomputed request's prompt and outputs in one
  go; one longer than the token budget runs alone in its step). Only a step with no prefill to
  run is a decode step, with the same preemption and swap-in as the chunked one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tidal.config import SchedulerConfig
from tidal.core.decode_steps import DecodeSteps
from tidal.core.kv_manager import KVCacheManager, PrefixHit
from tidal.core.plan import (
    PENDING_TOKEN,
    BatchComposition,
    RequestUpdate,
    ScheduledChunk,
    StepPlan,
    StepResult,
    TokenLogprobs,
    rectangle_padding,
)
from tidal.core.policy import SchedulerView, SchedulingPolicy, StepCaps, default_victim, is_passive
from tidal.core.queue_report import QueueReport
from tidal.core.request import FinishReason, Request, RequestStatus
from tidal.core.validation import RequestRejected, validate_request
from tidal.core.waiting import WaitingQueue

__all__ = ["RequestRejected", "Scheduler", "StepBudget"]


@dataclass
class StepBudget:
    """What one step may still take (SGLang's ``PrefillAdder`` pattern): tokens and sequences
    left, and the chunks bought so far; every chunk is charged here, in one place."""

    tokens: int
    max_seqs: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)  # the requests with a chunk this step

    def has_seat(self, num_running: int) -> bool:
        return num_running < self.max_seqs

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.scheduled.add(chunk.request_id)
        self.tokens -= chunk.num_tokens


class Scheduler(DecodeSteps, QueueReport):
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: SchedulingPolicy | None = None,
        max_model_len: int | None = None,
        watermark: float = 0.01,
    ):
        self.config = config
        # how a victim gives up its blocks; starts as configured, a cluster decision may switch it
        # (--kv-pressure auto: tidal.cluster.pressure.auto) -- a swap falls back to recompute without host room
        self.preemption_mode = config.preemption_mode
        self.kv = kv
        self.policy = policy or SchedulingPolicy()
        self._passive = is_passive(self.policy)
        self.max_model_len = max_model_len
        self.watermark = watermark
        self.waiting = WaitingQueue()  # queue order; knows when it is already FCFS
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.paused: dict[str, Request] = {}  # hold their blocks, never scheduled (a KV hand-off in flight)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # prefix caching (tokens): prompt tokens looked up at first admissions, and how many were
        # found on the device pool and in the host tier (recomputation after preemption is no query)
        self.prefix_queries = 0
        self._expected_cached: dict[str, int] = {}  # waiting requests' cached prefix when they arrived (tokens)
        self.prefix_hits = 0
        self.prefix_host_hits = 0
        self.kv_reused_tokens = 0  # imported KV that was already here (add_imported's shared prefixes)
        self.num_swap_preemptions = 0  # preemptions that swapped out (the rest recomputed)
        self.num_swap_fallbacks = 0  # preemptions that wanted to swap, found the host pool full and recomputed
        self._finished_since_plan: list[str] = []
        self._pending_updates: list[RequestUpdate] = []  # finishes decided while scheduling
        self._reached_pause: list[str] = []  # paused at their ``pause_at`` since the last drain
        self._step_id = 0
        self.last_caps = StepCaps(config.max_num_seqs, config.max_num_batched_tokens)  # resolved, last step

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, req: Request) -> None:
        validate_request(req.request_id, req.num_prompt_tokens, in_use=self.requests, max_model_len=self.max_model_len,
                         kv=self.kv)
        if req.max_model_len is None:
            req.max_model_len = self.max_model_len
        req.status = RequestStatus.WAITING
        if self.kv.pool.log is not None and not req.num_computed_tokens:  # a front end routes by cache: what
            self._expected_cached[req.request_id] = self.kv.peek_prefix_tokens(req)  # it will likely not compute
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_running(self, req: Request, hold_tokens: int | None = None) -> bool:
        """Admit a request whose first ``num_computed_tokens`` of KV arrive from elsewhere (a
        migration, a prefill-to-decode hand-off). Blocks for ``hold_tokens`` of them (default:
        all) are allocated now, the rest as the KV arrives (``kv.allocate``); False if no room."""
        return self.add_imported(req, hold_tokens) is not None

    def add_imported(self, req: Request, hold_tokens: int | None = None, reuse_cached: bool = False) -> int | None:
        """:meth:`add_running`, returning the tokens of its KV already here (None: no room). With
        ``reuse_cached`` the blocks of its longest prefix cached in this pool are shared (as a new
        request's hit is) and only the KV past them must arrive; the hit stops a token short of its
        computed KV, so at least one chunk lands and resumes it."""
        self.add_request(req)
        reused = self.kv.take_cached_kv(req) if reuse_cached else 0
        hold = req.num_computed_tokens if hold_tokens is None else min(hold_tokens, req.num_computed_tokens)
        if self.kv.allocate(req.request_id, max(hold, reused)) is None:
            self.kv.free(req.request_id)  # the shared blocks go back to the cache
            self.requests.pop(req.request_id)
            self.waiting.remove(req)
            return None
        self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.kv_reused_tokens += reused
        return reused

    def abort_requests(self, request_ids: Iterable[str], now: float = 0.0) -> list[str]:
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self.finish_request(rid, FinishReason.ABORT, now=now)
                done.append(rid)
        return done

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None,
                       now: float = 0.0) -> None:
        """End a request (stop string found, abort, ...) and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._expected_cached.pop(request_id, None)
        if self.paused.pop(request_id, None) is None:
            # the queue its status names first (no scan of a long waiting queue for a running request)
            first = {RequestStatus.WAITING: self.waiting, RequestStatus.SWAPPED: self.swapped}.get(
                req.status, self.running)
            for queue in (first, self.running, self.waiting, self.swapped):
                if req in queue:
                    queue.remove(req)
                    break
        self.kv.free(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finish_time = now
        self._finished_since_plan.append(request_id)
        self.policy.on_finished(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.paused)

    def has_runnable(self) -> bool:
        """Something a step could advance (paused requests wait for their hand-off, not for a step)."""
        return bool(self.waiting or self.running or self.swapped)

    def pause(self, request_id: str) -> None:
        """Take a running request out of scheduling, keeping its KV blocks (its KV is being sent
        elsewhere, or is still arriving); :meth:`resume` puts it back at the end of the running list."""
        req = self.requests[request_id]
        if req not in self.running:
            raise ValueError(f"only a running request can be paused; {request_id!r} is {req.status.value}")
        self.running.remove(req)
        self.paused[request_id] = req

    def resume(self, request_id: str) -> None:
        """Put a paused request back. One with only its next token left to compute (a decode: a
        KV hand-off that landed) goes ahead of the running prefills, as if it had been admitted
        before them: running requests are served in order, and a chunked prefill ahead of it
        would take the step's whole token budget, step after step. Any other goes last."""
        req = self.paused.pop(request_id)
        if req.num_uncomputed_tokens == 1:
            for i, r in enumerate(self.running):
                if r.in_prefill:
                    self.running.insert(i, req)
                    return
        self.running.append(req)

    def recompute_swapped(self) -> list[str]:
        """Every swapped-out request gives up its host copy and waits to recompute, first in the
        queue, in the order it would have come back (the layers this instance holds change: a
        KunServe group's stages would lack their layers of that copy). Returns their ids."""
        out = [r.request_id for r in self.swapped]
        for req in reversed(self.swapped):
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        self.swapped.clear()
        return out

    def drain_reached_pause(self) -> list[str]:
        """Requests that reached their ``pause_at`` (DynaServe's alpha micro-request is done) and
        were paused, holding their KV, since the last call; oldest first."""
        out, self._reached_pause = self._reached_pause, []
        return out

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def view(self, now: float) -> SchedulerView:
        return SchedulerView(
            now=now, running=tuple(self.running), waiting=self.waiting.snapshot(),
            num_free_blocks=self.kv.num_free_blocks, num_total_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens)

    # ------------------------------------------------------------------ scheduling
    def _chunk_len(self, req: Request, budget: int) -> int:
        n = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens  # uncomputed
        if n > budget:
            n = budget
        cap = self.config.long_prefill_token_threshold
        if cap and n > 1:
            n = min(n, cap)
        if req.pause_at is not None:  # an alpha micro-request computes no KV past its split point
            n = min(n, max(req.pause_at - req.num_computed_tokens, 1))
        return n

    def _make_chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + n
        # positional: this runs for every request of every step
        rid, outputs = req.request_id, req.output_token_ids
        return ScheduledChunk(rid, tuple(req.token_ids(start, end)), start, self.kv.frozen_table(rid),
                              end == len(req.prompt_token_ids) + len(outputs), req.sampling_params, len(outputs))

    def _preempt(self, victim: Request, swap_out: list[tuple[int, int]]) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.preemption_mode == "swap":
            moves = self.kv.swap_out(victim.request_id)
            if moves is not None:
                swap_out.extend(moves)
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                self.num_swap_preemptions += 1
                return
            self.num_swap_fallbacks += 1  # the host pool cannot hold it: recompute instead
        # recompute: drop the KV, keep the tokens; it re-enters at the head of the queue
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)

    def _add_chunk(self, req: Request, budget: StepBudget, room: Callable[[Request, int], bool]) -> bool:
        """The one place a chunk is bought: its length within what the budget has left, its
        blocks (``room``: allocate them, False if there are none), the chunk, the charge."""
        n = self._chunk_len(req, budget.tokens)
        if not room(req, n):
            return False
        budget.add(self._make_chunk(req, n))
        return True

    def _room(self, reserve: int = 0) -> Callable[[Request, int], bool]:
        """Allocate a request's blocks for ``n`` more tokens, keeping ``reserve`` blocks free."""
        return lambda req, n: self.kv.allocate(req.request_id, req.num_computed_tokens + n, reserve=reserve) is not None

    def _room_preempting(self, budget: StepBudget, preempted: list[str], swap_out: list[tuple[int, int]],
                         now: float) -> Callable[[Request, int], bool]:
        """A running request's blocks, preempting others (the policy's victim) until they fit;
        False when the request itself left the running list (preempted, or it alone outgrew the
        whole pool: then the pool is its context and it finishes)."""

        def room(req: Request, n: int) -> bool:
            while self.kv.allocate(req.request_id, req.num_computed_tokens + n) is None:
                others_hold = self.kv.num_blocks - self.kv.num_free_blocks - self.kv.num_blocks_of(req.request_id)
                if others_hold == 0:
                    self.finish_request(req.request_id, FinishReason.LENGTH, now=now)
                    self._pending_updates.append(RequestUpdate(
                        req.request_id, [], finished=True, finish_reason=FinishReason.LENGTH.value))
                    return False
                candidates = [r for r in self.running if r.request_id not in budget.scheduled]
                victim = self.policy.preemption_victim(candidates) or default_victim(candidates)
                self._preempt(victim, swap_out)
                preempted.append(victim.request_id)
                if victim is req:
                    return False
            return True

        return room

    def schedule(self, now: float) -> StepPlan:
        # the policy decides once per step, first; everything it is asked afterwards is about this step
        view = self.view(now)
        caps = self.policy.plan_step(view).within(self.policy.seq_ceiling(self.config.max_num_seqs),
                                                  self.config.max_num_batched_tokens)
        self.last_caps = caps
        budget = StepBudget(caps.token_budget, caps.max_num_seqs)
        # the admission watermark only matters while the pool is shared; an empty pool admits
        # whatever fits (else a recomputed request larger than num_blocks - reserve would starve)
        reserve = int(self.watermark * self.kv.num_blocks)
        preempted: list[str] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        room = self._room_preempting(budget, preempted, swap_out, now)
        self.kv.begin_step()

        if self.config.scheduling == "prefill-first":
            self._schedule_prefill_first(view, budget, room, reserve, preempted, swap_in, now)
        else:
            # 1. running requests, in admission order: decodes and unfinished prefills
            idx = 0
            while idx < len(self.running) and budget.tokens > 0:
                if self._add_chunk(self.running[idx], budget, room):
                    idx += 1
                # else the request left the running list, which shifted under idx

            # 2. admissions, only when nothing was preempted this step (else we would thrash)
            if not preempted:
                self._swap_in(budget, reserve, swap_in)
                if not self.swapped:
                    self._admit(view, budget, reserve, now, self._add_chunk)

        stores, loads = self.kv.end_step()  # the host tier's copies: stores go before loads, as swaps do
        swap_out += stores
        swap_in += loads
        finished, self._finished_since_plan = tuple(self._finished_since_plan), []
        self._step_id += 1
        chunks = budget.chunks
        padded = self.policy.padded_tokens(chunks) if chunks else 0
        if self.config.pad_prefill and not padded:  # BucketServe Eq. 1's S_max x N over the step's prompts
            padded = rectangle_padding([c for c in chunks if not c.is_decode])
        composition = BatchComposition.of(chunks, padded)
        return StepPlan(self._step_id, tuple(chunks), composition, tuple(swap_out), tuple(swap_in),
                        tuple(preempted), finished)

    def _swap_in(self, budget: StepBudget, reserve: int, swap_in: list[tuple[int, int]]) -> None:
        """Swapped-out requests back in, oldest first, while seats and blocks allow; each decodes."""
        while self.swapped and budget.has_seat(len(self.running)):
            req = self.swapped[0]
            moves = self.kv.swap_in(req.request_id, reserve=reserve if self.running else 0)
            if moves is None:
                break
            swap_in.extend(moves)
            self.swapped.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if budget.tokens > 0:
                self._add_chunk(req, budget, self._room())

    def _admit(self, view: SchedulerView, budget: StepBudget, reserve: int, now: float,
               add: Callable[[Request, StepBudget, Callable[[Request, int], bool]], bool]) -> None:
        """Waiting requests join, in the policy's order (else priority, FCFS), each with the chunk
        ``add`` buys, until seats, tokens or blocks run out."""
        if not self.waiting:
            return
        admitted: list[Request] = []
        # nothing joined or left the queue since the view (a preemption skips admissions),
        # so the policy sees the same snapshot that plan_step saw
        waiting = view.waiting if len(view.waiting) == len(self.waiting) else self.waiting.snapshot()
        order = self.policy.order_waiting(waiting, now)
        for req in self.waiting.fcfs(waiting) if order is None else order:
            if budget.tokens <= 0 or not budget.has_seat(len(self.running)):
                break
            if not self.policy.admit(req, admitted):
                continue
            keep = reserve if self.running else 0
            hit = self.kv.find_prefix(req)
            req.num_computed_tokens = self.kv.take_prefix(req, hit, keep)
            if not add(req, budget, self._room(keep)):
                if req.num_computed_tokens:  # back to the queue holding nothing (its blocks stay cached)
                    self.kv.free(req.request_id)
                    req.num_computed_tokens = 0
                break
            if req.num_cached_tokens is None:
                self._count_prefix(req, hit)
            self._expected_cached.pop(req.request_id, None)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            admitted.append(req)

    def _count_prefix(self, req: Request, hit: PrefixHit) -> None:
        """A request's first admission: its prompt was a prefix-cache query, what it found a hit
        (device pool and host tier apart); a request preempted before its first admission is none."""
        if req.num_preemptions:
            req.num_cached_tokens = 0
            return
        cached = min(req.num_computed_tokens, req.num_prompt_tokens)
        req.num_cached_tokens = cached
        if self.kv.enable_caching:
            self.prefix_queries += req.num_prompt_tokens
            self.prefix_hits += cached
            self.prefix_host_hits += min(hit.num_loaded * self.kv.block_size, cached)

    def _add_whole(self, req: Request, budget: StepBudget, room: Callable[[Request, int], bool]) -> bool:
        """Buy a request's whole prefill (up to its pause point), or nothing: False when it does
        not fit the tokens the step has left (the step's first prefill always fits: one longer
        than the budget runs alone) or its blocks are not there."""
        n = req.num_uncomputed_tokens
        if req.pause_at is not None:
            n = min(n, max(req.pause_at - req.num_computed_tokens, 1))
        if (n > budget.tokens and budget.chunks) or not room(req, n):
            return False
        budget.add(self._make_chunk(req, n))
        return True

    def _schedule_prefill_first(self, view: SchedulerView, budget: StepBudget,
                                room: Callable[[Request, int], bool], reserve: int, preempted: list[str],
                                swap_in: list[tuple[int, int]], now: float) -> None:
        """vLLM v0's default step: all prefills (each whole) when there are any to run, else all
        decodes. Prefills wait while a swapped-out request waits to come back, as in vLLM v0."""
        if not self.swapped:
            # running requests still in prefill (a hand-off's rest, a resumed split), then admissions
            for req in [r for r in self.running if r.in_prefill]:
                if budget.tokens <= 0:
                    break
                # a False with the request still running: it does not fit this step's tokens (else
                # it was preempted for its own blocks, or outgrew the pool)
                if (req.status is RequestStatus.RUNNING and not self._add_whole(req, budget, room)
                        and req.status is RequestStatus.RUNNING):
                    break
            if not preempted:
                self._admit(view, budget, reserve, now, self._add_whole)
            if budget.chunks:
                return
        # a decode step: every running decode, in admission order, preempting when blocks run out
        for req in list(self.running):
            if budget.tokens <= 0:
                break
            if req.status is RequestStatus.RUNNING and not req.in_prefill:
                self._add_chunk(req, budget, room)
        if not preempted:
            self._swap_in(budget, reserve, swap_in)

    # ------------------------------------------------------------------ results
    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[RequestUpdate]:
        updates, self._pending_updates = self._pending_updates, []
        for chunk in plan.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if chunk.token_ids[0] == PENDING_TOKEN and (req.num_computed_tokens != chunk.start
                                                         or req.num_tokens != chunk.start + 1):
                continue  # planned ahead of a token the request did not take (it stopped there, or was paused)
            req.num_computed_tokens += chunk.num_tokens
            self.kv.cache_blocks(req)
            if not chunk.sample:
                self._check_pause(req)
                continue
            updates.append(self._take_token(req, result.sampled[chunk.request_id], now,
                                            result.logprobs.get(chunk.request_id) if result.logprobs else None))
        self.policy.observe(plan, result)
        return updates

    def _take_token(self, req: Request, token: int, now: float, lp: TokenLogprobs | None = None) -> RequestUpdate:
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        upd = RequestUpdate(req.request_id, [token], () if lp is None else [lp])
        stop = req.check_stop()
        if stop is not None:
            reason, stop_reason = stop
            self.finish_request(req.request_id, reason, stop_reason, now=now)
            upd.finished, upd.finish_reason, upd.stop_reason = True, reason.value, stop_reason
        elif req.pause_at is not None:
            self._check_pause(req)
        return upd

    def _check_pause(self, req: Request) -> None:
        if req.pause_at is not None and req.num_computed_tokens >= req.pause_at:
            req.pause_at = None  # once: a resumed request runs on
            self.pause(req.request_id)
            self._reached_pause.append(req.request_id)
