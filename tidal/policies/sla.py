"""``sla``: SLA-constrained dynamic batch size (Pang et al., Alg. 2), also applied to the chunk size.

D_SLA, the decode-latency SLA, is ``sla.d_sla_ms`` or else ``config.tbt_slo_ms``. Two instances of
the same bounded binary search (:class:`BoundedBinarySearch`, Alg. 2) run side by side:

- **b_SLA, the cap on running requests** (``max_num_seqs``). It watches decode-dominated steps:
  steps with at least one decode and at most ``sla.decode_dominated_ratio`` x N_d prefill tokens
  (default 1.0; 0 keeps decode-only steps). For those, tau is the step time, which is the TBT
  those decodes saw (one token per step), and b is the step's decode count. At the default,
  steps whose chunk has been squeezed to its floor still count, so the cap keeps learning when
  every step is mixed. Steps dominated by prefill say little about D(b); the chunk controller
  takes them. Steps with no decode have no TBT and are ignored.
- **c_SLA, the chunk size for prefill-decode fusion** (``token_budget``). The paper only says
  that the method "remains effective in PD fusion scenarios through adaptive chunk size
  determination" (Sec. I and Table II, third row). As in vLLM, the chunk size here is the token
  budget of a step, decodes included. The same Alg. 2 runs on that variable, in tokens. It
  watches the steps where prefill and decode share the batch: tau is the step time and b is
  the step's token count. Alpha and delta are counted in KV blocks (x block_size tokens), the
  search space is [block_size, max_num_batched_tokens], and Alg. 2 line 18's clamp at N_d
  becomes "at least N_d + one block". So the decodes are never cut, and prefill never starves.

Alg. 2 runs once per ``sla.window`` observed steps, on their mean tau (the "recent average
decode latency") and their mean b. A tumbling window keeps one measurement from steering two
consecutive halvings. b* = min(b_mem, b_SLA) (Sec. III-B) comes from composing ``memory+sla``,
whose caps are combined by their minimum.

The paper gives no numeric alpha, delta or eps_D. The defaults here are alpha = 4, delta = 1
and eps_D = 5% of D_SLA, with B_min = 1. For a band to hold an integer batch, eps_D must be at
least half of D's per-request slope.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.policies.params import PolicyParams
from tidal.policies.registry import register_policy


class BoundedBinarySearch:
    """Pang Alg. 2 on one integer knob, with search space [lo, hi]."""

    def __init__(self, lo: int, hi: int, alpha: int, delta: int, target: float, eps: float):
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= lo <= hi, got [{lo}, {hi}]")
        self.lo_bound, self.hi_bound = lo, hi
        self.alpha, self.delta, self.target, self.eps = alpha, delta, target, eps
        self.low, self.high = lo, hi  # Alg. 2 line 1
        self.value = (lo + hi) // 2
        self.updates = 0
        self.last: dict = {}

    def update(self, tau: float, b_bar: float) -> int:
        b = int(round(b_bar))
        lo_b, hi_b, a = self.lo_bound, self.hi_bound, self.alpha
        if tau > self.target + self.eps:  # lines 5-7: too slow, bring the upper bound down to b_bar
            high = max(b, self.low + a)
            low = max(self.low - self.delta, lo_b)
            verdict = "over"
        elif tau < self.target - self.eps:  # lines 9-11: too fast, lift the lower bound up to b_bar
            low = min(b, self.high - a)
            high = min(self.high + self.delta, hi_b)
            verdict = "under"
        else:  # lines 13-15: inside the band, re-centre a window of width alpha on b_bar
            high = min(b + a // 2, hi_b)
            low = max(b - a // 2, lo_b)
            verdict = "within"
        # keep the interval inside the search space and ordered (the paper leaves it implicit)
        self.low = min(max(low, lo_b), hi_b)
        self.high = min(max(high, self.low), hi_b)
        self.value = min(max((self.low + self.high) // 2, lo_b), hi_b)  # line 17 (line 18 is the caller's)
        self.updates += 1
        self.last = {"tau_ms": tau * 1e3, "b_bar": b_bar, "verdict": verdict}
        return self.value

    def state(self) -> SearchState:
        return SearchState(self.value, self.low, self.high, self.updates,
                           **{f"last_{k}": v for k, v in self.last.items()})


class _Window:
    __slots__ = ("tau", "b", "n")

    def __init__(self) -> None:
        self.tau = self.b = 0.0
        self.n = 0

    def add(self, tau: float, b: float) -> None:
        self.tau += tau
        self.b += b
        self.n += 1


def d_sla_seconds(own_ms: float | None, config: SchedulerConfig, key: str) -> float:
    """The decode-latency SLO in seconds: the policy's own parameter, else ``config.tbt_slo_ms``."""
    ms = own_ms if own_ms is not None else config.tbt_slo_ms
    if ms is None:
        raise ConfigError(f"{key.split('.')[0]}: needs a decode-latency SLO: set tbt_slo_ms (--tbt-slo-ms) or {key}")
    return ms / 1e3


class SLAParams(PolicyParams):
    d_sla_ms: float | None = Field(None, gt=0, description="D_SLA; default: tbt_slo_ms")
    eps_d_ms: float | None = Field(None, ge=0, description="eps_D, the band around D_SLA; default 5% of D_SLA")
    alpha: int = Field(4, ge=1, description="Alg. 2 alpha: the least width of the search interval")
    delta: int = Field(1, ge=0, description="Alg. 2 delta: how far a bound moves back per update")
    window: int = Field(8, ge=1, description="observed steps averaged per update")
    decode_dominated_ratio: float = Field(1.0, ge=0, description="a step counts when prefill tokens <= this x decodes")
    b_min: int = Field(1, ge=1, description="B_min, the lowest batch cap")


@dataclass(frozen=True, slots=True)
class SearchState:
    value: int
    low: int
    high: int
    updates: int
    last_tau_ms: float | None = None
    last_b_bar: float | None = None
    last_verdict: str | None = None  # over | under | within


@dataclass(frozen=True, slots=True)
class SLAState(PolicyState):
    b_sla: int = 0
    chunk_tokens: int = 0
    d_sla_ms: float = 0.0
    eps_d_ms: float = 0.0
    alpha: int = 0
    delta: int = 0
    window: int = 0
    batch_search: SearchState | None = None
    chunk_search: SearchState | None = None


class SLAPolicy(SchedulingPolicy):
    name = "sla"

    def __init__(self, config: SchedulerConfig, params: SLAParams | None = None):
        params = params or SLAParams()
        self.d_sla = d_sla_seconds(params.d_sla_ms, config, "sla.d_sla_ms")
        self.eps_d = (params.eps_d_ms if params.eps_d_ms is not None else 0.05 * self.d_sla * 1e3) / 1e3
        self.alpha, self.delta, self.window = params.alpha, params.delta, params.window
        self.ratio = params.decode_dominated_ratio
        if params.b_min > config.max_num_seqs:
            raise ConfigError(f"policy argument sla.b_min={params.b_min}: must be <= max_num_seqs "
                              f"({config.max_num_seqs})")
        self.max_tokens = config.max_num_batched_tokens
        self.batch = BoundedBinarySearch(params.b_min, config.max_num_seqs, self.alpha, self.delta, self.d_sla,
                                         self.eps_d)
        self.chunk: BoundedBinarySearch | None = None  # built at the first view (needs block_size)
        self.chunk_floor = 1
        self._bw, self._cw = _Window(), _Window()
        self.b_sla = self.batch.value
        self.c_sla = self.max_tokens

    def _chunk_search(self, block_size: int) -> BoundedBinarySearch:
        if self.chunk is None:
            self.chunk_floor = min(block_size, self.max_tokens)
            self.chunk = BoundedBinarySearch(self.chunk_floor, self.max_tokens, self.alpha * block_size,
                                             self.delta * block_size, self.d_sla, self.eps_d)
        return self.chunk

    def plan_step(self, view: SchedulerView) -> StepCaps:
        # Alg. 2 line 18: b_t = min(max(b_t, N_d), B_max)
        self.b_sla = min(max(self.batch.value, view.num_decodes), view.max_num_seqs)
        chunk = self._chunk_search(view.block_size)
        # line 18 for tokens: the decodes plus at least one block of prefill; never above the configured budget
        self.c_sla = min(max(chunk.value, view.num_decodes + self.chunk_floor), self.max_tokens)
        return StepCaps(self.b_sla, self.c_sla)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        comp = result.composition if result.composition.batch_size else plan.composition
        d, p, t = comp.num_decode_seqs, comp.num_prefill_tokens, result.step_time_s
        if d == 0 or t <= 0:
            return  # no decode in the step: no TBT to learn from
        if p <= self.ratio * d:
            self._bw.add(t, d)
            if self._bw.n >= self.window:
                self.batch.update(self._bw.tau / self._bw.n, self._bw.b / self._bw.n)
                self._bw = _Window()
        if p > 0 and self.chunk is not None:
            self._cw.add(t, comp.num_tokens)
            if self._cw.n >= self.window:
                self.chunk.update(self._cw.tau / self._cw.n, self._cw.b / self._cw.n)
                self._cw = _Window()

    def state(self) -> SLAState:
        return SLAState(self.name, b_sla=self.b_sla, chunk_tokens=self.c_sla, d_sla_ms=self.d_sla * 1e3,
                        eps_d_ms=self.eps_d * 1e3, alpha=self.alpha, delta=self.delta, window=self.window,
                        batch_search=self.batch.state(),
                        chunk_search=None if self.chunk is None else self.chunk.state())


@register_policy("sla", params=SLAParams)
def _sla(config: SchedulerConfig, params: SLAParams) -> SchedulingPolicy:
    return SLAPolicy(config, params)
