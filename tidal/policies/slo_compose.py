"""``slo-compose``: local SLO-aware batch composition (DynaServe, Alg. 2), with a profile table.

Each step, DynaServe's local scheduler does three things:

1. (line 1) It records the previous batch's (prefill tokens, mean decode context, decode count,
   time) in the profile table. This happens in ``observe``, from the plan and its StepResult.
2. (line 2) The batch takes all decodes first. M <- MAXPREFILLALLOWED(T, S, ctx, dnum) is the
   largest prefill budget whose predicted step time is within the target S. It is found by a
   binary search on M over the table's prediction (:meth:`ProfileTable.max_prefill`). Here ctx
   is the mean context of the decodes after the step and dnum is the number of decodes.
3. (lines 3-8) Waiting prefills take min(tokens, M) in FCFS order until M runs out.

The scheduler schedules running requests first, in admission order. Running prefills come after
the decodes there, because a request admitted later can only enter a step that the earlier one
finished its prompt in. Admission is then FCFS: the baseline order (priority first, then
arrival). So the policy only has to set the step's token budget: ``token_budget`` returns
N_decodes + M. M is at least ``slo-compose.min_prefill`` (default: one KV block), so prefill never
starves when the decodes alone fill the SLO. The budget is at most
``config.max_num_batched_tokens``.

S is ``slo-compose.tbt_slo_ms`` (else ``config.tbt_slo_ms``) x ``slo-compose.slo_scale`` (default
1.0; below 1 leaves headroom for noise, since the table predicts means). The grid is set by
``slo-compose.prefill_bucket`` / ``context_bucket`` / ``decode_bucket``. A profile measured
offline can be given to :meth:`SLOComposePolicy.seed` (``ProfileTable.load`` format).
"""

from __future__ import annotations

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import SchedulerView, SchedulingPolicy
from tidal.policies.profile_table import ProfileTable
from tidal.policies.registry import register_policy
from tidal.policies.sla import d_sla_seconds

NAME = "slo-compose"


class SLOComposePolicy(SchedulingPolicy):
    name = NAME

    def __init__(self, config: SchedulerConfig, table: ProfileTable | None = None):
        scale = config.policy_arg(f"{NAME}.slo_scale", 1.0)
        if scale <= 0:
            raise ConfigError(f"{NAME}.slo_scale must be > 0, got {scale}")
        self.target_s = d_sla_seconds(config, f"{NAME}.tbt_slo_ms") * scale
        self.min_prefill = config.policy_arg(f"{NAME}.min_prefill", 0)  # 0: one KV block
        if self.min_prefill < 0:
            raise ConfigError(f"{NAME}.min_prefill must be >= 0")
        self.max_tokens = config.max_num_batched_tokens
        self.table = table or ProfileTable(
            prefill_bucket=config.policy_arg(f"{NAME}.prefill_bucket", 64),
            context_bucket=config.policy_arg(f"{NAME}.context_bucket", 256),
            decode_bucket=config.policy_arg(f"{NAME}.decode_bucket", 4))
        self.M = self.max_tokens
        self.budget = self.max_tokens
        self._query: tuple[float, int] = (0.0, 0)
        self.last_predicted_s: float | None = None  # for the composition that actually ran
        self.last_measured_s: float | None = None
        self.last_budget_predicted_s: float | None = None  # for (M, ctx, dnum) when M was chosen

    def seed(self, profile: dict | list) -> None:
        self.table = ProfileTable.load(profile)

    def token_budget(self, view: SchedulerView) -> int:
        decodes = [r for r in view.running if not r.in_prefill]
        d = len(decodes)
        ctx = sum(r.num_computed_tokens + 1 for r in decodes) / d if d else 0.0  # context after the step
        room = max(self.max_tokens - d, 0)
        floor = min(self.min_prefill or view.block_size, room)
        m = self.table.max_prefill(self.target_s, ctx, d, room)  # DynaServe Alg. 2 line 2: MAXPREFILLALLOWED
        self.M = max(m, floor)
        self.budget = min(d + self.M, self.max_tokens)
        self._query = (ctx, d)
        self.last_budget_predicted_s = self.table.predict(self.M, ctx, d)
        return self.budget

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        comp = result.composition if result.composition.batch_size else plan.composition
        if not comp.batch_size or result.step_time_s <= 0:
            return
        dec = [c.context_len for c in plan.chunks if c.is_decode]
        ctx = sum(dec) / len(dec) if dec else 0.0
        p, d = comp.num_prefill_tokens, comp.num_decode_seqs
        self.last_predicted_s = self.table.predict(p, ctx, d)
        self.last_measured_s = result.step_time_s
        self.table.record(p, ctx, d, result.step_time_s)  # DynaServe Alg. 2 line 1: RECORD

    def state(self) -> dict:
        return {"policy": self.name, "M": self.M, "token_budget": self.budget,
                "target_ms": self.target_s * 1e3, "decode_context": self._query[0],
                "decode_count": self._query[1], "table_cells": len(self.table),
                "table_samples": self.table.num_samples,
                "last_predicted_ms": None if self.last_predicted_s is None else self.last_predicted_s * 1e3,
                "last_measured_ms": None if self.last_measured_s is None else self.last_measured_s * 1e3,
                "budget_predicted_ms": (None if self.last_budget_predicted_s is None
                                        else self.last_budget_predicted_s * 1e3)}


@register_policy(NAME)
def _slo_compose(config: SchedulerConfig) -> SchedulingPolicy:
    return SLOComposePolicy(config)
