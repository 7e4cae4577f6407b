"""``--kv-pressure auto``: how long each response to a throttle would take (pure).

At a throttle onset (:mod:`tidal.cluster.pressure.throttle`: the head of an instance's queue does
not fit its free KV) the queue lacks ``S`` blocks. No response creates that memory on the instance
itself except a drop; the four responses, each at its own price:

- **recompute** (vLLM's preemption): the victims -- the running requests the scheduler preempts,
  the lowest priority and latest arrival first, when their growth finds no free block while the
  queue waits for memory (:func:`admit_walk`) -- drop their KV and re-run their prompt and output
  so far, first in the queue;
- **swap** (InferCept-like): the same victims' KV goes to host memory and comes back (out and in
  over the host link), as far as the host pool holds them; the rest recompute;
- **migrate** (Llumnix-like, KunServe Sec. 2.3): decoding requests, the smallest first, move with
  their KV to the peers with the most room (:func:`tidal.cluster.pressure.plan_migrations`'s
  packing) until they cover ``S``; the queue waits for their KV to cross the link (the source frees a
  request's blocks when its last chunk lands); what the peers cannot take the queue waits for, as above
  (when they take nothing the prediction is recompute's, marked :attr:`Prediction.same_as`);
- **drop** (KunServe Sec. 4.1): the drop plan (Fig. 6) merges the instance with a peer into a
  pipeline; the group's pool gains the freed weights and takes the peers' spare KV, and the group's
  queue (every member's) runs on ``n`` instances' compute, less the pipeline's price: each stage
  pays a step's fixed overhead per microbatch and each microbatch crosses ``n - 1`` stage
  boundaries (its bubbles); what the freed memory cannot cover the queue waits for, as above.

Each is predicted as the seconds until the queued demand, and what the response displaces to make
room for it, are served: the queue's prefill under that response, or the wait for the memory the
response does not create, whichever is later -- the queue is admitted and prefilled as memory
frees, so the two overlap -- plus what the displaced requests need once memory is back (the
victims' re-prefill, or their swap copies) and what the response puts on the path first (the
migration transfers, the pipeline's bubbles). The memory: the ``S``
blocks (less what a migration or a drop brings) must come from requests finishing. With the queue
known (:attr:`Episode.queue`) that is :func:`admit_walk`: decode steps of the instance's measured
step time until the queue's last request is admitted, memory recycling through the running
requests and through the queued ones once admitted (each gives its blocks back after its output);
without it, :func:`drain_steps`: until running requests alone have freed ``S`` (their remaining
tokens, growing a token a step meanwhile). A preempted victim waits for that memory before it runs
again, and new arrivals queue behind it.

The overlap and the queue's recycling are a revision (the first version added the wait to the
prefill and drained through the running requests only): an audit of the baselines' own runs
(:mod:`tidal.sim.auto_audit`: recompute and swap, each onset's prediction beside when its queue was
served) found preemption predicted about 3x longer than it took, and drop about 1.6x shorter.

The victims as the growth's lack are a second revision: the first versions preempted victims
until their blocks covered the queue's shortage, which no scheduler here does (a throttle preempts
nothing; the queue waits). The audit of that version (commit 6ae761f's page) found recompute's
predictions, which carried the victims' re-prefill, well above what happened where swap's, whose
copies are cheap, came close, so that the learned scales made recompute look faster than swap
where swap served the queue sooner. Without the queue known the shortage's victims remain.

Prefill is priced by KunServe's Eq. 1 with the coefficients the shell's cost model gives
(:class:`Prices`: the simulator's analytic or profiled model; the runtime hands the same model in),
so the prediction and the simulator price a chunk alike; the step time is the monitor's. Everything
the prediction reads is in an :class:`Episode` and a :class:`Prices`, both plain data, so a
recorded choice can be replayed.

Not predicted: the running requests' stall while their KV moves (migration, the drop's exchange),
a pipeline's longer decode steps (TPOT), a later restore's weight load, and arrivals after the onset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tidal.cluster.pressure.lookahead import ChunkCost

TECHNIQUES = ("recompute", "swap", "migrate", "drop")


@dataclass(frozen=True)
class Prices:
    """What the shell's cost model says, as the prediction needs it (seconds, bytes)."""

    chunk: ChunkCost  # Eq. 1: seconds per attention pair, per token, per chunk (marginal, compute-bound step)
    token_budget: int  # tokens a step takes (the prefill chunk's size)
    step_overhead_s: float  # the fixed cost of a step; each pipeline stage pays it
    kv_bytes_per_token: int  # all layers, all tensor-parallel shards
    block_size: int
    host_bytes_per_s: float  # device <-> host (swap); 0: no host link
    link_bytes_per_s: float  # instance <-> instance (migration, exchange, activations)
    link_latency_s: float  # one chunk's fixed cost on that link
    chunks_per_request: int = 1  # a request's KV crosses the link in this many chunks
    hidden_bytes: int = 0  # one token's activation between two pipeline stages

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.block_size < 1 or self.kv_bytes_per_token < 1 or self.chunks_per_request < 1:
            raise ValueError("prices need token_budget, block_size, kv_bytes_per_token and chunks_per_request >= 1")
        if min(self.step_overhead_s, self.host_bytes_per_s, self.link_bytes_per_s, self.link_latency_s,
               self.hidden_bytes) < 0:
            raise ValueError("prices must be >= 0")

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.kv_bytes_per_token

    def prefill_s(self, tokens: int, requests: int = 1) -> float:
        """Eq. 1 over ``requests`` prompts of ``tokens`` in all (equal lengths), each from prefix 0 in
        chunks of the budget: the causal pairs of a prompt of m tokens are m(m + 1) / 2 however it is
        chunked; each step also pays its fixed overhead."""
        if tokens <= 0:
            return 0.0
        k = max(1, requests)
        m = tokens / k
        c = self.chunk
        chunks = k * math.ceil(m / self.token_budget)
        steps = math.ceil(tokens / self.token_budget)
        return c.alpha * k * m * (m + 1) / 2 + c.beta * tokens + c.gamma * chunks + self.step_overhead_s * steps

    def kv_transfer_s(self, tokens: int, requests: int = 1) -> float:
        """``requests`` requests' KV of ``tokens`` tokens in all over the instance link, one after the other."""
        if tokens <= 0:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.link_bytes_per_s + requests * self.chunks_per_request * \
            self.link_latency_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prices:
        return cls(**{**d, "chunk": ChunkCost(**d["chunk"])})


@dataclass(frozen=True)
class Victim:
    """A running request as a response sees it: its tokens (prompt and output so far, all with KV),
    its KV blocks, and whether it is decoding (may migrate)."""

    tokens: int
    blocks: int
    decoding: bool = True
    remaining: int = 0  # output tokens it may still produce (its max_tokens less those it has)
    rid: str = ""  # a queued request's id: ``auto`` learns when the queue it chose for was served


@dataclass(frozen=True)
class DropOption:
    """What the drop plan (Fig. 6) would do for this throttle: ``members`` of the group the instance
    would run in (0: no plan), the blocks the dropped weights free in its pool, the peers' spare
    blocks the group's pool takes, the whole group's queue, and the running KV that changes stage."""

    members: int = 0
    freed_blocks: int = 0
    peer_room_blocks: int = 0
    queued_tokens: int = 0
    queued_requests: int = 0
    exchange_tokens: int = 0
    why_not: str = ""  # members 0: why there is no plan now
    blocked: bool = False  # no plan only because a change of groups or a migration is under way


@dataclass(frozen=True)
class Episode:
    """One throttle onset, as the prediction reads it (all plain data: a record replays from it)."""

    index: int  # the throttled instance (a group's first stage)
    shortage_blocks: int  # what the whole queue lacks (Sec. 4.1's R, in blocks)
    queued_tokens: int  # prompt tokens waiting for their prefill here
    queued_requests: int
    running: tuple[Victim, ...]  # in the scheduler's preemption order (the first goes first)
    host_free_blocks: int  # room in the host pool (swap)
    peer_room: tuple[int, ...]  # blocks each peer a request may migrate to can take
    step_s: float  # the instance's step time, as the monitor measures it
    drop: DropOption = field(default_factory=DropOption)
    alone: bool = True  # False: a pipeline group, whose KV is spread over its stages (no swap, no migration)
    # the requests waiting here for their first token, in queue order (tokens: prompt; blocks: what
    # admitting one takes; remaining: its max_tokens); empty: not known (the drain ignores the queue)
    queue: tuple[Victim, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        return cls(**{**d, "running": tuple(Victim(**v) for v in d["running"]), "peer_room": tuple(d["peer_room"]),
                      "drop": DropOption(**d["drop"]), "queue": tuple(Victim(**v) for v in d.get("queue", ()))})


@dataclass(frozen=True)
class Prediction:
    """A response's predicted seconds (``inf``: it cannot run now) and the terms they add up from."""

    technique: str
    seconds: float
    terms: dict[str, float] = field(default_factory=dict)
    note: str = ""
    # the response this prediction amounts to, when it is another's: a migration that moves nothing leaves the
    # queue to the scheduler's recompute (its preemption mode), so the choice scales and learns it as recompute
    same_as: str = ""

    @property
    def acts_as(self) -> str:
        """The response this prediction is scaled and learned as: ``same_as``, else its own."""
        return self.same_as or self.technique

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": None if math.isinf(self.seconds) else self.seconds,
                "terms": {k: round(v, 6) for k, v in self.terms.items()}, **({"note": self.note} if self.note else {}),
                **({"same_as": self.same_as} if self.same_as else {})}


def _victims(running: Sequence[Victim], need: int) -> list[Victim]:
    """The scheduler's victims, in its order, until their blocks cover ``need``."""
    out, freed = [], 0
    for v in running:
        if freed >= need:
            break
        out.append(v)
        freed += v.blocks
    return out


def _recompute_s(prices: Prices, victims: Sequence[Victim]) -> float:
    return sum(prices.prefill_s(v.tokens) for v in victims)


def drain_steps(running: Sequence[Victim], need: int, block_size: int) -> int:
    """Decode steps until running requests finishing free ``need`` blocks net of the others' growth
    (a token a step each): after ``k`` steps those with at most ``k`` tokens left have given back
    the blocks they hold now (and what they grew meanwhile), the others hold ``k`` tokens more. The
    last one's end when that never suffices."""
    if need <= 0 or not running:
        return 0
    order = sorted(running, key=lambda v: v.remaining)
    freed = 0.0
    for j, v in enumerate(order):
        k = max(v.remaining, 0)
        freed += v.blocks
        still = len(order) - j - 1
        if freed - still * k / block_size >= need:
            return k
    return max(order[-1].remaining, 0)


def admit_walk(running: Sequence[Victim], queue: Sequence[Victim], free_blocks: float,
               block_size: int) -> tuple[int, int]:
    """Decode steps until the last of ``queue`` is admitted, memory recycling as it does in a running
    engine: a running request gives its blocks back when its remaining tokens are out, a queued one
    once admitted (after its prefill step) gives its own back after its output, and every request
    holding KV grows a token a step meanwhile. ``free_blocks``: what the pool has for the queue now.
    A request that even every finish before it leaves no room for is taken in at the last of them
    (nothing later can help it), and the queue goes on behind it.

    Also the blocks the growth lacks on the way (the most the free memory runs below zero just before
    a finish gives blocks back): what the scheduler preempts, as vLLM does when a decode finds no free
    block -- the throttle itself preempts nothing, the queue waits."""
    import heapq

    ends = [(max(v.remaining, 0), 0, v.blocks) for v in running]  # (finish step, start step, blocks held)
    heapq.heapify(ends)
    base, k = float(free_blocks), 0
    active, starts = len(ends), 0  # growth by step k: (active * k - starts) / block_size
    lack = 0.0

    def free(step: int) -> float:
        return base - (active * step - starts) / block_size

    for q in queue:
        while free(k) < q.blocks and ends:
            fin, start, blocks = heapq.heappop(ends)
            k = max(k, fin)
            lack = max(lack, -free(k))  # just before this finish gives its blocks back
            base += blocks  # what it grew meanwhile leaves the growth term as it leaves
            active, starts = active - 1, starts - start
        base -= q.blocks
        heapq.heappush(ends, (k + 1 + max(q.remaining, 0), k + 1, q.blocks))
        active, starts = active + 1, starts + k + 1
    return k, math.ceil(lack)


def _drain(e: Episode, p: Prices, need: int, running: Sequence[Victim] | None = None) -> tuple[float, int, int]:
    """The memory wait and the blocks to preempt. With the queue known: until its last request is
    admitted (:func:`admit_walk`), and what the running requests' growth lacks on the way; else until
    running requests finishing free ``need``, and ``need`` itself (the queue's shortage: the first
    version's victims, kept where the queue is not known)."""
    running = e.running if running is None else running
    if e.queue and need > 0:
        steps, lack = admit_walk(running, e.queue, sum(q.blocks for q in e.queue) - need, p.block_size)
    else:
        steps, lack = drain_steps(running, need, p.block_size), need
    return steps * e.step_s, steps, lack


def predict_recompute(e: Episode, p: Prices) -> Prediction:
    wait, steps, lack = _drain(e, p, e.shortage_blocks)
    vs = _victims(e.running, lack)
    queue, again = p.prefill_s(e.queued_tokens, e.queued_requests), _recompute_s(p, vs)
    return Prediction("recompute", max(wait, queue) + again,
                      {"memory_wait_s": wait, "queue_prefill_s": queue, "recompute_s": again, "drain_steps": steps,
                       "victims": len(vs), "victim_tokens": sum(v.tokens for v in vs)})


def predict_swap(e: Episode, p: Prices) -> Prediction:
    if not e.alone:
        return Prediction("swap", math.inf, note="a pipeline group does not swap: a copy here lacks its stages' layers")
    wait, steps, lack = _drain(e, p, e.shortage_blocks)
    vs = _victims(e.running, lack)
    room, swapped, rest = e.host_free_blocks, [], []
    for v in vs:  # the scheduler swaps while the host pool holds a victim, else recomputes it
        if p.host_bytes_per_s > 0 and v.blocks <= room:
            swapped.append(v)
            room -= v.blocks
        else:
            rest.append(v)
    blocks = sum(v.blocks for v in swapped)
    copy = 2 * blocks * p.block_bytes / p.host_bytes_per_s if blocks else 0.0  # out, then back in
    queue, again = p.prefill_s(e.queued_tokens, e.queued_requests), _recompute_s(p, rest)
    return Prediction("swap", max(wait, queue) + copy + again,
                      {"memory_wait_s": wait, "queue_prefill_s": queue, "swap_copy_s": copy, "recompute_s": again,
                       "drain_steps": steps, "swapped": len(swapped), "swapped_blocks": blocks, "recomputed": len(rest)},
                      "" if not rest else "the host pool holds only part of the victims: the rest recompute")


def predict_migrate(e: Episode, p: Prices) -> Prediction:
    if not e.alone:
        return Prediction("migrate", math.inf, note="a pipeline group's requests do not migrate")
    room = list(e.peer_room)
    moved: list[Victim] = []
    freed = 0
    for v in sorted((v for v in e.running if v.decoding), key=lambda v: v.blocks):  # Llumnix: the cheapest first
        if freed >= e.shortage_blocks or not room:
            break
        k = max(range(len(room)), key=lambda i: (room[i], -i))
        if room[k] < v.blocks:
            continue
        room[k] -= v.blocks
        freed += v.blocks
        moved.append(v)
    lack = max(0, e.shortage_blocks - freed)
    left = [v for v in e.running if v not in moved]
    wait, steps, short = _drain(e, p, lack, left)  # nothing lacking: no wait, no victim
    rest = _victims(left, short)
    transfer = p.kv_transfer_s(sum(v.tokens for v in moved), len(moved))  # the queue starts when the KV has landed
    queue, again = p.prefill_s(e.queued_tokens, e.queued_requests), _recompute_s(p, rest)
    return Prediction("migrate", transfer + max(wait, queue) + again,
                      {"transfer_s": transfer, "memory_wait_s": wait, "queue_prefill_s": queue, "recompute_s": again,
                       "drain_steps": steps, "moved": len(moved), "moved_blocks": freed, "recomputed": len(rest)},
                      "" if moved else "no peer has room for a decoding request: it recomputes",
                      "" if moved else "recompute")


def predict_drop(e: Episode, p: Prices) -> Prediction:
    d = e.drop
    if d.members < 2:
        return Prediction("drop", math.inf, note=d.why_not or "no drop plan now")
    n = d.members
    relief = d.freed_blocks + max(0, d.peer_room_blocks)
    lack = max(0, e.shortage_blocks - relief)
    wait, steps, short = _drain(e, p, lack)
    rest = _victims(e.running, short)
    work, again = p.prefill_s(d.queued_tokens, d.queued_requests), _recompute_s(p, rest)
    # a group step runs n microbatches of a step's budget (Sec. 4.3): each stage pays a step's fixed
    # overhead per microbatch (n where one instance paid 1 for the same tokens) and each microbatch's
    # activations cross n - 1 stage boundaries; the n-fold compute covers the rest
    group_steps = math.ceil(max(d.queued_tokens, 1) / (n * p.token_budget))
    hop = p.link_latency_s + p.token_budget * p.hidden_bytes / p.link_bytes_per_s if p.link_bytes_per_s else 0.0
    bubbles = group_steps * (n - 1) * (p.step_overhead_s + hop)
    return Prediction("drop", max(wait, work / n) + again / n + bubbles,
                      {"memory_wait_s": wait, "group_prefill_s": work / n, "pipeline_s": bubbles, "drain_steps": steps,
                       "members": n, "freed_blocks": d.freed_blocks, "peer_room_blocks": d.peer_room_blocks,
                       "recomputed": len(rest), "exchange_s (off the queue's path)": p.kv_transfer_s(d.exchange_tokens)},
                      "" if not lack else "the freed memory covers only part of the shortage: the queue waits for the rest")


PREDICTORS = {"recompute": predict_recompute, "swap": predict_swap, "migrate": predict_migrate,
              "drop": predict_drop}


def predict(e: Episode, p: Prices, techniques: Sequence[str] = TECHNIQUES) -> dict[str, Prediction]:
    """Every allowed response's prediction for episode ``e``."""
    return {t: PREDICTORS[t](e, p) for t in techniques}


__all__ = ["PREDICTORS", "TECHNIQUES", "DropOption", "Episode", "Prediction", "Prices", "Victim", "admit_walk",
           "drain_steps", "predict", "predict_drop", "predict_migrate", "predict_recompute", "predict_swap"]
