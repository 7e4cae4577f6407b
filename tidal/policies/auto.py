"""``auto``: the step's batch cap and token budget from whichever constraint binds now, the KV pool
or the TBT SLO, with the reason recorded (``--batching auto``).

Three controllers run side by side, each as its own paper wrote it, and each step takes the
tightest of their answers (Pang et al. Sec. III-B: b* = min(b_mem, b_SLA); "the same control" for
the prefill chunk):

- **the KV pool** (:mod:`tidal.policies.memory`, Pang Alg. 1, Eq. 7-14): b_mem, the largest batch
  whose KV fits the pool with probability 1 - eps_M;
- **the TBT SLO, batch** (:mod:`tidal.policies.sla`, Pang Alg. 2): b_SLA, the bounded binary
  search that keeps the measured decode step within D_SLA;
- **the TBT SLO, tokens**: Pang's chunk search (Alg. 2 applied to the chunk,
  :class:`tidal.policies.sla.SLAPolicy`'s ``chunk_tokens``) and DynaServe's composer
  (:mod:`tidal.policies.slo_compose`, Alg. 2: the most prefill tokens whose predicted step stays
  within the SLO), the tighter of the two once the composer's profile table has seen
  ``auto.min_samples`` steps to predict from, the search's alone before.

  The tighter of the two is a revision: the first version took the composer's budget alone once it
  was ready, and on Pang's own setup (out-61, ``tidal bench sim-auto --parts pang``) its steps ran
  at the SLO itself, so that a hair over it cost attainment and auto's capacity was below the
  paper's controller's on every seed; taking the tightest answer is the rule the
  batch cap already followed (Pang Sec. III-B's min).

The caps are never above the configured ones (``max_num_seqs``, or ``memory.b_max`` as the
memory policy raises it; ``max_num_batched_tokens``). Without a TBT SLO (no ``tbt_slo_ms``) only
the KV pool binds. Each step records which constraint set each cap (``kv-pool``, ``tbt-slo``,
``configured``) and the state counts them, so ``/admin/state`` says why the batch is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from tidal.config import SchedulerConfig
from tidal.core.plan import StepPlan, StepResult
from tidal.core.policy import PolicyState, SchedulerView, SchedulingPolicy, StepCaps
from tidal.core.request import Request
from tidal.policies.memory import MemoryParams, MemoryPolicy
from tidal.policies.params import PolicyParams
from tidal.policies.registry import register_policy
from tidal.policies.sla import SLAParams, SLAPolicy
from tidal.policies.slo_compose import SLOComposeParams, SLOComposePolicy

NAME = "auto"


class AutoBatchParams(PolicyParams):
    tbt_slo_ms: float | None = Field(None, gt=0, description="the TBT SLO; default: tbt_slo_ms (none: the KV pool only)")
    eps_m: float = Field(0.05, gt=0.0, lt=1.0, description="memory's eps_M: allowed probability of overflowing the pool")
    b_max: int = Field(0, ge=0, description="memory's B_max (0: max_num_seqs); may exceed it")
    min_samples: int = Field(16, ge=1, description="steps the composer's profile table needs before it sets the budget")


@dataclass(frozen=True, slots=True)
class AutoBatchState(PolicyState):
    batch_cap: int = 0
    token_budget: int = 0
    batch_binds: str = ""  # kv-pool | tbt-slo | configured
    tokens_binds: str = ""  # tbt-slo | configured
    tokens_from: str = ""  # composer | sla-search | none: which TBT controller gave the (tighter) token budget
    b_mem: int = 0
    b_sla: int | None = None
    tokens_sla: int | None = None
    tokens_composer: int | None = None
    tbt_slo_ms: float | None = None
    steps_by_binding: dict = field(default_factory=dict)  # "batch:kv-pool" -> steps, "tokens:tbt-slo" -> ...


class AutoBatchPolicy(SchedulingPolicy):
    name = NAME

    def __init__(self, config: SchedulerConfig, params: AutoBatchParams | None = None):
        params = params or AutoBatchParams()
        self.memory = MemoryPolicy(config, MemoryParams(eps_m=params.eps_m, b_max=params.b_max))
        slo = params.tbt_slo_ms if params.tbt_slo_ms is not None else config.tbt_slo_ms
        self.slo_ms = slo
        self.sla = SLAPolicy(config, SLAParams(d_sla_ms=slo)) if slo is not None else None
        self.composer = SLOComposePolicy(config, params=SLOComposeParams(tbt_slo_ms=slo)) if slo is not None else None
        self.min_samples = params.min_samples
        self.max_tokens = config.max_num_batched_tokens
        self.parts: list[SchedulingPolicy] = [p for p in (self.memory, self.sla, self.composer) if p is not None]
        self._last: dict = {}
        self.counts: dict[str, int] = {}

    def seq_ceiling(self, configured: int) -> int:
        return self.memory.seq_ceiling(configured)

    def plan_step(self, view: SchedulerView) -> StepCaps:
        ceiling = self.seq_ceiling(view.max_num_seqs)
        b_mem = self.memory.plan_step(view).max_num_seqs
        batch = {"configured": ceiling, "kv-pool": b_mem if b_mem is not None else ceiling}
        tokens = {"configured": view.max_num_batched_tokens}
        b_sla = t_sla = t_comp = None
        source = "none"
        if self.sla is not None and self.composer is not None:
            caps = self.sla.plan_step(view)
            b_sla, t_sla = caps.max_num_seqs, caps.token_budget
            t_comp = self.composer.plan_step(view).token_budget
            batch["tbt-slo"] = b_sla if b_sla is not None else ceiling
            ready = self.composer.table.num_samples >= self.min_samples
            given = {"sla-search": t_sla, **({"composer": t_comp} if ready else {})}
            given = {k: v for k, v in given.items() if v}
            source = min(given, key=lambda k: (given[k], k)) if given else "none"
            tokens["tbt-slo"] = given.get(source) or view.max_num_batched_tokens
        # the tightest binds; on a tie the configured cap is named (nothing tighter), then the KV pool
        order = ("configured", "kv-pool", "tbt-slo")
        b_bind = min(batch, key=lambda k: (batch[k], order.index(k)))
        t_bind = min(tokens, key=lambda k: (tokens[k], order.index(k)))
        for key in (f"batch:{b_bind}", f"tokens:{t_bind}"):
            self.counts[key] = self.counts.get(key, 0) + 1
        self._last = {"batch_cap": batch[b_bind], "token_budget": tokens[t_bind], "batch_binds": b_bind,
                      "tokens_binds": t_bind, "tokens_from": source, "b_mem": batch["kv-pool"], "b_sla": b_sla,
                      "tokens_sla": t_sla, "tokens_composer": t_comp}
        return StepCaps(batch[b_bind], tokens[t_bind])

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        for p in self.parts:
            p.observe(plan, result)

    def on_finished(self, request: Request) -> None:
        for p in self.parts:
            p.on_finished(request)

    def state(self) -> AutoBatchState:
        return AutoBatchState(self.name, tbt_slo_ms=self.slo_ms, steps_by_binding=dict(self.counts), **self._last)


@register_policy(NAME, params=AutoBatchParams)
def _auto(config: SchedulerConfig, params: AutoBatchParams) -> SchedulingPolicy:
    return AutoBatchPolicy(config, params)


__all__ = ["AutoBatchParams", "AutoBatchPolicy", "AutoBatchState"]
