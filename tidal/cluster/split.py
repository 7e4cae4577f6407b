"""DynaServe's global scheduler: where to split each request, and on which pair (pure).

DynaServe (Sec. 3.1) splits a request of prompt ``P`` and predicted output ``D`` (``L = P + D``)
at a token ``s`` into two micro-requests: r^alpha computes the KV of tokens ``[0, s)`` on one
instance, r^beta continues from that KV on another. The global scheduler (Sec. 4.1, Alg. 1)
picks ``s`` by a bounded binary search on the split ratio phi that balances the predicted time
each instance of the pair needs for all its work (the ledgers of outstanding micro-requests,
the "current server load"), with :class:`~tidal.cluster.split_predict.ExecutionPredictor`.

What a split point means (:func:`split_parts`; ``s`` is clamped to ``[0, L]``):

- ``s == 0``: the whole request runs on beta (no alpha part, no hand-off);
- ``0 < s < P``: alpha prefills the first ``s`` prompt tokens and samples nothing; beta prefills
  the other ``P - s`` (from KV position ``s``), samples the first token and decodes the rest;
- ``P <= s < L - 1``: alpha prefills the prompt and decodes; it has sampled ``s - P + 1`` tokens
  when its KV covers ``[0, s)`` (``s == P`` is P/D disaggregation: alpha samples the first
  token); beta samples the other ``D - (s - P + 1)``, feeding the last token alpha sampled;
- ``s >= L - 1``: the whole request runs on alpha (when its KV covers ``[0, L - 1)`` it has
  sampled all ``D`` tokens: nothing is left for beta).

So alpha's and beta's sampled tokens always add up to ``D``, and the runtime pauses alpha with
``Request.pause_at = s`` (the engine computes no KV past it).

Pairs (Sec. 6.1: "1 GPU each for r^alpha and r^beta"): instance ``2k`` is the alpha and ``2k+1``
the beta of pair ``k`` (:func:`pairs`), unless ``SplitParams.flip_roles``: then each request's
alpha is whichever instance of a pair gives the least predicted max(T_alpha, T_beta) (Sec. 3.1:
the scheduler "routes the partitioned micro-requests to executors based on current system load
and latency SLOs"). With a cache view (``cached``: the prompt tokens each instance holds in its
prefix cache, from the front end's monitor under ``--router cache-aware``) the part that starts a
request computes only past its instance's cached prefix (:func:`with_cached`), so the prediction
favours placing alpha where the prefix is.

**TTFT** (``SplitParams.ttft_target_s``; Alg. 1 balances load only, and a split inside the prompt
runs the prefill on alpha and then on beta, one after the other): each probe also predicts the
request's TTFT, the time until the pass that samples its first token ends on that instance
(:meth:`~tidal.cluster.split_predict.ExecutionPredictor.times_with`); inside the prompt, alpha's
prefill time plus beta's (in turn: an upper bound). With a target, Alg. 1's choice among its probes
takes the TTFT as a constraint: a probe within it beats one past it, and when no probe of the
search meets it, the unsplit prompt on either side (s = 0, P, L) is probed too; past the target
the lower TTFT wins. The pair (or orientation) is chosen the same way. A ``recorder`` receives every decision with the ledgers it
saw (:class:`SplitRecord`); :func:`replay` asks a fresh planner the same question, so the runtime's
and the simulator's decisions can be shown to be the same function of the same inputs.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from tidal.cluster.split_predict import ExecutionPredictor, MicroRequest, StepTimeModel, Timeline
from tidal.config import ConfigError

DEFAULT_OUTPUT_ESTIMATE = 256  # before any history: about the mean output of chat traces (BurstGPT 262, ShareGPT 373)
DEFAULT_LENGTH_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BUDGET_WINDOW = 32  # the recent steps whose token budgets an instance's predictions use
BUDGET_STEP = 16  # ... in steps of this many tokens (a predictor per budget, kept)


# ============================================================================ split points
def split_parts(prompt_len: int, predicted_output: int, s: int, request_id: str = ""
                ) -> tuple[MicroRequest | None, MicroRequest | None]:
    """(alpha, beta) of a request split at ``s`` (module docstring; DynaServe Sec. 3.1: r^alpha =
    tokens 1..s, r^beta = tokens s+1..L). None where a side has nothing to do."""
    if prompt_len < 1 or predicted_output < 1:
        raise ValueError(f"split: prompt and predicted output must be >= 1, got {prompt_len}, {predicted_output}")
    P, D = prompt_len, predicted_output
    L = P + D
    s = min(max(int(s), 0), L)
    if s == 0:
        return None, MicroRequest(request_id, P, 0, D)
    if s >= L - 1:
        return MicroRequest(request_id, P, 0, D), None
    if s < P:
        return MicroRequest(request_id, s, 0, 0), MicroRequest(request_id, P - s, s, D)
    a = s - P + 1  # alpha samples the first token at the end of the prompt, then one per decode
    return MicroRequest(request_id, P, 0, a), MicroRequest(request_id, 0, s, D - a)


def with_cached(part: MicroRequest | None, cached: int) -> MicroRequest | None:
    """``part`` on an instance that holds the first ``cached`` prompt tokens' KV in its prefix cache:
    a part that starts at KV position 0 computes only past them. The engine's hit stops at least one
    token short of where the part's prefill ends (the last prompt token is computed to sample, and
    alpha's hit stays short of its split point), so at most ``prefill_tokens - 1`` are skipped."""
    if part is None or part.context or cached <= 0:
        return part
    hit = min(cached, part.prefill_tokens - 1)
    if hit <= 0:
        return part
    return MicroRequest(part.request_id, part.prefill_tokens - hit, hit, part.decode_tokens)


# ============================================================================ output length
class LengthPredictor:
    """Output length from the served history (DynaServe Sec. 5, "Prediction length discussion").

    The estimate is the running mean of the outputs of earlier requests whose prompt fell in the
    same length bucket (``buckets`` are the upper edges; one more bucket holds longer prompts);
    an empty bucket uses the mean of all requests; with no history at all it is ``default``
    (256 tokens). ``predict`` adds ``margin`` (20 tokens, Sec. 5: "to avoid underestimation,
    which could lead to SLO violations") and caps the result at ``max_tokens``. Deterministic.
    """

    def __init__(self, margin: int = 20, default: int = DEFAULT_OUTPUT_ESTIMATE,
                 buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS):
        if margin < 0 or default < 1 or list(buckets) != sorted(set(buckets)):
            raise ValueError("length predictor: margin >= 0, default >= 1, buckets strictly increasing")
        self.margin, self.default, self.buckets = margin, default, tuple(buckets)
        self._n = [0] * (len(self.buckets) + 1)
        self._mean = [0.0] * (len(self.buckets) + 1)
        self.count, self.mean = 0, 0.0

    def _bucket(self, prompt_len: int) -> int:
        return bisect.bisect_left(self.buckets, prompt_len)

    def observe(self, prompt_len: int, output_len: int) -> None:
        b = self._bucket(prompt_len)
        self._n[b] += 1
        self._mean[b] += (output_len - self._mean[b]) / self._n[b]
        self.count += 1
        self.mean += (output_len - self.mean) / self.count

    def estimate(self, prompt_len: int) -> float:
        b = self._bucket(prompt_len)
        if self._n[b]:
            return self._mean[b]
        return self.mean if self.count else float(self.default)

    def predict(self, prompt_len: int, max_tokens: int) -> int:
        """min(max_tokens, estimate + margin), at least 1."""
        return max(1, min(int(max_tokens), math.ceil(self.estimate(prompt_len) + self.margin)))


# ============================================================================ parameters
@dataclass(frozen=True)
class SplitParams:
    """Alg. 1's knobs. ``max_probes`` is K (Sec. 4.1: "typically set to 6"); ``epsilon_s`` the
    tolerance on |T_alpha - T_beta| (line 7); ``margin`` the length predictor's (Sec. 5: 20);
    ``token_budget`` / ``max_num_seqs`` the instances' limits the predictor's passes obey;
    ``kv_capacity_tokens`` (None: the paper's predictor) also makes them obey an instance's KV pool.

    Placement (Sec. 3.1: micro-requests are routed "based on current system load and latency
    SLOs"): with ``flip_roles`` either instance of a pair may be a request's alpha (both
    orientations are searched; the one with the least predicted max(T_alpha, T_beta) wins);
    with ``ttft_target_s`` the request's predicted TTFT is Alg. 1's constraint (module docstring)."""

    max_probes: int = 6
    epsilon_s: float = 0.02
    margin: int = 20
    token_budget: int = 2048
    max_num_seqs: int = 256
    kv_capacity_tokens: int | None = None
    flip_roles: bool = False
    ttft_target_s: float | None = None

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_probes", 1, 64), ("margin", 0, 1 << 20), ("token_budget", 1, 1 << 24),
                             ("max_num_seqs", 1, 1 << 20)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ConfigError(f"split.{name} must be in [{lo}, {hi}], got {v}")
        if not 0 <= self.epsilon_s < math.inf:
            raise ConfigError(f"split.epsilon_s must be >= 0 and finite, got {self.epsilon_s}")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ConfigError(f"split.kv_capacity_tokens must be >= 1 (or None), got {self.kv_capacity_tokens}")
        if self.ttft_target_s is not None and not 0 < self.ttft_target_s < math.inf:
            raise ConfigError(f"split.ttft_target_s must be > 0 and finite (or None), got {self.ttft_target_s}")


# ============================================================================ decisions
@dataclass(frozen=True, slots=True)
class Probe:
    split: int
    phi: float
    t_alpha: float
    t_beta: float
    ttft: float = 0.0  # predicted seconds to the request's first token (module docstring)


@dataclass(frozen=True, slots=True)
class SplitDecision:
    request_id: str
    pair: tuple[int, int]
    prompt_len: int
    predicted_output: int
    split: int  # s: alpha computes the KV of tokens [0, s)
    phi: float
    probes: int  # Alg. 1 iterations run (0: cold start)
    t_alpha: float  # predicted time for each instance to finish its ledger with the new part
    t_beta: float
    cold_start: bool
    alpha: MicroRequest | None = None
    beta: MicroRequest | None = None
    trace: tuple[Probe, ...] = ()

    @property
    def handoff(self) -> bool:
        """Both parts exist: alpha pauses at ``split`` and its KV moves to beta."""
        return self.alpha is not None and self.beta is not None


@dataclass(frozen=True, slots=True)
class SplitRecord:
    """A decision with what it was a function of: the remaining work on every candidate
    instance (FCFS order), the pairs it chose among and the predicted output."""

    decision: SplitDecision
    now: float
    max_tokens: int
    candidates: tuple[tuple[int, int], ...]
    ledgers: tuple[tuple[int, tuple[MicroRequest, ...]], ...]
    budgets: tuple[tuple[int, int], ...] = ()  # each candidate instance's pass budget (recent steps)
    cached: tuple[tuple[int, int], ...] = ()  # prompt tokens each candidate instance holds cached (none: no view)


def pairs(num_instances: int) -> list[tuple[int, int]]:
    """Pair k is (alpha 2k, beta 2k+1) (DynaServe Sec. 6.1: one GPU group each for r^alpha, r^beta)."""
    if num_instances < 2 or num_instances % 2:
        raise ConfigError(f"--mode split pairs instances (2k: alpha, 2k+1: beta): it needs an even number >= 2, "
                          f"got {num_instances}")
    return [(i, i + 1) for i in range(0, num_instances, 2)]


# ============================================================================ the planner
@dataclass
class _Part:
    micro: MicroRequest
    prefill_done: int = 0
    decoded: int = 0

    def remaining(self) -> MicroRequest:
        m = self.micro
        pre = 0 if self.decoded else max(m.prefill_tokens - self.prefill_done, 0)
        done = m.prefill_tokens - pre
        return MicroRequest(m.request_id, pre, m.context + done, max(m.decode_tokens - self.decoded, 0))


@dataclass
class _Owner:
    prompt_len: int
    alpha: int | None
    beta: int | None


@dataclass
class _Ledger:
    parts: dict[str, _Part] = field(default_factory=dict)  # FCFS order
    timeline: Timeline | None = None  # of the remaining parts, until the ledger changes


class SplitPlanner:
    """Alg. 1 over per-instance ledgers of outstanding micro-requests; see the module docstring."""

    def __init__(self, params: SplitParams, step_time: StepTimeModel,
                 recorder: Callable[[SplitRecord], None] | None = None,
                 lengths: LengthPredictor | None = None):
        self.params = params
        self.step_time = step_time
        self.predictor = ExecutionPredictor(step_time, params.token_budget, params.max_num_seqs,
                                            kv_capacity=params.kv_capacity_tokens)
        self._predictors: dict[int, ExecutionPredictor] = {params.token_budget: self.predictor}  # by budget
        self._recent: dict[int, deque[int]] = {}  # instance -> its recent steps' token budgets
        self._budget: dict[int, int] = {}  # instance -> the pass budget its predictions use
        self.lengths = lengths or LengthPredictor(margin=params.margin)
        self.recorder = recorder
        self._ledgers: dict[int, _Ledger] = {}
        self._owners: dict[str, _Owner] = {}
        self.failed: set[int] = set()
        self.num_decisions = 0

    # ---------------------------------------------------------------- views
    def _ledger(self, instance: int) -> _Ledger:
        led = self._ledgers.get(instance)
        if led is None:
            led = self._ledgers[instance] = _Ledger()
        return led

    def ledger(self, instance: int) -> tuple[MicroRequest, ...]:
        """The remaining work on ``instance``, FCFS order."""
        return tuple(p.remaining() for p in self._ledger(instance).parts.values())

    def budget(self, instance: int) -> int:
        """The per-pass token budget ``instance``'s predictions use: the mean of its recent steps'
        budgets (DynaServe Sec. 4.1: "a per-pass batch composition drawn from each instance's recent
        batching history"), in steps of ``BUDGET_STEP`` tokens; ``token_budget`` until it reports any."""
        return self._budget.get(instance, self.params.token_budget)

    def on_budget(self, instance: int, tokens: int) -> None:
        """``instance`` ran (or is about to run) a step with a token budget of ``tokens``."""
        recent = self._recent.get(instance)
        if recent is None:
            recent = self._recent[instance] = deque(maxlen=BUDGET_WINDOW)
        recent.append(min(max(int(tokens), 1), self.params.token_budget))
        self.set_budget(instance, round(sum(recent) / len(recent) / BUDGET_STEP) * BUDGET_STEP)

    def set_budget(self, instance: int, tokens: int) -> None:
        """Predict ``instance``'s passes with a budget of ``tokens`` (a replay's recorded one)."""
        b = min(max(int(tokens), BUDGET_STEP), self.params.token_budget)
        if self._budget.get(instance, self.params.token_budget) != b:
            self._budget[instance] = b
            self._ledger(instance).timeline = None

    def _pred(self, instance: int) -> ExecutionPredictor:
        b = self.budget(instance)
        pred = self._predictors.get(b)
        if pred is None:
            pred = self._predictors[b] = ExecutionPredictor(self.step_time, b, self.params.max_num_seqs,
                                                            kv_capacity=self.params.kv_capacity_tokens)
        return pred

    def _timeline(self, instance: int) -> Timeline:
        led = self._ledger(instance)
        if led.timeline is None:
            led.timeline = self._pred(instance).timeline([p.remaining() for p in led.parts.values()])
        return led.timeline

    def load(self, instance: int) -> float:
        """Predicted seconds for ``instance`` to finish its ledger."""
        return self._timeline(instance).total

    def outstanding(self, instance: int) -> int:
        return len(self._ledger(instance).parts)

    def request_ids(self, instance: int) -> list[str]:
        """The requests with a part in ``instance``'s ledger, FCFS order."""
        return list(self._ledger(instance).parts)

    # ---------------------------------------------------------------- Alg. 1
    def search(self, prompt_len: int, predicted_output: int, pair: tuple[int, int], request_id: str = "",
               cached: Mapping[int, int] | None = None) -> tuple[Probe, int, bool, tuple[Probe, ...]]:
        """Alg. 1 lines 1-10 on the pair's current ledgers: (best probe, probes run, cold start, all probes).
        ``cached``: the prompt tokens each instance holds in its prefix cache (the part that starts
        the request there computes only past them: :func:`with_cached`)."""
        a, b = pair
        P, D = prompt_len, predicted_output
        L = P + D
        ta_tl, tb_tl = self._timeline(a), self._timeline(b)
        pa, pb = self._pred(a), self._pred(b)

        def probe(phi: Fraction) -> Probe:
            s = -((-phi.numerator * L) // phi.denominator)  # SPLIT at s = ceil(phi L) (Sec. 3.1), exactly
            alpha, beta = self._parts(P, D, s, pair, request_id, cached)
            # Alg. 1 line 6, PREDICT: each instance's total time with the new part behind its ledger
            ta, fa = pa.times_with(ta_tl, alpha)
            tb, fb = pb.times_with(tb_tl, beta)
            # TTFT: where the first token is sampled; inside the prompt alpha's then beta's prefill, in turn
            ttft = fb if alpha is None else fa if beta is None or s >= P else fa + fb
            return Probe(s, float(phi), ta, tb, ttft)

        target = self.params.ttft_target_s

        def better(pr: Probe, best: Probe | None) -> bool:
            """Alg. 1's order (the smaller gap, then the smaller max), with the TTFT constraint
            first when there is one: a probe within it beats one past it; past it, the lower TTFT."""
            if best is None:
                return True
            if target is not None:
                ok, bok = pr.ttft <= target, best.ttft <= target
                if ok != bok:
                    return ok
                if not ok:
                    return pr.ttft < best.ttft
            return (abs(pr.t_alpha - pr.t_beta), max(pr.t_alpha, pr.t_beta)) < (
                abs(best.t_alpha - best.t_beta), max(best.t_alpha, best.t_beta))

        phi, lo, hi = Fraction(P, L), Fraction(0), Fraction(1)  # line 3: start from P/D disaggregation
        if not self._ledger(a).parts and not self._ledger(b).parts:
            # lines 1-2, cold start: the paper leaves COLDSTART unspecified ("seeds the prefill and
            # decode clocks"); we read it as the phi = P/L seed itself, taken without a search
            first = probe(phi)
            return first, 0, True, (first,)
        seen: dict[int, Probe] = {}
        trace: list[Probe] = []
        best: Probe | None = None
        for _ in range(self.params.max_probes):  # line 4: at most K probes
            s = -((-phi.numerator * L) // phi.denominator)
            pr = seen.get(s)
            if pr is None:
                pr = seen[s] = probe(phi)
            trace.append(pr)
            gap = abs(pr.t_alpha - pr.t_beta)
            if better(pr, best):
                best = pr
            if gap < self.params.epsilon_s:  # line 7: balanced
                break
            if pr.t_alpha > pr.t_beta:  # line 10, UPDATE: alpha is the slower, give it less
                hi = phi
            else:
                lo = phi
            phi = (lo + hi) / 2
        if target is not None and best is not None and best.ttft > target:
            # no probe of the search meets the TTFT target: the prompt unsplit, on either side
            for phi in (Fraction(0), Fraction(P, L), Fraction(1)):
                s = -((-phi.numerator * L) // phi.denominator)
                pr = seen.get(s)
                if pr is None:
                    pr = seen[s] = probe(phi)
                    trace.append(pr)
                if better(pr, best):
                    best = pr
        assert best is not None
        return best, len(trace), False, tuple(trace)

    @staticmethod
    def _parts(prompt_len: int, predicted_output: int, s: int, pair: tuple[int, int], request_id: str,
               cached: Mapping[int, int] | None) -> tuple[MicroRequest | None, MicroRequest | None]:
        """:func:`split_parts` on ``pair`` (alpha, beta), the first part less its instance's cached prefix."""
        alpha, beta = split_parts(prompt_len, predicted_output, s, request_id)
        if cached:
            a, b = pair
            if alpha is not None:
                alpha = with_cached(alpha, cached.get(a, 0))
            else:
                beta = with_cached(beta, cached.get(b, 0))
        return alpha, beta

    def live_pairs(self, candidates: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        return [p for p in candidates if p[0] not in self.failed and p[1] not in self.failed]

    def orientations(self, candidates: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """The (alpha, beta) placements a request may take: each pair as given, and with
        ``flip_roles`` also reversed."""
        if not self.params.flip_roles:
            return tuple(candidates)
        return tuple(dict.fromkeys(o for a, b in candidates for o in ((a, b), (b, a))))

    def choose_pair(self, prompt_len: int, predicted_output: int, candidates: Sequence[tuple[int, int]],
                    request_id: str = "", cached: Mapping[int, int] | None = None) -> tuple[int, int] | None:
        """The live pair whose best split has the least predicted max(T_alpha, T_beta); ties: the
        lowest index. None when no pair is alive. With ``cached`` (and ``flip_roles``) an instance
        holding the prompt's prefix is predicted to finish its part sooner as alpha, so the
        request's alpha goes where the prefix is unless load says otherwise."""
        best, best_t = None, (math.inf, math.inf)
        target = self.params.ttft_target_s
        for pr in self.live_pairs(self.orientations(candidates)):
            p, _, _, _ = self.search(prompt_len, predicted_output, pr, request_id, cached)
            # with a TTFT target: a placement that meets it first, then (past it) the lower TTFT
            late = max(p.ttft - target, 0.0) if target is not None else 0.0
            t = (late, max(p.t_alpha, p.t_beta))
            if t < best_t:
                best, best_t = pr, t
        return best

    def plan(self, request_id: str, prompt_len: int, max_tokens: int, pair: tuple[int, int] | None = None,
             now: float = 0.0, predicted_output: int | None = None,
             candidates: Sequence[tuple[int, int]] | None = None,
             cached: Mapping[int, int] | None = None) -> SplitDecision:
        """Alg. 1 for one arriving request on ``pair`` (or, with ``pair=None``, on the best of
        ``candidates``), then COMMIT (line 11): its parts join the pair's ledgers.
        ``predicted_output`` overrides the length predictor (an oracle, or a replay); ``cached``:
        the prompt tokens each instance holds cached (the front end's cache view; :meth:`search`)."""
        if request_id in self._owners:
            raise ValueError(f"split planner: request {request_id!r} is already planned")
        D = predicted_output if predicted_output is not None else self.lengths.predict(prompt_len, max_tokens)
        cands = tuple(candidates) if candidates is not None else (() if pair is None else (pair,))
        if pair is None:
            pair = self.choose_pair(prompt_len, D, cands, request_id, cached)
            if pair is None:
                raise ValueError("split planner: no live pair to place the request on")
        elif not cands:
            cands = (pair,)
        insts = sorted({i for c in cands for i in c})
        views = tuple((i, self.ledger(i)) for i in insts)
        budgets = tuple((i, self._budget[i]) for i in insts if i in self._budget)
        best, n, cold, trace = self.search(prompt_len, D, pair, request_id, cached)
        alpha, beta = self._parts(prompt_len, D, best.split, pair, request_id, cached)
        dec = SplitDecision(request_id, pair, prompt_len, D, best.split, best.phi, n, best.t_alpha, best.t_beta,
                            cold, alpha, beta, trace)
        self._commit(dec)
        self.num_decisions += 1
        if self.recorder is not None:
            known = tuple((i, cached[i]) for i in insts if cached and cached.get(i))
            self.recorder(SplitRecord(dec, now, max_tokens, cands, views, budgets, known))
        return dec

    def _commit(self, dec: SplitDecision) -> None:
        a, b = dec.pair
        for inst, part in ((a, dec.alpha), (b, dec.beta)):
            if part is not None:
                led = self._ledger(inst)
                led.parts[dec.request_id] = _Part(part)
                led.timeline = None
        self._owners[dec.request_id] = _Owner(dec.prompt_len, a if dec.alpha else None, b if dec.beta else None)

    # ---------------------------------------------------------------- ledger updates
    def on_progress(self, instance: int, request_id: str, prefill_done: int | None = None,
                    decoded: int | None = None) -> None:
        """The part of ``request_id`` on ``instance`` has computed ``prefill_done`` of its prefill
        tokens and sampled ``decoded`` tokens so far (totals of this part, not increments)."""
        led = self._ledger(instance)
        part = led.parts.get(request_id)
        if part is None:
            return
        changed = False
        if prefill_done is not None and prefill_done != part.prefill_done:
            part.prefill_done, changed = prefill_done, True
        if decoded is not None and decoded != part.decoded:
            part.decoded, changed = decoded, True
        if changed:
            led.timeline = None

    def on_handoff(self, request_id: str) -> None:
        """The alpha part is done (its KV is on its way to beta): it leaves alpha's ledger."""
        own = self._owners.get(request_id)
        if own is not None and own.alpha is not None:
            self._drop(own.alpha, request_id)
            own.alpha = None

    def on_finish(self, request_id: str, output_len: int | None = None) -> None:
        """The request ended: both parts leave; its output length feeds the length predictor."""
        own = self._owners.pop(request_id, None)
        if own is None:
            return
        for inst in (own.alpha, own.beta):
            if inst is not None:
                self._drop(inst, request_id)
        if output_len is not None and output_len > 0:
            self.lengths.observe(own.prompt_len, output_len)

    def on_failure(self, instance: int) -> set[str]:
        """``instance`` died: its pairs are skipped and its ledger is cleared; returns the requests
        that had a part there."""
        self.failed.add(instance)
        led = self._ledger(instance)
        lost = set(led.parts)
        led.parts.clear()
        led.timeline = None
        for rid in lost:
            own = self._owners.get(rid)
            if own is not None:
                own.alpha = None if own.alpha == instance else own.alpha
                own.beta = None if own.beta == instance else own.beta
        return lost

    def on_restart(self, instance: int) -> None:
        self.failed.discard(instance)

    def _drop(self, instance: int, request_id: str) -> None:
        led = self._ledger(instance)
        if led.parts.pop(request_id, None) is not None:
            led.timeline = None

    def load_ledger(self, instance: int, parts: Sequence[MicroRequest]) -> None:
        """Replace ``instance``'s ledger by ``parts`` (remaining work, FCFS order): a replay's view."""
        led = self._ledger(instance)
        led.parts = {m.request_id: _Part(m) for m in parts}
        led.timeline = None


def replay(record: SplitRecord, step_time: StepTimeModel, params: SplitParams) -> SplitDecision:
    """Ask a fresh planner the recorded question on the recorded ledgers: the same decision comes
    back when the planner is a function of its inputs (the test of "the same decisions in both shells")."""
    planner = SplitPlanner(params, step_time)
    for inst, parts in record.ledgers:
        planner.load_ledger(inst, parts)
    for inst, b in record.budgets:
        planner.set_budget(inst, b)
    d = record.decision
    chosen = d.pair if len(record.candidates) <= 1 else None
    return planner.plan(d.request_id, d.prompt_len, record.max_tokens, chosen, record.now,
                        predicted_output=d.predicted_output, candidates=record.candidates,
                        cached=dict(record.cached) or None)


__all__ = ["DEFAULT_OUTPUT_ESTIMATE", "ExecutionPredictor", "LengthPredictor", "MicroRequest", "Probe",
           "SplitDecision", "SplitParams", "SplitPlanner", "SplitRecord", "StepTimeModel", "pairs", "replay",
           "split_parts", "with_cached"]
