"""``--router cache-aware``: send a request where its prefix is cached, unless load says otherwise (pure).

Per live instance, the router predicts the request's TTFT there: the prefill work ahead of it (the
prompt tokens queued there: its report's waiting and half-done prefills, and those the front end
sent it since) plus its own prompt less the prefix that instance holds cached, in steps of what the
token budget leaves beside the running decodes (each takes one token of it). Each step is priced by
the instance's fit of its own prefill steps (:mod:`tidal.cluster.step_fit`: step time on prefill
tokens, decodes and the chunks' attention over their prefix, the features of DynaServe Alg. 2's
profile table), the queue's chunks from their mean position and this prompt's from its cached prefix
on; until an instance has the fit, at its recent step time. (The first version priced every step at
the recent step time: an audit of its predictions against the TTFTs that followed, on Mooncake's
trace, found the TTFT of a cold 20K-token prompt predicted ~7x too short, as an instance that had
been decoding steps in ~20 ms, so a busy instance holding a long prefix lost to a cold prefill.) The
least prediction wins (ties: the longer cached prefix, then fewer outstanding
requests, then the lower index). A balance guard overrides it: when the outstanding requests of the
busiest and the idlest instance differ by more than ``balance_abs`` and by more than a factor
``balance_rel``, the request goes to the idlest, whatever is cached (load from the monitor, not from
the cache).

What the anchors do (none of their code is used): SGLang's router keeps an approximate radix tree per
worker and routes by the longest match when it covers at least ``cache_threshold`` (0.3 by default)
of the prompt, else to the smallest tree, switching to the least-loaded worker when loads are
imbalanced (``balance_abs_threshold`` 64 and ``balance_rel_threshold`` 1.5 by default: both must
hold); NVIDIA Dynamo's KV router scores each worker by a weighted sum of the prefill blocks still to
compute and its active decode blocks; Mooncake's Conductor predicts each instance's TTFT from its
queue and its local prefix (and would fetch a longer remote one); Preble exploits a long match and
explores by load otherwise. tidal's cost is Mooncake's kind (a TTFT estimate from queue and local
prefix); its guard is SGLang's, with SGLang's default thresholds.

``admission_ttft_s`` (``--admission-ttft-slo``, off by default): when even the best instance's
prediction exceeds it, the request is refused (Mooncake's early rejection) rather than queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidal.cluster.router import InstanceLoad, Router, RouteRequest
from tidal.policies.profile_table import steps_time

DEFAULT_STEP_S = 0.05  # an instance's step time before it reported one (only relative values matter)
DEFAULT_BUDGET = 512  # the token budget of an instance that has not said


@dataclass(frozen=True)
class CacheAwareParams:
    balance_abs: int = 64  # SGLang router's default balance_abs_threshold (outstanding requests)
    balance_rel: float = 1.5  # its default balance_rel_threshold
    admission_ttft_s: float | None = None  # refuse when no instance is predicted under this TTFT

    def __post_init__(self) -> None:
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError("the balance guard needs balance_abs >= 0 and balance_rel >= 1")
        if self.admission_ttft_s is not None and self.admission_ttft_s <= 0:
            raise ValueError("admission_ttft_s must be > 0")


def _get(inst: Any, name: str, default: Any) -> Any:
    v = getattr(inst, name, None)
    return default if v is None else v


def predicted_ttft(inst: InstanceLoad, prompt_len: int, cached: int, step_s: float | None = None) -> float:
    """Seconds until ``inst`` would sample the first token of a ``prompt_len``-token request of which it
    holds ``cached`` tokens: the queued prefill tokens and this prompt's uncached ones, in steps of the
    token budget less one token per running request. With the instance's fit of its prefill steps
    (``step_fit``) the steps are priced by it, each chunk with the attention over its prefix (the
    queue's from its mean position, this prompt's from ``cached`` on); without one, at its recent step
    time."""
    budget = _get(inst, "token_budget", DEFAULT_BUDGET)
    running = _get(inst, "num_running", 0)
    queued = _get(inst, "queued_prefill_tokens", 0)
    per_step = max(budget - running, 1)
    own = max(prompt_len - cached, 1)
    work = queued + own
    steps = -(-work // per_step)
    w = _get(inst, "step_fit", None)
    if w is not None:
        # the queue's chunks: sum(c_i * x_i) ~ Q * (mean position - chunk / 2); this prompt's exactly
        at = _get(inst, "queued_prefill_position", 0.0)
        full, rest = divmod(own, per_step)
        prefix_sum = max(0.0, queued * (at - per_step / 2)) + own * cached + per_step * (
            per_step * full * (full - 1) / 2 + rest * full)
        whole, part = divmod(work, per_step)
        t = steps_time(w, steps, work, prefix_sum, whole * per_step * per_step + part * part, running,
                       _get(inst, "decode_context", 0.0))
        if t > 0:
            return t
    return steps * (step_s if step_s is not None else _get(inst, "recent_step_s", DEFAULT_STEP_S))


class CacheAwareRouter(Router):
    name = "cache-aware"
    uses_cache = True

    def __init__(self, params: CacheAwareParams | None = None):
        self.params = params or CacheAwareParams()
        self.last: dict[str, Any] = {}  # the last decision's inputs and predictions (for /admin and tests)

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        idx = self.choose(req, instances)
        if idx is None:  # refused by the TTFT bound: the caller treats it as no instance
            raise NoInstanceMeetsSLO(self.last.get("best_ttft_s"))
        return idx

    def choose(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int | None:
        n = len(instances)
        cached = req.cached if len(req.cached) == n else (0,) * n
        loads = [inst.num_outstanding for inst in instances]
        hi, lo = max(loads), min(loads)
        p = self.params
        emas = [getattr(inst, "recent_step_s", None) for inst in instances]
        known = [e for e in emas if e]
        fallback = min(known) if known else DEFAULT_STEP_S  # an instance with no step yet: as fast as the fastest
        ttft = [predicted_ttft(inst, req.prompt_len, cached[k], emas[k] or fallback) for k, inst in enumerate(instances)]
        if hi - lo > p.balance_abs and hi > p.balance_rel * lo:
            best = min(range(n), key=lambda k: (loads[k], ttft[k], k))
            why = "balance"
        else:
            best = min(range(n), key=lambda k: (ttft[k], -cached[k], loads[k], k))
            why = "cost"
        self.last = {"request_id": req.request_id, "why": why, "choice": best, "cached": list(cached),
                     "predicted_ttft_s": ttft, "outstanding": loads, "best_ttft_s": ttft[best]}
        if p.admission_ttft_s is not None and ttft[best] > p.admission_ttft_s:
            return None
        return best


class NoInstanceMeetsSLO(RuntimeError):
    """``--admission-ttft-slo``: no instance is predicted to give the request its first token in time."""

    def __init__(self, best_ttft_s: float | None):
        super().__init__(f"no instance can start this request within the TTFT bound (best predicted "
                         f"{best_ttft_s:.2f} s)" if best_ttft_s is not None else "no instance meets the TTFT bound")
        self.best_ttft_s = best_ttft_s


__all__ = ["CacheAwareParams", "CacheAwareRouter", "NoInstanceMeetsSLO", "predicted_ttft"]
