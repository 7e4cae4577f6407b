"""``slo-compose``: local SLO-aware batch composition (DynaServe, Alg. 2), with a profile table.

Each step, DynaServe's local scheduler does three things:

1. (line 1) It records the previous batch's (prefill tokens, mean decode context, decode count,
   time, and its prefill chunks' prefixes) in the profile table. This happens in ``observe``, from the plan and its StepResult.
2. (line 2) The batch takes all decodes first. M <- MAXPREFILLALLOWED(T, S, ctx, dnum) is the
   largest prefill budget whose predicted step time is within the target S. It is found by a
   binary search on M over the table's prediction (:meth:`ProfileTable.max_prefill`). Here ctx
   is the mean context of the decodes after the step and dnum is the number of decodes. The M
   tokens are costed as the chunks they will buy (:meth:`SLOComposePolicy.prefill_queue`): the
   running prefills, then the waiting requests, each chunk after its own cached prefix, so a
   chunk deep into a long prompt gets the smaller budget its attention leaves.
3. (lines 3-8) Waiting prefills take min(tokens, M) in FCFS order until M runs out.

The scheduler schedules running requests first, in admission order. Running prefills come after
the decodes there, because a request admitted later can only enter a step that the earlier one
finished its prompt in. Admission is then FCFS: the baseline order (priority first, then
arrival). So the policy only has to set the step's token budget: ``token_budget`` returns
N_decodes + M. M is at least ``slo-compose.min_prefill`` (default: one KV block), so prefill never
starves when the decodes alone fill the SLO. The budget is at most
``config.max_num_batched_tokens``.

S is ``slo-compose.tbt_slo_ms`` (else ``config.tbt_slo_ms``) x ``slo-compose.slo_scale`` (default
1.0; below 1 leaves headroom for noise, since the table predicts means). With
``slo-compose.catch_up`` a step aims at S less the longest time any of its decodes has already
waited since its last token (``Request.last_token_time``): 0 for the decodes of the step that just
ended, but a request whose KV hand-off landed while a step ran (DynaServe's beta) has waited, so
the next step shrinks to keep its gap within S ("if latency approaches the SLO, it reconfigures
per-batch composition", Sec. 3.1). The grid is set by
``slo-compose.prefill_bucket`` / ``context_bucket`` / ``decode_bucket``. A profile measured
offline can be given to :meth:`SLOComposePolicy.seed` (``ProfileTable.load`` format).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from tidal.config import SchedulerConfig
from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.policies.params import PolicyParams
from tidal.policies.profile_table import ProfileTable, prefill_shape
from tidal.policies.registry import register_policy
from tidal.policies.sla import d_sla_seconds

NAME = "slo-compose"


class SLOComposeParams(PolicyParams):
    tbt_slo_ms: float | None = Field(None, gt=0, description="the TBT SLO S; default: tbt_slo_ms")
    slo_scale: float = Field(1.0, gt=0, description="S is scaled by this (below 1 leaves headroom)")
    min_prefill: int = Field(0, ge=0, description="least prefill tokens per step; 0: one KV block")
    prefill_bucket: int = Field(64, ge=1, description="profile table grid: prefill tokens")
    context_bucket: int = Field(256, ge=1, description="profile table grid: mean decode context")
    decode_bucket: int = Field(4, ge=1, description="profile table grid: decode count")
    catch_up: bool = Field(False, description="aim at S less the longest wait of a decode since its last token")


@dataclass(frozen=True, slots=True)
class SLOComposeState(PolicyState):
    M: int = 0
    token_budget: int = 0
    target_ms: float = 0.0
    decode_context: float = 0.0
    decode_count: int = 0
    table_cells: int = 0
    table_samples: int = 0
    last_predicted_ms: float | None = None
    last_measured_ms: float | None = None
    budget_predicted_ms: float | None = None
    step_target_ms: float = 0.0


class SLOComposePolicy(SchedulingPolicy):
    name = NAME

    def __init__(self, config: SchedulerConfig, table: ProfileTable | None = None,
                 params: SLOComposeParams | None = None):
        params = params or SLOComposeParams()
        self.target_s = d_sla_seconds(params.tbt_slo_ms, config, f"{NAME}.tbt_slo_ms") * params.slo_scale
        self.min_prefill = params.min_prefill  # 0: one KV block
        self.catch_up = params.catch_up
        self.target_now_s = self.target_s
        self.max_tokens = config.max_num_batched_tokens
        self.long_prefill_cap = config.long_prefill_token_threshold
        self.table = table or ProfileTable(prefill_bucket=params.prefill_bucket,
                                           context_bucket=params.context_bucket,
                                           decode_bucket=params.decode_bucket)
        self.M = self.max_tokens
        self.budget = self.max_tokens
        self._query: tuple[float, int] = (0.0, 0)
        self.last_predicted_s: float | None = None  # for the composition that actually ran
        self.last_measured_s: float | None = None
        self.last_budget_predicted_s: float | None = None  # for (M, ctx, dnum) when M was chosen

    def seed(self, profile: dict | list) -> None:
        self.table = ProfileTable.load(profile)

    def prefill_queue(self, view: SchedulerView, room: int) -> list[tuple[int, int]]:
        """The prefills the step's M tokens go to, in the scheduler's order, as ``(prefix, tokens)``:
        running prefills (admission order), then the waiting requests (FCFS), until they can take
        ``room`` tokens. Each takes at most what its chunk may (the uncomputed tokens, an alpha's
        split point, ``long_prefill_token_threshold``)."""
        out: list[tuple[int, int]] = []
        total = 0
        for r in (*(r for r in view.running if r.in_prefill), *view.waiting):
            if total >= room:
                break
            n = r.num_uncomputed_tokens
            if r.pause_at is not None:
                n = min(n, max(r.pause_at - r.num_computed_tokens, 1))
            if self.long_prefill_cap and n > 1:
                n = min(n, self.long_prefill_cap)
            if n > 0:
                out.append((r.num_computed_tokens, n))
                total += n
        return out

    def plan_step(self, view: SchedulerView) -> StepCaps:
        decodes = [r for r in view.running if not r.in_prefill]
        d = len(decodes)
        ctx = sum(r.num_computed_tokens + 1 for r in decodes) / d if d else 0.0  # context after the step
        room = max(self.max_tokens - d, 0)
        floor = min(self.min_prefill or view.block_size, room)
        target = self.target_s
        if self.catch_up:  # a decode that has waited (a landed hand-off) leaves the step less time
            waited = max((view.now - r.last_token_time for r in decodes if r.last_token_time is not None), default=0.0)
            target = max(target - waited, 0.0)
        self.target_now_s = target
        queue = self.prefill_queue(view, room)  # the chunks M will buy, each at its own prefix
        m = self.table.max_prefill(target, ctx, d, room, queue)  # DynaServe Alg. 2 line 2: MAXPREFILLALLOWED
        self.M = max(m, floor)
        self.budget = min(d + self.M, self.max_tokens)
        self._query = (ctx, d)
        # the step as it will run: M tokens, or all the queue holds when that is less
        self.last_budget_predicted_s = self.table.predict_queue(min(self.M, sum(n for _, n in queue)) if queue
                                                                else self.M, ctx, d, queue)
        return StepCaps(token_budget=self.budget)

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        comp = result.composition if result.composition.batch_size else plan.composition
        if not comp.batch_size or result.step_time_s <= 0:
            return
        dec = [c.context_len for c in plan.chunks if c.is_decode]
        ctx = sum(dec) / len(dec) if dec else 0.0
        p, prefix, sq = prefill_shape((c.start, c.num_tokens) for c in plan.chunks if not c.is_decode)
        if not plan.chunks:  # a composition without chunks (a test's): one chunk at prefix 0
            p, prefix, sq = comp.num_prefill_tokens, 0.0, float(comp.num_prefill_tokens) ** 2
        d = comp.num_decode_seqs
        self.last_predicted_s = self.table.predict(p, ctx, d, prefix, sq)
        self.last_measured_s = result.step_time_s
        self.table.record(p, ctx, d, result.step_time_s, prefix=prefix, sq=sq)  # DynaServe Alg. 2 line 1: RECORD

    def state(self) -> SLOComposeState:
        def ms(x: float | None) -> float | None:
            return None if x is None else x * 1e3
        return SLOComposeState(self.name, M=self.M, token_budget=self.budget, target_ms=self.target_s * 1e3,
                               decode_context=self._query[0], decode_count=self._query[1],
                               table_cells=len(self.table), table_samples=self.table.num_samples,
                               last_predicted_ms=ms(self.last_predicted_s), last_measured_ms=ms(self.last_measured_s),
                               budget_predicted_ms=ms(self.last_budget_predicted_s),
                               step_target_ms=self.target_now_s * 1e3)


@register_policy(NAME, params=SLOComposeParams)
def _slo_compose(config: SchedulerConfig, params: SLOComposeParams) -> SchedulingPolicy:
    return SLOComposePolicy(config, params=params)
