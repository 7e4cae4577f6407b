"""A KunServe pipeline group in the simulator: one scheduler over the group's pool, and what a
step of it costs (KunServe Sec. 4.1, 4.3). Pure.

After a drop, the group's ``k`` members each hold a contiguous stage of the layers and the KV
of those layers for every request of the group. So the group is one scheduler (the engine's
own) over one pool: in blocks of all layers, the smallest stage's room (its old KV budget plus
the weights it dropped, over its share of a token's KV). Its budgets are ``k`` times an
instance's (``k`` microbatches in flight, each as large as an instance's batch).

A step of the group (:class:`PipelineCostModel`): the plan's chunks become microbatches --
Fig. 11's cost-balanced lookahead (:func:`tidal.cluster.pressure.lookahead_microbatches`, Eq. 1
coefficients) or token counts (the vLLM/Sarathi pipelines) -- each costed by the instance's own
cost model; stage ``s`` does its share of the layers of it (``f_s`` of the time less the step
overhead, plus the overhead: each stage launches its own step), activations cross each stage
boundary on the link. The step takes :func:`tidal.cluster.pressure.pipeline_period`: the
microbatches circulate (a decode waits for its previous token), so the busiest stage or the
slowest microbatch's trip through all stages sets the pace, whichever is slower (Fig. 8).

``stage_gap_s`` (default 0) is idle time a stage spends per microbatch besides its work: the
hand-offs between stages, each stage's scheduling of the next microbatch, what a real pipeline
does not overlap. It is not a measured kernel: the KunServe experiment calibrates it so that the
simulated bubbles match the paper's measured ones (Sec. 5.3: 21.9 % without lookahead, 8.3 %
with), a sensitivity row beside the default cost (:mod:`tidal.experiments.kunserve_pipeline_fit`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from tidal.cluster.pressure import (
    ChunkCost,
    Span,
    fit_chunk_cost,
    lookahead_microbatches,
    pipeline_period,
    token_microbatches,
)
from tidal.config import SchedulerConfig
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim.analytic import AnalyticCostModel
from tidal.sim.cost_model import CostModel
from tidal.sim.instance import SimInstance
from tidal.sim.pressure import PressureConfig

_SAMPLING = SamplingParams(max_tokens=1)


def _chunk(p: int, c: int, rid: str = "x") -> ScheduledChunk:
    return ScheduledChunk(rid, (0,) * c, p, (), False, _SAMPLING)


def fit_eq1(base: CostModel, max_tokens: int = 512) -> ChunkCost:
    """Eq. 1's alpha, beta, gamma for ``base``, "profiled offline" (Sec. 4.3) on the simulator's
    own cost model: each chunk's *marginal* cost when added to a compute-bound step of
    ``max_tokens`` prefill tokens (the throttled case the lookahead serves), for decodes at
    contexts of 64-8K and prefill chunks of 16-``max_tokens`` tokens after prefixes of 0-4K, fitted
    by least squares on relative error, non-negative."""
    ref = [_chunk(0, max_tokens, "ref")]
    t_ref = base.step_time(StepPlan(0, tuple(ref), BatchComposition.of(ref)))
    shapes = [(p, 1) for p in (64, 256, 1024, 4096, 8192)]
    shapes += [(p, c) for p in (0, 512, 2048, 4096) for c in (16, 64, 256, max_tokens)]
    points = []
    for p, c in shapes:
        plan = [*ref, _chunk(p, c)]
        points.append((p, c, base.step_time(StepPlan(0, tuple(plan), BatchComposition.of(plan))) - t_ref))
    return fit_chunk_cost(points, relative=True)


def analytic_eq1(model: AnalyticCostModel) -> ChunkCost:
    """Eq. 1's alpha, beta, gamma derived from the hardware model (Sec. 4.3): seconds per
    attention pair (its FLOPs over the achieved FLOP/s), per token (the layers' linear FLOPs and
    the all-reduces), and per chunk (the engine's CPU time per sequence). The analytic marginal
    cost of a chunk that samples nothing, added to a compute-bound step, whose attention is
    compute bound (a prefill chunk), is exactly this plus, on hardware whose causal kernel pays
    more than the (c^2 + c)/2 self pairs (``attn_self_factor`` > 1, calibrated A100s), that excess,
    which Eq. 1 has no term for; a memory-bound chunk (a decode reading a long KV) costs more."""
    return ChunkCost(model._s_per_pair, model._s_per_token_linear + model._s_per_token_allreduce, model._s_per_seq)


def chunk_cost_for(base: CostModel, max_tokens: int = 512) -> ChunkCost:
    """The lookahead's Eq. 1 coefficients for ``base``: from the hardware model when it is the
    analytic one, else fitted to it (:func:`fit_eq1`)."""
    return analytic_eq1(base) if isinstance(base, AnalyticCostModel) else fit_eq1(base, max_tokens)


class PipelineCostModel:
    name = "pipeline"

    def __init__(self, base: CostModel, fractions: Sequence[float], cfg: PressureConfig, overhead_s: float):
        self.base, self.fractions, self.cfg, self.overhead = base, list(fractions), cfg, overhead_s
        self.steps = 0
        self.busy_s = 0.0  # sum over stages of their work
        self.period_s = 0.0  # sum of the steps' periods
        self.microbatches = 0

    def microbatches_of(self, plan: StepPlan) -> list[list[Span]]:
        spans = [Span(c.request_id, c.start, c.num_tokens) for c in plan.chunks]
        k = len(self.fractions)
        if not self.cfg.lookahead:
            return token_microbatches(spans, k)
        total = sum(s.tokens for s in spans)
        return lookahead_microbatches(spans, self.cfg.chunk_cost, max(1, math.ceil(total / k)), k)

    def step_time(self, plan: StepPlan) -> float:
        swap = 0.0
        if plan.swap_out or plan.swap_in:
            swap = self.base.step_time(StepPlan(plan.step_id, (), BatchComposition(), plan.swap_out, plan.swap_in))
        if not plan.chunks:
            return swap
        by_id = {c.request_id: c for c in plan.chunks}
        stages: list[list[float]] = [[] for _ in self.fractions]
        biggest = 0
        mbs = self.microbatches_of(plan)
        for mb in mbs:
            sub = []
            for s in mb:
                c = by_id[s.request_id]
                last = s.prefix + s.tokens == c.start + c.num_tokens
                sub.append(ScheduledChunk(s.request_id, (0,) * s.tokens, s.prefix, (), c.sample and last, c.sampling))
            t = self.base.step_time(StepPlan(plan.step_id, tuple(sub), BatchComposition.of(sub)))
            o = min(self.overhead, t)
            for stage, f in zip(stages, self.fractions, strict=True):
                stage.append(f * (t - o) + o)
            biggest = max(biggest, sum(s.tokens for s in mb))
        transfer = self.cfg.link.chunk_time(biggest * self.cfg.hidden_bytes, self.cfg.tp)
        gap = self.cfg.stage_gap_s  # idle, so in the period and not in the stages' work
        period = pipeline_period([[c + gap for c in st] for st in stages] if gap else stages, transfer)
        self.steps += 1
        self.microbatches += len(mbs)
        self.busy_s += sum(sum(s) for s in stages)
        self.period_s += period
        return period + swap

    def bubble(self) -> float:
        """Idle share of the stages over every step so far (Sec. 5.3's bubble time)."""
        k = len(self.fractions)
        return max(0.0, 1.0 - self.busy_s / (k * self.period_s)) if self.period_s else 0.0


def group_blocks(members: Sequence[SimInstance], layers: dict[int, tuple[int, int]], cfg: PressureConfig) -> int:
    """The group's pool in blocks of all layers: each stage's KV budget plus the weights it no
    longer holds, over its share of a token's KV; the smallest stage bounds it."""
    L, block_bytes = cfg.model.num_layers, cfg.model.block_bytes(members[0].block_size)
    best = None
    for m in members:
        a, b = layers[m.index]
        room = m.kv.num_blocks * block_bytes + (L - (b - a)) * cfg.model.layer_bytes
        blocks = int(room * L // ((b - a) * block_bytes))
        best = blocks if best is None else min(best, blocks)
    assert best is not None
    return best


class GroupInstance(SimInstance):
    """The simulated executor of a pipeline group, at its first stage's index. Its timeline is
    the first stage's, and each sample is copied to the other members' timelines."""

    def __init__(self, members: Sequence[SimInstance], layers: dict[int, tuple[int, int]], cfg: PressureConfig,
                 config: SchedulerConfig, base_cost: CostModel, overhead_s: float, now: float):
        lead, k = members[0], len(members)
        fractions = [(layers[m.index][1] - layers[m.index][0]) / cfg.model.num_layers for m in members]
        cost = PipelineCostModel(base_cost, fractions, cfg, overhead_s)
        host = sum(m.kv.host_pool.num_blocks for m in members)
        group_cfg = replace(config, max_num_seqs=config.max_num_seqs * k,
                            max_num_batched_tokens=config.max_num_batched_tokens * k)
        super().__init__(lead.index, group_cfg, group_blocks(members, layers, cfg), lead.block_size, cost,
                         lead.max_model_len, num_host_blocks=host, enable_caching=lead.kv.enable_caching)
        # its requests' KV is spread over the stages: a group preempts by recompute, as the engine's do
        # (tidal.engine.pool: a swap copy on one stage would lack the others' layers)
        self.scheduler.preemption_mode = "recompute"
        self.members = list(members)
        self.layers = {m.index: layers[m.index] for m in members}
        self.pipeline = cost
        self.timeline = lead.timeline
        self.formed_s = now

    @property
    def group(self) -> tuple[int, ...]:
        return tuple(m.index for m in self.members)

    def begin_step(self, now: float):  # type: ignore[no-untyped-def]
        tl = self.timeline
        n = len(tl.t)
        out = super().begin_step(now)
        if len(tl.t) > n:
            for m in self.members[1:]:
                m.timeline.sample(tl.t[-1], tl.kv_usage[-1], tl.waiting[-1], tl.running[-1], tl.batch_size[-1],
                                  tl.kv_demand[-1])
        return out

    def stats(self) -> dict:
        return {"group": list(self.group), "layers": {i: list(v) for i, v in self.layers.items()},
                "num_blocks": self.kv.num_blocks, "formed_s": self.formed_s, "steps": self.num_steps,
                "busy_time_s": self.busy_time, "num_preemptions": self.scheduler.num_preemptions,
                "num_swap_preemptions": self.scheduler.num_swap_preemptions,
                "num_swap_fallbacks": self.scheduler.num_swap_fallbacks,
                "microbatches_per_step": self.pipeline.microbatches / self.pipeline.steps if self.pipeline.steps else None,
                "bubble_ratio": self.pipeline.bubble()}


__all__ = ["GroupInstance", "PipelineCostModel", "analytic_eq1", "chunk_cost_for", "fit_eq1", "group_blocks"]
