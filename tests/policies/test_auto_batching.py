"""``auto`` batching: each step's caps are the tightest of Pang's b_mem and b_SLA and of the TBT
token budget (the tighter of DynaServe's composer and Pang's chunk search once the composer's table
can predict, the search's before), each
equal to what that controller alone answers on the same steps, with the binding constraint named."""

from __future__ import annotations

import pytest

from tests.policies.test_memory import req, view
from tests.policies.test_sla import decode_step
from tidal.config import ConfigError, SchedulerConfig
from tidal.core.plan import BatchComposition, StepPlan, StepResult
from tidal.policies import build_policy
from tidal.policies.auto import AutoBatchPolicy


def build(max_seqs=256, slo=None, **args) -> AutoBatchPolicy:
    return build_policy(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=512, tbt_slo_ms=slo,
                                        batching="auto", policy_args={f"auto.{k}": v for k, v in args.items()}))


def alone(name: str, slo=None, max_seqs=256):
    return build_policy(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=512, tbt_slo_ms=slo,
                                        batching=name))


def test_without_a_slo_the_kv_pool_alone_binds_as_pangs_alg1():
    pol, mem = build(), alone("memory")
    # 20 waiting requests of 800 + 200 tokens (63 blocks each) on a 1000-block pool: b_mem about 15
    v = view(waiting=[req(f"w{i}", 800, 200, computed=0) for i in range(20)])
    caps = pol.plan_step(v)
    assert caps.max_num_seqs == mem.plan_step(v).max_num_seqs < 256
    st = pol.state()
    assert (st.batch_binds, st.tokens_binds, st.tokens_from) == ("kv-pool", "configured", "none")
    assert caps.token_budget == 512 and st.steps_by_binding == {"batch:kv-pool": 1, "tokens:configured": 1}
    fresh = build()  # nothing to size a batch from yet (Alg. 1 line 3 keeps B_max): the configured cap
    assert fresh.plan_step(view()).max_num_seqs == 256 and fresh.state().batch_binds == "configured"


def test_the_tbt_slo_binds_the_batch_when_decodes_would_miss_it():
    pol, sla = build(slo=50.0), alone("sla", slo=50.0)
    # decode steps at t(b) = 10 ms + 0.5 ms x b: Pang's Alg. 2 settles at b = 80, far under b_mem (a free pool)
    for _ in range(200):
        for p in (pol, sla):
            b = p.plan_step(view()).max_num_seqs
            p.observe(*decode_step(b, 0.010 + 0.0005 * b))
    v = view()
    assert pol.plan_step(v).max_num_seqs == sla.plan_step(v).max_num_seqs < 100
    st = pol.state()
    assert st.batch_binds == "tbt-slo" and st.b_sla == st.batch_cap < st.b_mem


def test_the_token_budget_is_the_chunk_search_then_the_tighter_of_it_and_the_composer():
    pol = build(slo=50.0, min_samples=4)
    sla, comp = alone("sla", slo=50.0), alone("slo-compose", slo=50.0)
    v = view(running=[req(f"d{i}", 100, 50, outputs=3) for i in range(8)], waiting=[req("w", 2000, 10, computed=0)])
    pol.plan_step(v)
    assert pol.state().tokens_from == "sla-search" and pol.state().token_budget == sla.plan_step(v).token_budget
    for k in range(4):  # steps of 8 decodes and a growing prefill at 5 ms + 40 us a token
        comp_ = BatchComposition(num_prefill_tokens=64 * (k + 1), num_prefill_seqs=1, num_decode_seqs=8)
        plan, res = StepPlan(0, (), comp_), StepResult(0, step_time_s=0.005 + 40e-6 * 64 * (k + 1), composition=comp_)
        for p in (pol, sla, comp):
            p.plan_step(v)
            p.observe(plan, res)
    caps = pol.plan_step(v)
    st = pol.state()
    assert st.tokens_composer == comp.plan_step(v).token_budget and st.tokens_sla == sla.plan_step(v).token_budget
    tighter = min(st.tokens_composer, st.tokens_sla)
    assert st.tokens_from == ("composer" if st.tokens_composer < st.tokens_sla else "sla-search")
    assert caps.token_budget == min(tighter, 512)
    assert st.tokens_binds == ("tbt-slo" if tighter < 512 else "configured")
    # here the composer would allow the whole configured budget, the search less: the search's answer binds
    assert st.tokens_sla < st.tokens_composer and caps.token_budget == st.tokens_sla


def test_auto_is_registered_and_checks_its_arguments():
    assert isinstance(build(), AutoBatchPolicy)
    with pytest.raises(ConfigError, match="auto.min_samples"):
        build(min_samples=0)
    with pytest.raises(ConfigError, match="unknown parameter"):
        build(alpha=3)
