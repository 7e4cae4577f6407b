"""Step-time tails: a cost model's steps with per-step jitter and mixed-step interference.

A roofline gives a step's mean time on the device. A real engine adds tails: host-side work
per sequence (scheduling, input preparation, sampling and output processing: Python, in vLLM
0.7's V0 engine) that stalls now and then, and a step that mixes a prefill chunk with decodes
pays more than the sum of its parts' roofline (separate prefill and decode attention kernels in
one forward, the decodes' metadata rebuilt around the chunk). DynaServe's own Table 1 shows
both: colocated decode-heavy serving (219 / 1467) at a p50 TBT of 48 ms has a p99 of 163 ms,
where the mean model gives 41 and 65.

:class:`JitteredCostModel` wraps any cost model. A step of ``n`` sequences, ``n_d`` of them
decodes, takes

    t = base + mixed_s * n_d [mixed steps only] + seq_s * n * exp(sigma * z - sigma^2 / 2)
        [+ the blocking receive of a hand-off that landed since the last step: see below]

- ``mixed_s``: seconds each decode of a *mixed* step (at least one prefill chunk and one decode)
  adds: the interference of a prefill beside the decodes (a step of 2,048 prefill tokens and a
  few decodes pays little, one of 219 tokens beside 100 decodes a lot);
- ``seq_s``: the mean host time per sequence per step, with a log-normal spread ``sigma``
  (z standard normal, one draw per step): the per-step jitter, absolute like the host work it
  stands for, so a 300 ms prefill step is not stretched by it as a 40 ms decode step is.

**The blocking receive** (``recv_bw``, ``recv_s``): the paper's 1P1D baseline is vLLM 0.7's
disaggregated prefill, whose decode worker pulls a request's KV from the prefill instance's lookup
buffer inside a step of its own, before its forward (the connector's ``recv_kv_caches_and_hidden_states``):
its running decodes wait ``recv_s + bytes / recv_bw``. The simulator charges that to the decode
instance's next step when a hand-off lands (:meth:`JitteredCostModel.receive_time`). Table 1 shows
it: 8192 / 32 under 1P1D has a p50 TBT of 23 ms but a p99 of 58 ms with 1-2 decodes a step, where
no per-sequence term reaches; an 8K prompt's KV is 1.6 GB (Qwen-2.5-14B: 48 layers x 8 KV heads x
128 x 2 x 2 bytes = 192 KiB a token). DynaServe's own chunked transfer (Sec. 4.3) overlaps with
computation, so a split's landings (:mod:`tidal.sim.split`) are not charged this.

**The testbed's attention** (``attn_compute_efficiency``, ``attn_self_factor``): the A100 spec's
attention terms are fitted to Vidur's kernel profiles (34 % of peak, paying the whole causal
square: an 8K prompt's prefill 1,442 ms), and Table 1's own baselines contradict them: the paper's
1P1D prefill GPU finished 8K prompts at 0.83 rps, at most 1,205 ms each. Two published sources
measured two software stacks; with ``fitted`` the simulator runs the testbed the tails were fitted
on, its prefill attention fitted on the same baselines (:func:`testbed`); ``off`` keeps Vidur's.

The parameters are fitted, by :mod:`tidal.experiments.jitter_fit` (``tidal bench
calibrate-jitter``), to the paper's baseline measurements only (Table 1's colocation and 1P1D
runs): never to the technique's own results. The draws come from the model's own
``random.Random(seed)``: a run is deterministic given the seed (the simulator calls the model in a
deterministic order). :data:`FITTED` holds the fitted values; ``--step-jitter off`` leaves the
base model alone.

Pure: no torch, no clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tidal.core.plan import StepPlan
from tidal.sim.cost_model import CostModel
from tidal.sim.hardware import HardwareSpec

MODES = ("off", "fitted")


@dataclass(frozen=True)
class JitterParams:
    seq_s: float = 0.0  # mean host seconds per sequence per step
    sigma: float = 0.0  # log-normal spread of that host time (one draw per step)
    mixed_s: float = 0.0  # seconds each decode of a mixed step adds
    recv_bw: float = 0.0  # bytes/s of a decode instance's blocking KV receive (0: the receive costs it nothing)
    recv_s: float = 0.0  # fixed seconds of one blocking receive
    # the testbed's prefill attention (0: the hardware spec's, i.e. Vidur's A100 fit): its kernels'
    # fraction of peak and the causal self factor (see the module's "The testbed's attention")
    attn_compute_efficiency: float = 0.0
    attn_self_factor: float = 0.0

    def __post_init__(self) -> None:
        if min(self.seq_s, self.sigma, self.mixed_s, self.recv_bw, self.recv_s) < 0:
            raise ValueError(f"jitter: need seq_s, sigma, mixed_s, recv_bw, recv_s >= 0; got {self}")
        if not 0.0 <= self.attn_compute_efficiency <= 1.0 or (0.0 < self.attn_self_factor < 1.0) \
                or self.attn_self_factor < 0:
            raise ValueError(f"jitter: attn_compute_efficiency must be in [0, 1] and attn_self_factor 0 (the "
                             f"hardware's) or >= 1; got {self}")

    @property
    def is_off(self) -> bool:
        return self.seq_s == 0 and self.mixed_s == 0 and self.recv_bw == 0 and self.recv_s == 0


def testbed(hw: HardwareSpec, params: JitterParams) -> HardwareSpec:
    """``hw`` with the testbed's prefill attention where ``params`` fits one (its other terms kept)."""
    changes: dict[str, float] = {}
    if params.attn_compute_efficiency:
        changes["attn_compute_efficiency"] = params.attn_compute_efficiency
    if params.attn_self_factor:
        changes["attn_self_factor"] = params.attn_self_factor
    return replace(hw, **changes) if changes else hw


# fitted by `tidal bench calibrate-jitter --search` to DynaServe's Table 1 (colocation and 1P1D,
# Qwen-2.5-14B on 2 x A100-80G); the fit's errors are what `tidal bench calibrate-jitter --output
# docs/results/jitter_fit.json` writes (read by `tidal reproduce dynaserve`), not restated here. The testbed's attention: 70 % of peak (FlashAttention-2's forward reaches about
# that on an A100) and a causal self factor of 1.15 (the masked blocks skipped, the diagonal ones
# paid); an 8K prompt's KV receive stops a 1P1D decode instance 29 ms (recv_bw 55 GB/s).
FITTED = JitterParams(seq_s=30e-6, sigma=1.2, mixed_s=0.45e-3, recv_bw=55e9, attn_compute_efficiency=0.7,
                      attn_self_factor=1.15)


class JitteredCostModel:
    """``base``'s step times with interference and host jitter (module docstring)."""

    def __init__(self, base: CostModel, params: JitterParams, seed: int = 0):
        self.base, self.params = base, params
        self.name = f"{base.name}+jitter"
        self.rng = random.Random(seed)
        self._half_var = 0.5 * params.sigma * params.sigma
        if hasattr(base, "decode_step_time") and hasattr(base, "decode_step_time_at"):
            self.decode_step_time = self._decode_step_time  # the simulator's fast path, jittered alike
            self.decode_step_time_at = self._decode_step_time_at

    def host(self, n: int) -> float:
        """One step's host time for ``n`` sequences (one draw)."""
        p = self.params
        if not p.seq_s or not n:
            return 0.0
        if not p.sigma:
            return p.seq_s * n
        return p.seq_s * n * math.exp(p.sigma * self.rng.gauss(0.0, 1.0) - self._half_var)

    def receive_time(self, nbytes: int) -> float:
        """Seconds a decode instance's steps stop while a hand-off of ``nbytes`` of KV lands
        (module docstring: the blocking receive)."""
        p = self.params
        return p.recv_s + (nbytes / p.recv_bw if p.recv_bw else 0.0)

    def step_time(self, plan: StepPlan) -> float:
        t = self.base.step_time(plan)
        chunks = plan.chunks
        if not chunks:
            return t
        if self.params.mixed_s:
            n_d = sum(1 for c in chunks if c.is_decode)
            if 0 < n_d < len(chunks):
                t += self.params.mixed_s * n_d
        return t + self.host(len(chunks))

    def _decode_step_time(self, positions: Sequence[tuple[str, int]]) -> float:
        return self.base.decode_step_time(positions) + self.host(len(positions))  # type: ignore[attr-defined]

    def _decode_step_time_at(self, positions: Sequence[int], ahead: int) -> float:
        return self.base.decode_step_time_at(positions, ahead) + self.host(len(positions))  # type: ignore[attr-defined]


def with_jitter(base: CostModel, mode: str, seed: int = 0, params: JitterParams | None = None) -> CostModel:
    """``base`` for ``mode`` "off"; wrapped with ``params`` (default :data:`FITTED`) for "fitted"."""
    if mode not in MODES:
        raise ValueError(f"step jitter must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "off":
        return base
    p = params or FITTED
    return base if p.is_off else JitteredCostModel(base, p, seed)


__all__ = ["FITTED", "MODES", "JitterParams", "JitteredCostModel", "testbed", "with_jitter"]
