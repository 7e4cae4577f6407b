"""DynaServe's execution predictor (Sec. 4.1, "Execution predictor within global scheduler"), pure.

The global scheduler balances the predicted time each instance of a pair needs to finish its
queue of micro-requests. A :class:`MicroRequest` is one part's remaining work on one instance;
:class:`ExecutionPredictor` runs a *virtual pass* over a queue of them the way the paper
describes it and returns the total time.

**The virtual passes** (FCFS, as the runtime; Sec. 4.1 "First-Come-First-Serve is the default"):

- running requests are visited in admission order; a decoding one advances one token; a
  prefilling one takes ``min(remaining prompt, budget left)`` tokens, and at least one ("every
  active request advances by at least one token per pass"). The budget left for a request is
  ``token_budget`` less what the requests ahead of it took;
- then waiting requests are admitted in FCFS order while ``max_num_seqs`` and the budget allow
  ("admits requests until the token budget or request limit is reached"); one admitted with a
  prompt left takes ``min(remaining prompt, budget left)``, one with only decoding left takes 1;
- optionally (``kv_capacity``, tokens; our addition, None in the paper's predictor) the KV pool is
  one more of "the same hardware constraints as the runtime": a request is admitted only when the
  KV it will hold at its end fits beside what the running requests will hold at theirs (or when
  nothing runs). An instance whose work is long contexts (a beta holding the tails of its
  requests) then takes longer, as it does on the engine, where it preempts;
- a pass lasts ``step_time(prefill tokens, mean context of its decodes after the pass, decode
  count[, prefix])``, the signature of :meth:`tidal.policies.profile_table.ProfileTable.predict`,
  which is what the runtime passes; ``prefix`` (given when not 0, to a model that takes a fourth
  argument) is the token-weighted mean KV position its prefill chunks start at, so a chunk deep into a long prompt is priced with the
  attention over its prefix (an 8,192-token prefill in 2,048-token chunks costs ~16 % more than
  four chunks at prefix 0 on an A100, Qwen-2.5-14B). When it returns ``None`` (an empty table) the pass costs a **token
  proxy**: ``proxy_s_per_token * max(proxy_min_tokens, tokens)``, a roofline in token units (a pass
  below ~128 tokens is bound by reading the weights; the default 0.1 ms per token is a 7-14B model
  on one A100: 2 * 14e9 FLOPs per token at ~280 TFLOP/s).

**Speed.** A pass-by-pass loop costs O(passes x requests). This one jumps: while no request is
admitted, finishes its prefill or finishes decoding, every pass has the same prefill tokens and
decode count and the decodes' mean context grows by one per pass; such a run of ``k`` passes is
charged ``k * step_time`` at the run's middle context (exact when the step time is linear in the
context, as the profile table's regression is; runs longer than ``max_run`` passes are cut, so a
table with cells stays close). Finishing decodes come off a heap. A queue of 100 requests with
1000 decode tokens each is predicted in about a millisecond.

**Delta** (Sec. 4.1: "every new request reuses the already-executed prefix of the timing arrays
and simulates only the delta it would add"): the new part of a split is last in FCFS order, so it
never changes how the queue before it progresses, pass by pass; only the passes it joins get
slower (and the timeline may grow a tail). :meth:`ExecutionPredictor.timeline` keeps a queue's
runs; :meth:`ExecutionPredictor.total_time_with` adds one part to it by walking only the runs it
overlaps. ``total_time_with(timeline(q), x) == total_time(q + [x])`` (tested).
"""

from __future__ import annotations

import heapq
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_PROXY_S_PER_TOKEN = 1e-4
DEFAULT_PROXY_MIN_TOKENS = 128
DEFAULT_MAX_RUN = 256


@dataclass(frozen=True, slots=True)
class MicroRequest:
    """One part's remaining work on one instance (DynaServe Sec. 3.1, micro-request).

    It computes ``prefill_tokens`` prompt tokens starting at KV position ``context``, then
    samples ``decode_tokens`` tokens. When it has a prefill and samples, the prefill's last chunk
    samples the first of them (it reaches the end of the prompt) and each other one is a decode
    pass; a part with only decoding left feeds its last token each pass. A part whose prefill
    stops inside the prompt (alpha with s < P) samples nothing.
    """

    request_id: str
    prefill_tokens: int
    context: int
    decode_tokens: int

    def __post_init__(self) -> None:
        if min(self.prefill_tokens, self.context, self.decode_tokens) < 0:
            raise ValueError(f"micro-request {self.request_id!r}: token counts must be >= 0, got "
                             f"prefill {self.prefill_tokens}, context {self.context}, decode {self.decode_tokens}")

    @property
    def decode_steps(self) -> int:
        """Passes that compute one token each after the prefill."""
        if self.prefill_tokens and self.decode_tokens:
            return self.decode_tokens - 1
        return self.decode_tokens

    @property
    def end(self) -> int:
        """KV length when the part is done."""
        return self.context + self.prefill_tokens + self.decode_steps

    @property
    def empty(self) -> bool:
        return not self.prefill_tokens and not self.decode_tokens


class StepTimeModel(Protocol):
    def __call__(self, prefill_tokens: float, mean_context: float, decode_count: float,
                 prefix: float = ...) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Run:
    """``k`` identical passes from pass ``q0``: ``p`` prefill tokens, ``d`` decodes whose contexts
    after pass q sum to ``s + d * q``; ``left`` budget after them, ``seats`` free, and whether the
    queue's waiting requests were all admitted (``open``: a later request could join)."""

    q0: int
    k: int
    p: int
    d: int
    s: int
    left: int
    seats: int
    open: bool
    t0: float
    dt: float
    kv_free: float = float("inf")  # KV tokens a later request could reserve
    x0: float = 0.0  # sum over the prefill chunks of tokens x prefix, at pass q0
    xg: float = 0.0  # ... its growth per pass (sum of the chunks' squared lengths)


@dataclass(frozen=True, slots=True)
class Timeline:
    runs: tuple[Run, ...]
    total: float
    passes: int


def _takes_prefix(f: StepTimeModel) -> bool:
    """Whether ``f`` takes a fourth positional argument (the prefill's prefix)."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 4


class _Pre:
    __slots__ = ("seq", "rem", "kv_end", "steps", "ahead", "held")

    def __init__(self, seq: int, rem: int, kv_end: int, steps: int, ahead: int, held: int):
        self.seq, self.rem, self.kv_end, self.steps, self.ahead = seq, rem, kv_end, steps, ahead
        self.held = held  # KV tokens reserved for it (its end)

    @property
    def pos(self) -> int:
        """The KV position its next chunk starts at (the chunk's prefix)."""
        return self.kv_end - self.rem


class ExecutionPredictor:
    def __init__(self, step_time: StepTimeModel, token_budget: int = 2048, max_num_seqs: int = 256,
                 proxy_s_per_token: float = DEFAULT_PROXY_S_PER_TOKEN,
                 proxy_min_tokens: int = DEFAULT_PROXY_MIN_TOKENS, max_run: int = DEFAULT_MAX_RUN,
                 kv_capacity: int | None = None):
        if token_budget < 1 or max_num_seqs < 1 or max_run < 1 or proxy_s_per_token <= 0:
            raise ValueError("execution predictor: token_budget, max_num_seqs and max_run must be >= 1, "
                             "proxy_s_per_token > 0")
        if kv_capacity is not None and kv_capacity < 1:
            raise ValueError(f"execution predictor: kv_capacity must be >= 1 token, got {kv_capacity}")
        self.kv_cap: float = float("inf") if kv_capacity is None else kv_capacity
        self.step_time, self.budget, self.max_seqs = step_time, token_budget, max_num_seqs
        self.prices_prefix = _takes_prefix(step_time)  # a 3-argument model is priced at prefix 0
        self.proxy_s, self.proxy_min, self.max_run = proxy_s_per_token, proxy_min_tokens, max_run

    # ------------------------------------------------------------------ one pass, one run
    def pass_time(self, p: float, mean_ctx: float, d: float, prefix: float = 0.0) -> float:
        t = (self.step_time(p, mean_ctx, d, prefix) if prefix > 0 and self.prices_prefix
             else self.step_time(p, mean_ctx, d))
        if t is None:  # no profile yet: the token proxy (module docstring)
            n = p + d
            return self.proxy_s * (n if n > self.proxy_min else self.proxy_min)
        return t

    def run_time(self, p: int, d: int, s: int, q: int, k: int, x: float = 0.0, xg: float = 0.0) -> float:
        """Time of passes q..q+k-1 with ``p`` prefill tokens and ``d`` decodes whose contexts after
        pass q sum to ``s + d*q``, the prefill chunks' tokens x prefix summing to ``x`` at pass q and
        growing by ``xg`` a pass: k times the middle pass, cut every ``max_run`` passes."""
        if d == 0 and not xg:
            return k * self.pass_time(p, 0.0, 0, x / p if p else 0.0)
        base = s / d + q if d else 0.0
        total, a, r = 0.0, 0, self.max_run
        while a < k:
            b = min(k, a + r)
            mid = (a + b - 1) * 0.5
            total += (b - a) * self.pass_time(p, base + mid if d else 0.0, d, (x + xg * mid) / p if p else 0.0)
            a = b
        return total

    # ------------------------------------------------------------------ a whole queue
    def total_time(self, queue: Sequence[MicroRequest]) -> float:
        """Seconds to finish every part of ``queue`` (FCFS order), from now."""
        return self.timeline(queue).total

    def timeline(self, queue: Sequence[MicroRequest]) -> Timeline:
        B, S = self.budget, self.max_seqs
        waiting = [m for m in queue if not m.empty]
        wi = 0
        pre: list[_Pre] = []  # running prefills, admission order
        dec: list[tuple[int, int, int, int]] = []  # heap of (end pass, context offset, admission seq, KV held)
        d = s_off = 0  # running decodes; sum of their context offsets (context after pass q = off + q)
        cap, held = self.kv_cap, 0  # KV reserved by the running requests (each for its end)
        q, t, seq = 0, 0.0, 0
        runs: list[Run] = []
        while wi < len(waiting) or pre or d:
            # compose pass q: running prefills (decodes ahead of each take one token each)
            chunks: list[int] = []
            taken = 0
            x0 = xg = 0.0  # the chunks' tokens x prefix, and its growth per pass
            for x in pre:
                bl = B - x.ahead - taken
                c = min(x.rem, bl if bl > 1 else 1)
                chunks.append(c)
                taken += c
                x0 += c * x.pos
                xg += c * c
            left = B - d - taken
            admitted = False
            while wi < len(waiting) and d + len(pre) < S and left > 0 and (
                    held + waiting[wi].end <= cap or not (d or pre)):
                m = waiting[wi]
                wi += 1
                seq += 1
                admitted = True
                held += m.end
                if m.prefill_tokens:
                    c = min(m.prefill_tokens, left)
                    pre.append(_Pre(seq, m.prefill_tokens, m.context + m.prefill_tokens, m.decode_steps, d, m.end))
                    chunks.append(c)
                    taken += c
                    left -= c
                    x0 += c * m.context
                    xg += c * c
                else:  # decode only: one token this pass, context after = context + 1
                    off = m.context + 1 - q
                    heapq.heappush(dec, (q + m.decode_steps, off, seq, m.end))
                    d += 1
                    s_off += off
                    left -= 1
            p = taken
            # how many identical passes: none is admitted, no prefill completes, no decode ends
            k = 1
            if not admitted:
                k = 1 << 60
                for x, c in zip(pre, chunks, strict=True):
                    k = min(k, (x.rem - 1) // c)
                if dec:
                    k = min(k, dec[0][0] - q)
                k = max(k, 1)
            if k == 1:
                xg = 0.0
            dt = self.run_time(p, d, s_off, q, k, x0, xg)
            runs.append(Run(q, k, p, d, s_off, left, S - d - len(pre), wi == len(waiting), t, dt, cap - held, x0, xg))
            t += dt
            q += k
            # apply: prefills advance; completed ones decode from the next pass or leave
            done: list[_Pre] = []
            for x, c in zip(pre, chunks, strict=True):
                x.rem -= c * k
                if x.rem <= 0:
                    done.append(x)
            for x in done:
                pre.remove(x)
                if x.steps:
                    off = x.kv_end - (q - 1)
                    heapq.heappush(dec, (q + x.steps, off, x.seq, x.held))
                    d += 1
                    s_off += off
                    for y in pre:  # a decode now runs ahead of the later prefills
                        if y.seq > x.seq:
                            y.ahead += 1
                else:
                    held -= x.held
            while dec and dec[0][0] <= q:
                _, off, sq, kv = heapq.heappop(dec)
                d -= 1
                s_off -= off
                held -= kv
                for y in pre:
                    if y.seq > sq:
                        y.ahead -= 1
        return Timeline(tuple(runs), t, q)

    # ------------------------------------------------------------------ one more part, at the end
    def total_time_with(self, tl: Timeline, part: MicroRequest | None) -> float:
        """``total_time(queue + [part])`` from ``timeline(queue)``: only the passes ``part`` joins
        are recomputed (it is last in FCFS order, so the queue before it progresses as without it)."""
        return self.times_with(tl, part)[0]

    def times_with(self, tl: Timeline, part: MicroRequest | None) -> tuple[float, float]:
        """(:meth:`total_time_with`, seconds until ``part``'s last prefill pass ends): when it samples
        its first token, if it samples (0 for a part without prefill: it feeds a token it has)."""
        if part is None or part.empty:
            return tl.total, 0.0
        done_at = 0.0
        B = self.budget
        rem, steps = part.prefill_tokens, part.decode_steps
        off = 0  # the part's context after pass q is off + q while it decodes
        admitted = False
        total = 0.0
        q = 0
        runs = tl.runs
        i, n = 0, len(runs)
        while i < n:
            r = runs[i]
            if not admitted:
                if not (r.open and r.seats >= 1 and r.left >= 1 and (r.kv_free >= part.end or not (r.d or r.p))):
                    total += r.dt
                    i += 1
                    continue
                admitted = True
                q = r.q0
                if not rem:  # decode only: joins this pass
                    off = part.context + 1 - q
            end = r.q0 + r.k
            while q < end and (rem or steps):
                rx = r.x0 + r.xg * (q - r.q0)  # the queue's chunks' tokens x prefix at pass q
                if rem:  # prefilling behind the queue: the budget it leaves, at least one token
                    c = r.left if r.left > 1 else 1
                    j = (rem - 1) // c if rem > c else 0
                    j = min(j, end - q)
                    pos = part.context + part.prefill_tokens - rem  # its chunk's prefix
                    if j:
                        total += self.run_time(r.p + c, r.d, r.s, q, j, rx + c * pos, r.xg + c * c)
                        rem -= c * j
                        q += j
                        continue
                    total += self.run_time(r.p + rem, r.d, r.s, q, 1, rx + rem * pos)
                    q += 1
                    rem = 0
                    done_at = total
                    off = part.context + part.prefill_tokens - (q - 1)
                    if steps == 0:
                        break
                    continue
                j = min(steps, end - q)
                total += self.run_time(r.p, r.d + 1, r.s + off, q, j, rx, r.xg)
                steps -= j
                q += j
            if q < end:  # the part is done inside this run: the rest of the run as before
                total += self.run_time(r.p, r.d, r.s, q, end - q, r.x0 + r.xg * (q - r.q0), r.xg)
            q = end
            i += 1
            if not rem and not steps:
                total += sum(x.dt for x in runs[i:])
                return total, done_at
        # past the queue's end: the part alone
        if not admitted:
            q = tl.passes
            if not rem:
                off = part.context + 1 - q
        if rem:
            j = (rem - 1) // B
            pos = part.context + part.prefill_tokens - rem
            if j:
                total += self.run_time(B, 0, 0, q, j, B * pos, B * B)
                rem -= B * j
                q += j
                pos += B * j
            total += self.run_time(rem, 0, 0, q, 1, rem * pos)
            done_at = total
            q += 1
            off = part.context + part.prefill_tokens - (q - 1)
        if steps:
            total += self.run_time(0, 1, off, q, steps)
        return total, done_at


__all__ = ["MicroRequest", "Run", "StepTimeModel", "ExecutionPredictor", "Timeline"]
