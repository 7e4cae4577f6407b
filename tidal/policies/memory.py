"""``memory``: memory-aware dynamic batch size (Pang et al., Alg. 1, Eq. 7-14).

The cap on running requests, b_t, is the largest batch whose total KV footprint
S = sum_i (l_in,i + l_out,i) (Eq. 7) stays within the pool with probability 1 - eps_M.
S is approximately normal by the CLT, S ~ N(b*mu, b*sigma^2) (Eq. 8-10), with mu and sigma the mean
and standard deviation of one request's total length. Everything is counted in KV **blocks**,
as the paper suggests for paged engines: one request's footprint is ceil((l_in + l_out) / block_size).

- eta: the KV blocks available to requests. This is the paper's M_max: the whole KV pool after
  weights and activations. So it is ``view.num_total_blocks`` (free blocks plus the blocks that
  running requests hold; nothing else holds device blocks here). It is read each step, so a pool
  that grows or shrinks at run time is followed.
- mu, sigma: Welford's online mean/variance of the footprints of finished requests (aborted ones
  are left out: they were cut short). Until ``memory.min_samples`` have finished, the expected
  footprints of the requests now waiting or running (prompt + the most output each may produce)
  are pooled in. ``memory.prior_len`` is used only when there is nothing to estimate from.
- theta = Phi^-1(1 - eps_M) (the text after Eq. 11), from ``statistics.NormalDist``.
- L0, the safety buffer: the CLT margin theta * sigma_S = theta * sigma * sqrt(b) at the batch
  size of Eq. 12. The paper writes L0 = eta - (theta*sigma_S + mu_S). Read literally at that batch
  size, this gives 0. The margin is what makes the linear rule of Eq. 14 agree with Eq. 12. L0 is
  refreshed every ``memory.l0_every`` updates ("computed offline and updated online
  periodically") and whenever the estimate's source changes, or fixed with ``memory.l0`` (blocks).
- b_t = floor((eta - L0) / mu) (Eq. 14, Alg. 1 line 5), clamped to [max(N_d, b_min), B_max]
  (line 6). N_d is the number of running decodes; B_max = ``memory.b_max``, or
  ``config.max_num_seqs`` when it is 0. A ``b_max`` above ``max_num_seqs`` raises the hard cap
  (the policy's :meth:`seq_ceiling`): that is how the paper's dynamic batching beats vLLM's fixed
  cap in Table I, by running more requests than the static cap when memory allows.
- Eq. 9's variance: the paper writes sigma_S^2 = b (Var(l_in) + Var(l_out)), which assumes the
  input and output lengths of a request are independent. Here sigma^2 = Var(l_in + l_out), the
  variance of the one quantity that occupies memory; it equals the paper's form when the two are
  independent and stays right when they are correlated (long prompts with long answers, as in
  summarisation, have Cov > 0 and the paper's form would understate the risk). Finished requests
  give the total directly, in blocks, which is what the pool holds.

Alg. 1 line 4 changes b_t only while there is prefill work: waiting requests, or running
requests still in prefill. Otherwise b_t stays at b_{t-1}. The paper also requires N_d > 0, but
only so that the footprint estimate is non-zero. Here the expected lengths of the pending
requests give that estimate, so the first batch is sized too. The paper gives no numeric
eps_M, so the default here is 0.05.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from pydantic import Field

from tidal.config import ConfigError, SchedulerConfig, cdiv
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.core.request import FinishReason, Request
from tidal.policies.params import PolicyParams
from tidal.policies.registry import register_policy


class Welford:
    """Online mean and (sample) variance, with Chan's merge for pooling two sets."""

    __slots__ = ("n", "mean", "m2")

    def __init__(self, n: int = 0, mean: float = 0.0, m2: float = 0.0):
        self.n, self.mean, self.m2 = n, mean, m2

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def merged(self, other: Welford) -> Welford:
        if other.n == 0:
            return Welford(self.n, self.mean, self.m2)
        if self.n == 0:
            return Welford(other.n, other.mean, other.m2)
        n = self.n + other.n
        d = other.mean - self.mean
        return Welford(n, self.mean + d * other.n / n, self.m2 + other.m2 + d * d * self.n * other.n / n)

    @property
    def variance(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.variance, 0.0))


def theta_of(eps_m: float) -> float:
    """theta = Phi^-1(1 - eps_M) (Pang et al., text after Eq. 11)."""
    return NormalDist().inv_cdf(1.0 - eps_m)


def clt_batch_size(mu: float, sigma: float, eta: float, theta: float) -> float:
    """Pang Eq. 12: b <= ((sqrt((sigma*theta)^2 + 4*mu*eta) - sigma*theta) / (2*mu))^2 (real-valued)."""
    if mu <= 0:
        raise ValueError("mu must be > 0")
    st = sigma * theta
    return ((math.sqrt(st * st + 4.0 * mu * max(eta, 0.0)) - st) / (2.0 * mu)) ** 2


def safety_buffer(mu: float, sigma: float, eta: float, theta: float) -> float:
    """L0 = theta * sigma_S at the Eq. 12 batch size (sigma_S = sigma*sqrt(b), Eq. 9), so that Eq. 14 == Eq. 12."""
    return theta * sigma * math.sqrt(clt_batch_size(mu, sigma, eta, theta))


def linear_batch_size(eta: float, l0: float, mu: float) -> int:
    """Pang Eq. 14 / Alg. 1 line 5: b_t = floor((eta - L0) / (E[l_in] + E[l_out]))."""
    if mu <= 0:
        raise ValueError("mu must be > 0")
    # a hair of tolerance so that exact quotients (e.g. 50.0) do not floor to 49 through rounding
    return max(int(math.floor((eta - l0) / mu + 1e-9)), 0)


class MemoryParams(PolicyParams):
    eps_m: float = Field(0.05, gt=0.0, lt=1.0, description="eps_M: allowed probability of overflowing the pool")
    l0: float = Field(-1.0, description="fixed safety buffer L0 in blocks; < 0: from the CLT (Eq. 10-12)")
    l0_every: int = Field(16, gt=0, description="refresh L0 every this many updates")
    min_samples: int = Field(8, ge=0, description="finished requests before their statistics are used alone")
    prior_len: int = Field(1024, gt=0, description="tokens per request when nothing is known")
    b_min: int = Field(1, ge=1, description="lowest batch cap")
    b_max: int = Field(0, ge=0, description="B_max, the highest batch cap (0: max_num_seqs); may exceed it")


@dataclass(frozen=True, slots=True)
class MemoryState(PolicyState):
    b_mem: int = 0
    eps_m: float = 0.0
    theta: float = 0.0
    samples: int = 0
    observed_mu_blocks: float = 0.0
    observed_sigma_blocks: float = 0.0
    updates: int = 0
    # the last update's terms (None before the first update with prefill work)
    eta_blocks: float | None = None
    mu_blocks: float | None = None
    sigma_blocks: float | None = None
    l0_blocks: float | None = None
    b_eq12: float | None = None
    b_eq14: int | None = None
    estimate: str | None = None  # observed | expected | prior


class MemoryPolicy(SchedulingPolicy):
    name = "memory"

    def __init__(self, config: SchedulerConfig, params: MemoryParams | None = None):
        params = params or MemoryParams()
        self.eps_m = params.eps_m
        self.theta = theta_of(self.eps_m)
        self.l0_fixed = params.l0
        self.l0_every = params.l0_every
        self.min_samples = params.min_samples
        self.prior_len = params.prior_len
        self.b_min = params.b_min
        self.b_max = params.b_max or config.max_num_seqs  # Pang Alg. 1 line 6's B_max
        if self.b_min > self.b_max:
            bound = "memory.b_max" if params.b_max else "max_num_seqs"
            raise ConfigError(f"policy argument memory.b_min={self.b_min}: must be <= {bound} ({self.b_max})")
        self.stats = Welford()  # footprints (blocks) of finished requests
        self.b = self.b_max  # b_{t-1}; Alg. 2 of the paper also starts from B_max
        self.block_size: int | None = None
        self._updates = 0
        self._l0: float | None = None
        self._last: dict = {}
        self._pending: tuple[tuple | None, Welford] = (None, Welford())  # estimate's last (requests, footprints)

    # ------------------------------------------------------------------ estimation
    def _blocks(self, tokens: int) -> int:
        return max(cdiv(tokens, self.block_size or 1), 1)

    def estimate(self, view: SchedulerView) -> tuple[float, float, str]:
        """(mu, sigma) of one request's footprint in blocks, and where it came from."""
        if self.stats.n >= max(self.min_samples, 1):
            return self.stats.mean, self.stats.std, "observed"
        cap = view.num_total_blocks * view.block_size
        # the same requests in the same order as last step (compared by identity, at C speed): the
        # same footprints, added in the same order, so the same Welford
        key = (view.running, view.waiting, cap, self.block_size)
        if key == self._pending[0]:
            pending = self._pending[1]
        else:
            pending = Welford()
            for r in (*view.running, *view.waiting):
                pending.add(self._blocks(min(r.expected_total_tokens, cap)))
            self._pending = (key, pending)
        pooled = self.stats.merged(pending)
        if pooled.n:
            return pooled.mean, pooled.std, "expected"
        mu = self._blocks(self.prior_len)
        return float(mu), mu / 2.0, "prior"

    # ------------------------------------------------------------------ policy
    def seq_ceiling(self, configured: int) -> int:
        return self.b_max

    def plan_step(self, view: SchedulerView) -> StepCaps:
        self.block_size = view.block_size
        n_decode = view.num_decodes
        n_prefill = len(view.waiting) + sum(1 for r in view.running if r.in_prefill)
        if n_prefill > 0:  # Alg. 1 line 4
            eta = float(view.num_total_blocks)
            mu, sigma, source = self.estimate(view)
            mu = max(mu, 1.0)
            if self.l0_fixed >= 0:
                l0 = self.l0_fixed
            elif self._l0 is None or self._updates % self.l0_every == 0 or source != self._last.get("estimate"):
                l0 = self._l0 = safety_buffer(mu, sigma, eta, self.theta)
            else:
                l0 = self._l0
            self._updates += 1
            b = linear_batch_size(eta, l0, mu)  # Alg. 1 line 5 (Eq. 14)
            self._last = {"eta_blocks": eta, "mu_blocks": mu, "sigma_blocks": sigma, "l0_blocks": l0,
                          "b_eq12": clt_batch_size(mu, sigma, eta, self.theta), "b_eq14": b, "estimate": source}
            # Alg. 1 line 6: never below the running decodes (nor b_min), never above B_max
            self.b = min(max(b, n_decode, self.b_min), self.b_max)
        return StepCaps(max_num_seqs=self.b)  # Alg. 1 line 3: b_t = b_{t-1} when there is no prefill work

    def on_finished(self, request: Request) -> None:
        # aborted requests were cut short: their footprint says nothing of the workload
        if request.finish_reason is not FinishReason.ABORT and self.block_size is not None:
            # Eq. 9 as Var(l_in + l_out): the footprint's own variance (see the module docstring)
            self.stats.add(self._blocks(request.num_tokens))

    def state(self) -> MemoryState:
        return MemoryState(self.name, b_mem=self.b, eps_m=self.eps_m, theta=self.theta, samples=self.stats.n,
                           observed_mu_blocks=self.stats.mean, observed_sigma_blocks=self.stats.std,
                           updates=self._updates, **self._last)


@register_policy("memory", params=MemoryParams)
def _memory(config: SchedulerConfig, params: MemoryParams) -> SchedulingPolicy:
    return MemoryPolicy(config, params)
