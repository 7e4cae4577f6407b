"""``memory``: Pang et al. Alg. 1 (Eq. 7-14) worked by hand, and the cap it puts on the real Scheduler."""

from __future__ import annotations

import math
from statistics import variance

import pytest

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import StepResult
from tidal.core.policy import SchedulerView
from tidal.core.request import FinishReason, Request, RequestStatus
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.policies.memory import (
    LengthSums,
    MemoryPolicy,
    clt_batch_size,
    linear_batch_size,
    safety_buffer,
    theta_of,
)


def req(rid: str, prompt_len: int, max_tokens: int | None = 4, outputs: int = 0, computed: int | None = None) -> Request:
    r = Request(rid, [100 + i % 50 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens))
    r.output_token_ids = [7] * outputs
    r.num_computed_tokens = r.num_tokens - 1 if computed is None else computed
    return r


def view(running=(), waiting=(), total=1000, free=None, block_size=16, max_seqs=256) -> SchedulerView:
    return SchedulerView(now=0.0, running=tuple(running), waiting=tuple(waiting),
                         num_free_blocks=total if free is None else free, num_total_blocks=total,
                         block_size=block_size, max_num_seqs=max_seqs, max_num_batched_tokens=512)


def test_theta_is_the_normal_quantile():
    assert theta_of(0.05) == pytest.approx(1.644854, abs=1e-6)  # Phi^-1(0.95), from the table
    assert theta_of(0.01) == pytest.approx(2.326348, abs=1e-6)
    assert theta_of(0.5) == pytest.approx(0.0, abs=1e-12)


def test_eq12_and_eq14_by_hand():
    # mu = 10 blocks, sigma = 4 blocks, eps_M = 0.05 (theta = 1.644854), eta = 1000 blocks
    theta = 1.644854
    # Eq. 12: sigma*theta = 6.579416; (6.579416)^2 + 4*10*1000 = 40043.2887; sqrt = 200.108193
    #         b <= ((200.108193 - 6.579416) / 20)^2 = 9.676439^2 = 93.6335
    b12 = clt_batch_size(10, 4, 1000, theta)
    assert b12 == pytest.approx(93.6335, abs=1e-3)
    # Check against Eq. 11: mu_S + theta*sigma_S = 10*b + 6.579416*sqrt(b) = eta
    assert 10 * b12 + 4 * theta * math.sqrt(b12) == pytest.approx(1000, abs=1e-6)
    # L0 = theta*sigma_S at that b = 6.579416 * 9.676439 = 63.6653 blocks
    l0 = safety_buffer(10, 4, 1000, theta)
    assert l0 == pytest.approx(63.6653, abs=1e-3)
    # Eq. 14: floor((1000 - 63.6653) / 10) = floor(93.633) = 93
    assert linear_batch_size(1000, l0, 10) == 93
    # no variance: no buffer, b = eta / mu
    assert safety_buffer(10, 0, 1000, theta) == 0.0
    assert linear_batch_size(1000, 0.0, 10) == 100
    # a memory too small for one mean request gives 0 (the policy clamps it)
    assert linear_batch_size(5, 0.0, 10) == 0


def test_length_sums_match_the_textbook_formulas():
    xs_in, xs_out = [6, 10, 14, 3, 25, 9], [40, 2, 7, 7, 100, 1]
    sums = LengthSums()
    for a, b in zip(xs_in, xs_out, strict=True):
        sums.add(a, b, a + b)
    sums.add(99, 99, 99)
    sums.remove(99, 99, 99)

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    assert sums.n == 6 and sums.mean_in == pytest.approx(sum(xs_in) / 6)
    assert sums.var_tokens == pytest.approx(var(xs_in) + var(xs_out))  # Eq. 9: Var(l_in) + Var(l_out)
    assert sums.mean_blocks == pytest.approx((sum(xs_in) + sum(xs_out)) / 6)
    both = sums.plus(sums)
    assert both.n == 12 and both.mean_out == pytest.approx(sums.mean_out)


def finish(pol: MemoryPolicy, r: Request, reason: FinishReason = FinishReason.STOP) -> None:
    r.status, r.finish_reason = RequestStatus.FINISHED, reason
    pol.on_finished(r)


def test_policy_computes_alg1_from_every_request_and_clamps():
    cfg = SchedulerConfig(max_num_seqs=256, batching="memory", policy_args={"memory.eps_m": 0.05, "memory.l0_every": 1})
    pol = build_policy(cfg)
    # three finished requests of 6, 10 and 14 blocks (block_size 16): mu = 10 blocks; Eq. 9's variance
    # Var(l_in) + Var(l_out) of prompts 80, 150, 200 and outputs 16, 10, 24 tokens
    fin = [req("f1", 80, outputs=16), req("f2", 150, outputs=10), req("f3", 200, outputs=24)]
    assert [math.ceil(r.num_tokens / 16) for r in fin] == [6, 10, 14]
    pol.plan_step(view(waiting=fin))  # the policy sees them while they are queued...
    for r in fin:  # ... and they finish
        finish(pol, r)
    assert pol.finished.n == 3
    assert pol.finished.var_tokens == pytest.approx(variance([80, 150, 200]) + variance([16, 10, 24]))
    # prefill work waiting: w (150 + 10 tokens = 10 blocks, the mean) joins the estimate, mu stays 10
    w = req("w", 150, max_tokens=10, computed=0)
    caps = pol.plan_step(view(waiting=[w]))
    st = pol.state()
    assert (st.mu_blocks, st.live, st.samples, st.estimate) == (pytest.approx(10.0), 1, 3, "requests")
    sigma = math.sqrt(variance([80, 150, 200, 150]) + variance([16, 10, 24, 10])) / 16  # Eq. 9, in blocks
    assert st.sigma_blocks == pytest.approx(sigma)
    b12 = clt_batch_size(10.0, sigma, 1000, theta_of(0.05))
    l0 = safety_buffer(10.0, sigma, 1000, theta_of(0.05))
    assert st.l0_blocks == pytest.approx(l0) and st.b_eq12 == pytest.approx(b12)
    assert caps.max_num_seqs == linear_batch_size(1000, l0, 10.0) == math.floor(b12)
    # line 6: never below the running decodes ...
    many = [req(f"m{i}", 150, max_tokens=10, outputs=1) for i in range(120)]
    assert pol.plan_step(view(running=many, waiting=[w])).max_num_seqs == 120
    # ... nor above B_max
    small = build_policy(SchedulerConfig(max_num_seqs=50, batching="memory"))
    assert small.plan_step(view(waiting=[w])).max_num_seqs == 50
    # line 4: no prefill work -> b_t = b_{t-1}
    b = pol.plan_step(view(running=many[:5], waiting=[w])).max_num_seqs
    assert pol.plan_step(view(running=many[:5], total=10)).max_num_seqs == b
    # a fixed L0 (memory.l0, blocks) replaces the CLT buffer: floor((1000 - 100) / 10) = 90
    fixed = build_policy(SchedulerConfig(max_num_seqs=256, batching="memory", policy_args={"memory.l0": 100}))
    assert fixed.plan_step(view(waiting=[req(f"w{i}", 100, max_tokens=60, computed=0) for i in range(4)])).max_num_seqs == 90


def test_the_requests_on_the_instance_count_by_their_max_tokens_or_what_they_produced():
    pol = MemoryPolicy(SchedulerConfig(max_num_seqs=256))
    # known max_tokens: (100 + 60) / 16 -> 10 blocks each; no variance -> b = 1000 / 10
    waiting = [req(f"w{i}", 100, max_tokens=60, computed=0) for i in range(4)]
    assert pol.plan_step(view(waiting=waiting)).max_num_seqs == 100
    assert pol.state().estimate == "requests" and pol.state().live == 4
    # no max_tokens: the tokens produced so far are a lower bound, and it grows as they do
    open_ended = req("o", 100, max_tokens=None, outputs=124)  # 224 tokens = 14 blocks
    pol.plan_step(view(running=[open_ended], waiting=waiting))
    assert pol.state().mu_blocks == pytest.approx((4 * 10 + 14) / 5)
    open_ended.output_token_ids += [7] * 32  # 256 tokens = 16 blocks
    pol.plan_step(view(running=[open_ended], waiting=waiting))
    assert pol.state().mu_blocks == pytest.approx((4 * 10 + 16) / 5)
    # aborted requests do not count: they were cut short; one that left leaves the live sums
    finish(pol, waiting[0], FinishReason.ABORT)
    pol.plan_step(view(running=[open_ended], waiting=waiting[1:]))
    assert pol.finished.n == 0 and pol.state().live == 4
    assert pol.state().mu_blocks == pytest.approx((3 * 10 + 16) / 4)


def test_short_requests_finishing_first_do_not_bias_the_estimate_low():
    """An all-at-once batch of short (2 blocks) and long (30 blocks) requests: the short ones finish
    first. Estimated from finished requests alone, mu would sink towards 2 blocks once they have;
    from every request on the instance it stays at the batch's mean, 16 blocks, all along."""
    cfg = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, batching="memory")
    sched = Scheduler(cfg, KVCacheManager(2000, 16), policy=build_policy(cfg), watermark=0.0)
    pol = sched.policy
    for i in range(200):
        # prompts of 16 tokens; outputs of 16 (short) or 464 (long) tokens: 2 or 30 blocks
        sched.add_request(Request(f"r{i}", [100 + i % 50] * 16, SamplingParams(max_tokens=16 if i % 2 else 464)))
    mus, finished_mus = [], []
    for step in range(5000):
        if not sched.has_unfinished():
            break
        plan = sched.schedule(step * 0.01)
        st = pol.state()
        if st.mu_blocks is not None and st.samples >= 8:
            mus.append(st.mu_blocks)
            finished_mus.append(st.finished_mu_blocks)
        sched.update(plan, StepResult(plan.step_id, sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                                      step_time_s=0.01, composition=plan.composition), step * 0.01)
    assert not sched.has_unfinished()
    assert mus and min(finished_mus) < 3  # the finished ones alone: the short ones, 2 blocks
    assert min(mus) == pytest.approx(16.0) and max(mus) == pytest.approx(16.0)


def test_bad_parameters_are_rejected():
    with pytest.raises(ConfigError, match="eps_m"):
        build_policy(SchedulerConfig(batching="memory", policy_args={"memory.eps_m": 1.5}))


def test_memory_cap_binds_on_the_real_scheduler():
    # 100 requests of 40 + 60 tokens = 7 blocks each (block 16); a 200-block pool fits 28 of them
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, batching="memory")
    sched = Scheduler(cfg, KVCacheManager(200, 16), policy=build_policy(cfg), watermark=0.0)
    for i in range(100):
        sched.add_request(Request(f"r{i}", [100 + i % 50] * 40, SamplingParams(max_tokens=60)))
    binding = 0
    for step in range(3000):
        if not sched.has_unfinished():
            break
        before = sched.num_running
        plan = sched.schedule(step * 0.01)
        cap = sched.last_caps.max_num_seqs
        assert sched.num_running <= cap or sched.num_running <= before
        binding += sched.num_running == cap < cfg.max_num_seqs and bool(sched.waiting)
        sched.update(plan, StepResult(plan.step_id, sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                                      step_time_s=0.01, composition=plan.composition), step * 0.01)
    assert not sched.has_unfinished()
    assert binding > 0
    assert sched.policy.state().b_mem == 28  # floor(200 / 7), sigma = 0
    assert sched.num_preemptions == 0


def _drive(sched: Scheduler, steps: int = 3000) -> int:
    """Run to the end with fake results; the most requests that ran at once."""
    most = 0
    for step in range(steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule(step * 0.01)
        most = max(most, sched.num_running)
        sched.update(plan, StepResult(plan.step_id, sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                                      step_time_s=0.01, composition=plan.composition), step * 0.01)
    assert not sched.has_unfinished()
    return most


def test_b_max_above_the_static_cap_raises_it_as_far_as_memory_allows():
    # 100 requests of 7 blocks, a 200-block pool: memory allows 28 at once; the static cap is 8
    def make(batching: str, **args: int) -> Scheduler:
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, batching=batching,
                              policy_args={f"memory.{k}": v for k, v in args.items()})
        sched = Scheduler(cfg, KVCacheManager(200, 16), policy=build_policy(cfg), watermark=0.0)
        for i in range(100):
            sched.add_request(Request(f"r{i}", [100 + i % 50] * 40, SamplingParams(max_tokens=60)))
        return sched

    assert _drive(make("continuous")) == 8  # vLLM's fixed cap
    assert _drive(make("memory")) == 8  # B_max = max_num_seqs: memory can only lower it
    raised = make("memory", b_max=64)
    assert raised.policy.seq_ceiling(8) == 64
    assert _drive(raised) == 28  # Eq. 14 (sigma = 0): floor(200 / 7), above the static cap
    assert raised.policy.state().b_mem == 28 and raised.num_preemptions == 0
    # B_max still bounds it from above
    assert _drive(make("memory", b_max=20)) == 20
    with pytest.raises(ConfigError, match="b_min"):
        build_policy(SchedulerConfig(batching="memory", policy_args={"memory.b_min": 30, "memory.b_max": 20}))
