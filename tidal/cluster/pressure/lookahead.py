"""Lookahead microbatches for a pipeline group (KunServe Sec. 4.3, Fig. 10-11, App. A.1) (pure).

After a drop a group runs as a pipeline, and a microbatch that takes longer than its
neighbours leaves the other stages idle (bubbles, Fig. 8). Token-count chunking (Sarathi, vLLM:
:func:`token_microbatches`) balances tokens, not time: attention is quadratic in a chunk's
length, and a later chunk of a request also attends over the earlier ones (Fig. 17). Under
throttling many requests are queued, so KunServe looks ahead over all of them and splits by
*cost*:

- the cost of a chunk of ``c`` tokens after a prefix of ``p`` (Eq. 1)::

      cost = alpha * (p*c + (c*c + c) / 2) + beta * c + gamma
             (prefix-attn)  (self-attn)      (mlp)    (other)

  and a microbatch costs the sum of its chunks (Eq. 2-3): :class:`ChunkCost`;
- Fig. 11's divide and conquer: start with one microbatch holding every chunk; split it into
  two halves of equal cost -- cutting a request's chunk where needed, the second part's prefix
  grown by the first part -- and recurse on each half, until a microbatch has no more than
  ``min_tokens`` tokens (or ``max_microbatches`` is reached): :func:`lookahead_microbatches`.

What a pipeline then takes: :func:`pipeline_makespan` (one pass of the microbatches through the
stages; App. A.1's Eq. 4 is its two-stage bound, :func:`eq4_cost`) and :func:`pipeline_period`
(microbatches that come back for their next token, the steady state a serving pipeline is in).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """``tokens`` tokens of request ``request_id`` after ``prefix`` tokens whose KV exists."""

    request_id: str
    prefix: int
    tokens: int


Microbatch = list[Span]


@dataclass(frozen=True)
class ChunkCost:
    """KunServe Eq. 1 with its three coefficients (seconds per attention pair, per token, per chunk)."""

    alpha: float
    beta: float
    gamma: float

    def __post_init__(self) -> None:
        if min(self.alpha, self.beta, self.gamma) < 0:
            raise ValueError("alpha, beta and gamma must be >= 0")

    def chunk(self, prefix: int, tokens: int) -> float:
        """Eq. 1: prefix-attn + self-attn + MLP + other."""
        return self.alpha * (prefix * tokens + (tokens * tokens + tokens) / 2) + self.beta * tokens + self.gamma

    def batch(self, spans: Sequence[Span]) -> float:
        """Eq. 3: a microbatch costs the sum of its chunks."""
        return sum(self.chunk(s.prefix, s.tokens) for s in spans)


def eq1_features(prefix: int, tokens: int) -> tuple[float, float, float]:
    """Eq. 1's terms of one chunk: (attention pairs, tokens, 1)."""
    return prefix * tokens + (tokens * tokens + tokens) / 2, float(tokens), 1.0


def fit_chunk_cost(points: Sequence[tuple[int, int, float]], relative: bool = False) -> ChunkCost:
    """Eq. 1's alpha, beta, gamma "profiled offline" (Sec. 4.3): least squares over ``points`` of
    (prefix, tokens, measured cost), absolute error (or, ``relative``, error over the cost). A
    negative coefficient is dropped (set to 0) and the others refitted, so the cost stays monotone.
    Exact (to float error) when the costs are Eq. 1 of non-negative coefficients."""
    import numpy as np

    if len(points) < 3:
        raise ValueError(f"fitting Eq. 1 needs at least 3 points, got {len(points)}")
    a = np.array([eq1_features(p, c) for p, c, _ in points], dtype=float)
    y = np.array([t for _, _, t in points], dtype=float)
    if relative:
        if (y <= 0).any():
            raise ValueError("a relative fit needs positive costs")
        a, y = a / y[:, None], np.ones_like(y)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    keep = [0, 1, 2]
    while True:  # columns scaled to 1 for conditioning: pairs grow with the square of the tokens
        coef = np.linalg.lstsq(a[:, keep] / scale[keep], y, rcond=None)[0] / scale[keep]
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0, 0.0, 0.0]
    for k, v in zip(keep, coef, strict=True):
        out[k] = max(0.0, float(v))
    return ChunkCost(*out)


def num_tokens(spans: Sequence[Span]) -> int:
    return sum(s.tokens for s in spans)


def _cut(prefix: int, tokens: int, room: float, cost: Callable[[int, int], float]) -> int:
    """The first-part length ``t`` in ``[1, tokens - 1]`` whose cost is nearest ``room``."""
    lo, hi = 1, tokens - 1
    while lo < hi:  # the largest t with cost(prefix, t) <= room (cost grows with t)
        mid = (lo + hi + 1) // 2
        if cost(prefix, mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    best = lo
    if lo + 1 <= tokens - 1 and abs(cost(prefix, lo + 1) - room) < abs(cost(prefix, lo) - room):
        best = lo + 1
    return best


def split(spans: Sequence[Span], target: float, cost: Callable[[int, int], float]) -> tuple[Microbatch, Microbatch]:
    """Fig. 11's ``b.split(target)``: the chunks in order fill a first microbatch up to ``target``;
    the chunk that crosses it is cut so the first part's cost is nearest what is left (a chunk
    of one token stays whole, on the side that leaves the halves closest)."""
    first: Microbatch = []
    acc = 0.0
    for k, s in enumerate(spans):
        c = cost(s.prefix, s.tokens)
        if acc + c <= target:
            first.append(s)
            acc += c
            continue
        room = target - acc
        rest = list(spans[k + 1:])
        # the nearest of: leave it to the second half, take it whole, cut it
        options = [(room, first, [s, *rest]), (c - room, first + [s], rest)]
        if s.tokens > 1:
            t = _cut(s.prefix, s.tokens, room, cost)
            head, tail = Span(s.request_id, s.prefix, t), Span(s.request_id, s.prefix + t, s.tokens - t)
            options.append((abs(cost(head.prefix, head.tokens) - room), first + [head], [tail, *rest]))
        _, a, b = min(options, key=lambda o: o[0])
        return a, b
    return first, []


def lookahead_microbatches(spans: Sequence[Span], cost: ChunkCost, min_tokens: int,
                           max_microbatches: int | None = None) -> list[Microbatch]:
    """Fig. 11: cost-balanced microbatches of ``spans`` (the scheduled chunks in order). A
    microbatch of at most ``min_tokens`` tokens is not split ("don't chunk if with few
    tokens"); ``max_microbatches`` bounds the recursion's depth to ``ceil(log2(max))``. The
    parts of a cut request stay in order (the earlier tokens in the earlier microbatch)."""
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    depth_cap = math.ceil(math.log2(max_microbatches)) if max_microbatches else 64
    spans = [s for s in spans if s.tokens > 0]
    if not spans:
        return []

    def balance(b: Microbatch, depth: int) -> list[Microbatch]:
        if num_tokens(b) <= min_tokens or depth >= depth_cap:
            return [b]
        b0, b1 = split(b, 0.5 * cost.batch(b), cost.chunk)
        if not b0 or not b1:
            return [b]
        return balance(b0, depth + 1) + balance(b1, depth + 1)

    return balance(spans, 0)


def token_microbatches(spans: Sequence[Span], num_microbatches: int) -> list[Microbatch]:
    """The token-count baseline (Sarathi / vLLM pipelines, Fig. 17a): consecutive microbatches of
    ``ceil(tokens / num_microbatches)`` tokens each, cutting a chunk at the budget."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    rest = [s for s in spans if s.tokens > 0]
    budget = math.ceil(num_tokens(rest) / num_microbatches) if rest else 0
    out: list[Microbatch] = []
    while rest:
        head: Microbatch = []
        room = budget
        while rest and room > 0:
            s = rest[0]
            if s.tokens <= room:
                head.append(rest.pop(0))
                room -= s.tokens
            else:
                head.append(Span(s.request_id, s.prefix, room))
                rest[0] = Span(s.request_id, s.prefix + room, s.tokens - room)
                room = 0
        out.append(head)
    return out


def pipeline_makespan(stage_costs: Sequence[Sequence[float]], transfer_s: float = 0.0) -> float:
    """One pass of ``m`` microbatches through ``S`` stages (``stage_costs[s][k]``: stage ``s`` on
    microbatch ``k``), each stage taking them in order, ``transfer_s`` per stage boundary."""
    if not stage_costs or not stage_costs[0]:
        return 0.0
    finish = [0.0] * len(stage_costs[0])
    for s, costs in enumerate(stage_costs):
        free = 0.0
        for k, c in enumerate(costs):
            ready = finish[k] + (transfer_s if s else 0.0)
            finish[k] = free = max(free, ready) + c
    return max(finish)


def eq4_cost(costs: Sequence[float]) -> float:
    """App. A.1 Eq. 4: ``cost_b1 + sum_k max(cost_bk, cost_bk+1) + cost_bm`` (two stages, a
    microbatch costing the same on both); an upper bound of :func:`pipeline_makespan` there."""
    if not costs:
        return 0.0
    return costs[0] + sum(max(a, b) for a, b in zip(costs, costs[1:], strict=False)) + costs[-1]


def pipeline_period(stage_costs: Sequence[Sequence[float]], transfer_s: float = 0.0) -> float:
    """The time between two tokens of every request when the microbatches circulate: a
    microbatch comes back to the first stage once its last stage is done (a decode needs its
    previous token). The period is the slower of the busiest stage (its work, back to back) and
    the slowest microbatch's trip through every stage (others wait for it: Fig. 8's bubbles)."""
    if not stage_costs or not stage_costs[0]:
        return 0.0
    busiest = max(sum(costs) for costs in stage_costs)
    trip = max(sum(stage[k] for stage in stage_costs) for k in range(len(stage_costs[0])))
    return max(busiest, trip + transfer_s * (len(stage_costs) - 1))


def bubble_ratio(stage_costs: Sequence[Sequence[float]], period: float) -> float:
    """The share of the stages' time spent idle in one period (Sec. 5.3's bubble time)."""
    if period <= 0 or not stage_costs:
        return 0.0
    return max(0.0, 1.0 - sum(sum(c) for c in stage_costs) / (len(stage_costs) * period))


__all__ = ["ChunkCost", "Microbatch", "Span", "bubble_ratio", "eq4_cost", "lookahead_microbatches", "num_tokens",
           "pipeline_makespan", "pipeline_period", "split", "token_microbatches"]
