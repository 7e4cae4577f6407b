"""Decode-only steps planned without :meth:`Scheduler.schedule`'s full pass (a mixin of
:class:`tidal.core.scheduler.Scheduler`, reading its queues, KV manager and step counter).

- The simulator's fast path: :meth:`decode_positions`, :meth:`begin_decodes`, :meth:`end_decodes` and
  runs of such steps, with no chunks, plan or result at all.
- The engine's overlapped step (``--async-scheduling``, vLLM's async scheduling): :meth:`plan_overlapped`
  plans the decode step after one still running on the device, before its tokens are known; the
  executor feeds each chunk's :data:`~tidal.core.plan.PENDING_TOKEN` from that step's samples, and
  :meth:`Scheduler.update` applies it as any plan.
"""

from __future__ import annotations

from typing import Any

from tidal.core.plan import PENDING_TOKEN, BatchComposition, RequestUpdate, ScheduledChunk, StepPlan
from tidal.core.request import Request


class DecodeSteps:
    running: list[Request]
    waiting: Any
    swapped: list[Request]
    kv: Any
    config: Any
    _passive: bool
    _pending_updates: list[RequestUpdate]
    _finished_since_plan: list[str]
    _step_id: int
    last_caps: Any

    def _free_for_one_more(self, positions: list[tuple[str, int]]) -> bool:
        """Whether the free blocks cover one more token each of ``positions`` (request id, tokens held);
        with a host tier, without evicting a cached block (an eviction's store needs a planned step)."""
        kv = self.kv
        return kv.blocks_for_one_more(positions) <= (kv.num_plain_free_blocks if kv.host_tier else kv.num_free_blocks)

    # ------------------------------------------------------------------ the engine's overlapped step
    def plan_overlapped(self, inflight: StepPlan) -> StepPlan | None:
        """The decode step after ``inflight``, planned while ``inflight`` runs (vLLM's async scheduling:
        the host plans step k+1 while the device computes step k). Each chunk's token is
        :data:`PENDING_TOKEN`, the one ``inflight`` samples for that request.

        It holds when ``inflight`` decoded every running request (nobody joined or resumed since; each
        still has exactly ``inflight``'s token in computation), the policy is passive, none has a pause
        point, the token budget covers them and the free blocks cover the new ones (nobody is
        preempted); with requests waiting, only while every seat stays taken (``schedule`` would admit
        nobody either). A request whose ``inflight`` token is its last by length sits this step out; one
        that stops on the token it samples there (an EOS, a stop token or string) decodes once more,
        :meth:`update` drops that row, and a request waiting for its seat joins a step later than
        ``schedule`` alone would have it join. None: nothing planned, nothing allocated (``schedule``
        plans the step once ``inflight``'s tokens are in)."""
        running = self.running
        if not self._passive or self.swapped or self._pending_updates or not running:
            return None
        planned = {c.request_id: c for c in inflight.chunks}
        if len(running) > len(planned):
            return None
        held: list[tuple[Request, int]] = []
        for req in running:
            c = planned.get(req.request_id)
            if (c is None or not c.sample or len(c.token_ids) != 1 or req.pause_at is not None
                    or req.num_computed_tokens != c.start or req.num_tokens != c.start + 1):
                return None
            if len(req.output_token_ids) + 1 < req.output_limit():  # else inflight's token is its last
                held.append((req, c.start + 1))
        caps = self.last_caps  # (a passive policy's: the same every step)
        if len(held) > caps.token_budget or (self.waiting and len(held) < caps.max_num_seqs):
            return None  # not every decode fits the budget, or a seat is free for an admission
        positions = [(req.request_id, p) for req, p in held]
        if not held or not self._free_for_one_more(positions):
            return None
        kv = self.kv
        kv.allocate_one_more(positions)
        chunks = tuple(ScheduledChunk(req.request_id, (PENDING_TOKEN,), p, kv.frozen_table(req.request_id), True,
                                      req.sampling_params, len(req.output_token_ids) + 1) for req, p in held)
        finished, self._finished_since_plan = tuple(self._finished_since_plan), []
        self._step_id += 1
        return StepPlan(self._step_id, chunks, BatchComposition.of(chunks), finished=finished)

    # ------------------------------------------------------------------ the simulator's runs of decodes
    def decode_positions(self, last: list[tuple[str, int]] | None = None) -> list[tuple[str, int]] | None:
        """When the next step is sure to be "every running request decodes one token": (request id,
        position of its token) for each, in running order (a cost model needs the positions); else None.

        That holds when nothing waits or is swapped, the policy is passive (:func:`is_passive`), the
        token budget covers every running request, each has exactly one token to compute and no
        pause point, and the free blocks cover their new blocks (so nobody is preempted). Then
        :meth:`begin_decodes` and :meth:`end_decodes` change the state exactly as ``schedule`` and
        ``update`` would, without building chunks, a plan or a result (a simulator's fast path).

        ``last``: this method's answer for the step :meth:`end_decodes` just ended, nothing else
        having happened since. If that step finished nobody, all but the blocks still hold and only
        the positions moved on, so only the blocks are checked again."""
        running = self.running
        if last is not None and len(running) == len(last):
            positions = [(rid, p + 1) for rid, p in last]
        else:
            if (not self._passive or self.waiting or self.swapped or not running
                    or len(running) > self.config.max_num_batched_tokens):
                return None
            positions = []
            for req in running:
                p = req.num_computed_tokens
                if len(req.prompt_token_ids) + len(req.output_token_ids) - p != 1 or req.pause_at is not None:
                    return None
                positions.append((req.request_id, p))
        return positions if self._free_for_one_more(positions) else None

    def begin_decodes(self, positions: list[tuple[str, int]]) -> tuple[Request, ...]:
        """``schedule`` for the step :meth:`decode_positions` just vouched for (``positions`` is its
        answer): the blocks, the step id; returns the batch for :meth:`end_decodes`."""
        self.kv.allocate_one_more(positions)
        # no plan: the ids finished since the last one stay for the next plan (an executor's state)
        self._step_id += 1
        return tuple(self.running)

    def end_decodes(self, batch: tuple[Request, ...], token: int, now: float) -> list[RequestUpdate]:
        """``update`` for that step: each request of ``batch`` sampled ``token``."""
        updates, self._pending_updates = self._pending_updates, []
        for req in batch:
            req.num_computed_tokens += 1
            self.kv.cache_blocks(req)
            updates.append(self._take_token(req, token, now))
        return updates

    def decode_run_room(self, token: int) -> int:
        """How many decode-only steps in a row (each as :meth:`decode_positions` vouches for) every
        running request can take, sampling ``token`` each time, without any of them finishing: the
        fewest tokens left before a length limit, less the one that would finish it; 0 when
        ``token`` may stop a request, one has no token yet, or updates are pending. For
        :meth:`end_decode_run`."""
        if self._pending_updates or not self.running:
            return 0
        room = 1 << 62
        for req in self.running:
            sp = req.sampling_params
            if (not req.output_token_ids  # its first token (a prompt's last token left to compute)
                    or token in sp.stop_token_ids or (not sp.ignore_eos and token in req.eos_token_ids)):
                return 0
            room = min(room, req.output_limit() - len(req.output_token_ids) - 1)
        return max(room, 0)

    def end_decode_run(self, steps: int, token: int, now: float) -> None:
        """``begin_decodes`` and ``end_decodes`` of ``steps`` consecutive decode-only steps that
        finish nobody (at most :meth:`decode_run_room`), the last ending at ``now``, once their
        blocks are allocated: each running request took ``steps`` tokens ``token``. No updates:
        the caller records the tokens (a simulator's run of steps)."""
        self._step_id += steps
        tokens = [token] * steps
        for req in self.running:
            req.num_computed_tokens += steps
            req.output_token_ids.extend(tokens)
            req.last_token_time = now
            self.kv.cache_blocks(req)

