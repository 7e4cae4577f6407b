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
- mu, sigma: one request's footprint, from **every request the instance has taken in** (Eq. 8-9's
  E[l_in], E[l_out], Var(l_in), Var(l_out) over the requests a batch is drawn from): finished ones
  with their real lengths; running, waiting and preempted ones with their prompt and, for the
  output, the ``max_tokens`` they asked for (the most they may produce, and within the context),
  or, when they set none, the tokens they have produced so far, a lower bound. Estimating from
  finished requests alone would be biased low: the short requests of a batch finish first, so the
  first ones to finish are the short ones (aborted requests are left out: they were cut short).
  ``memory.prior_len`` is used only when there is nothing to estimate from.
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
- Eq. 9's variance as the paper writes it: sigma^2 = Var(l_in) + Var(l_out) (in tokens, divided by
  block_size^2 for blocks), which treats a request's prompt and output lengths as independent; the
  mean is the mean footprint in blocks, E[ceil((l_in + l_out) / block_size)], what the pool holds.

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


class LengthSums:
    """Sums over a set of requests of l_in, l_in^2, l_out, l_out^2 and the footprint in blocks, so
    that requests join and leave in O(1); the means and (sample) variances of Eq. 8-9 from them."""

    __slots__ = ("n", "s_in", "q_in", "s_out", "q_out", "s_blocks")

    def __init__(self) -> None:
        self.n = 0
        self.s_in = self.q_in = self.s_out = self.q_out = self.s_blocks = 0.0

    def add(self, l_in: float, l_out: float, blocks: float, sign: int = 1) -> None:
        self.n += sign
        self.s_in += sign * l_in
        self.q_in += sign * l_in * l_in
        self.s_out += sign * l_out
        self.q_out += sign * l_out * l_out
        self.s_blocks += sign * blocks

    def remove(self, l_in: float, l_out: float, blocks: float) -> None:
        self.add(l_in, l_out, blocks, -1)

    def plus(self, other: LengthSums) -> LengthSums:
        out = LengthSums()
        for f in self.__slots__:
            setattr(out, f, getattr(self, f) + getattr(other, f))
        return out

    @staticmethod
    def _var(n: int, s: float, q: float) -> float:
        return max((q - s * s / n) / (n - 1), 0.0) if n > 1 else 0.0

    @property
    def mean_blocks(self) -> float:
        return self.s_blocks / self.n if self.n else 0.0

    @property
    def mean_in(self) -> float:
        return self.s_in / self.n if self.n else 0.0

    @property
    def mean_out(self) -> float:
        return self.s_out / self.n if self.n else 0.0

    @property
    def var_tokens(self) -> float:
        """Pang Eq. 9's per-request variance: Var(l_in) + Var(l_out)."""
        return self._var(self.n, self.s_in, self.q_in) + self._var(self.n, self.s_out, self.q_out)


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
    prior_len: int = Field(1024, gt=0, description="tokens per request when nothing is known")
    b_min: int = Field(1, ge=1, description="lowest batch cap")
    b_max: int = Field(0, ge=0, description="B_max, the highest batch cap (0: max_num_seqs); may exceed it")


@dataclass(frozen=True, slots=True)
class MemoryState(PolicyState):
    b_mem: int = 0
    eps_m: float = 0.0
    theta: float = 0.0
    samples: int = 0  # finished requests counted
    live: int = 0  # requests on the instance counted at the last update (running, waiting)
    finished_mu_blocks: float = 0.0  # the mean footprint of the finished requests alone (biased low)
    updates: int = 0
    # the last update's terms (None before the first update with prefill work)
    eta_blocks: float | None = None
    mu_blocks: float | None = None
    sigma_blocks: float | None = None
    l0_blocks: float | None = None
    b_eq12: float | None = None
    b_eq14: int | None = None
    mean_in_tokens: float | None = None
    mean_out_tokens: float | None = None
    estimate: str | None = None  # requests | prior


class MemoryPolicy(SchedulingPolicy):
    name = "memory"

    def __init__(self, config: SchedulerConfig, params: MemoryParams | None = None):
        params = params or MemoryParams()
        self.eps_m = params.eps_m
        self.theta = theta_of(self.eps_m)
        self.l0_fixed = params.l0
        self.l0_every = params.l0_every
        self.prior_len = params.prior_len
        self.b_min = params.b_min
        self.b_max = params.b_max or config.max_num_seqs  # Pang Alg. 1 line 6's B_max
        if self.b_min > self.b_max:
            bound = "memory.b_max" if params.b_max else "max_num_seqs"
            raise ConfigError(f"policy argument memory.b_min={self.b_min}: must be <= {bound} ({self.b_max})")
        self.finished = LengthSums()  # finished requests, their real lengths
        self.live = LengthSums()  # the requests on the instance (running, waiting), as _lengths gives them
        self._live: dict[int, tuple[Request, tuple[int, int, int]]] = {}  # id(request) -> (it, its terms)
        self._open: dict[int, Request] = {}  # live requests with no max_tokens: their terms grow, recomputed each time
        self._members: tuple | None = None  # (running, waiting, cap, block_size) the live sums were taken on
        self.b = self.b_max  # b_{t-1}; Alg. 2 of the paper also starts from B_max
        self.block_size: int | None = None
        self._updates = 0
        self._l0: float | None = None
        self._last: dict = {}
        self._last_means: tuple[float, float, int] = (0.0, 0.0, 0)  # E[l_in], E[l_out], live requests

    # ------------------------------------------------------------------ estimation
    def _blocks(self, tokens: int) -> int:
        return max(cdiv(tokens, self.block_size or 1), 1)

    def _lengths(self, r: Request, cap: int) -> tuple[int, int, int]:
        """(l_in, l_out, footprint blocks) of a request still on the instance: its output is the
        ``max_tokens`` it asked for (within the context), or, when it set none, what it has produced
        so far (a lower bound); its total at most the pool (``cap`` tokens), where it would stop."""
        l_in = r.num_prompt_tokens
        known = r.sampling_params.max_tokens is not None
        l_out = r.max_output_tokens if known else max(len(r.output_token_ids), 1)
        total = min(l_in + l_out, cap)
        return l_in, max(total - l_in, 0), self._blocks(total)

    def _sync_live(self, view: SchedulerView) -> LengthSums:
        """The live sums over the requests of ``view``: those that joined are added, those that left
        (finished, aborted, handed off) taken out; a request without max_tokens counts as it stands.
        Set operations on ids, so a long queue costs no Python loop when a few requests come and go."""
        cap = view.num_total_blocks * view.block_size
        # the same requests in the same order as last step (compared by identity, at C speed)
        key = (view.running, view.waiting, cap, self.block_size)
        if key != self._members:
            if self._members is not None and key[2:] != self._members[2:]:
                self._live, self._open, self.live = {}, {}, LengthSums()  # every term changed with the pool
            now = dict(zip(map(id, view.running), view.running, strict=True))
            now.update(zip(map(id, view.waiting), view.waiting, strict=True))
            for k in self._live.keys() - now.keys():
                self.live.remove(*self._live.pop(k)[1])
            for k in self._open.keys() - now.keys():
                del self._open[k]
            for k in now.keys() - self._live.keys() - self._open.keys():
                r = now[k]
                if r.sampling_params.max_tokens is None:
                    self._open[k] = r
                else:
                    terms = self._lengths(r, cap)
                    self._live[k] = (r, terms)
                    self.live.add(*terms)
            self._members = key
        if not self._open:
            return self.live
        grown = LengthSums()
        for r in self._open.values():
            grown.add(*self._lengths(r, cap))
        return self.live.plus(grown)

    def estimate(self, view: SchedulerView) -> tuple[float, float, str]:
        """(mu, sigma) of one request's footprint in blocks, and where it came from."""
        # Pang Eq. 7: S = sum_{i=1..b_t} (l_in,i + l_out,i), each request's prompt and its whole output
        both = self.finished.plus(self._sync_live(view))
        self._last_means = (both.mean_in, both.mean_out, both.n - self.finished.n)
        if both.n:
            # Eq. 8's E[l_in] + E[l_out] as the mean footprint; Eq. 9's Var(l_in) + Var(l_out), in blocks
            return both.mean_blocks, math.sqrt(both.var_tokens) / (self.block_size or 1), "requests"
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
            mean_in, mean_out, live = self._last_means
            self._last = {"eta_blocks": eta, "mu_blocks": mu, "sigma_blocks": sigma, "l0_blocks": l0,
                          "b_eq12": clt_batch_size(mu, sigma, eta, self.theta), "b_eq14": b,
                          "mean_in_tokens": mean_in, "mean_out_tokens": mean_out, "live": live, "estimate": source}
            # Alg. 1 line 6: never below the running decodes (nor b_min), never above B_max
            self.b = min(max(b, n_decode, self.b_min), self.b_max)
        return StepCaps(max_num_seqs=self.b)  # Alg. 1 line 3: b_t = b_{t-1} when there is no prefill work

    def on_finished(self, request: Request) -> None:
        # aborted requests were cut short: their footprint says nothing of the workload
        if request.finish_reason is not FinishReason.ABORT and self.block_size is not None:
            # its real lengths; it leaves the live sums at the next update (it is no longer in the view)
            self.finished.add(request.num_prompt_tokens, len(request.output_token_ids), self._blocks(request.num_tokens))

    def state(self) -> MemoryState:
        return MemoryState(self.name, b_mem=self.b, eps_m=self.eps_m, theta=self.theta, samples=self.finished.n,
                           finished_mu_blocks=self.finished.mean_blocks, updates=self._updates, **self._last)


@register_policy("memory", params=MemoryParams)
def _memory(config: SchedulerConfig, params: MemoryParams) -> SchedulingPolicy:
    return MemoryPolicy(config, params)
