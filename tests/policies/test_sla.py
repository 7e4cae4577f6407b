"""``sla``: Pang et al. Alg. 2 converging on synthetic linear latency, and ``memory+sla`` on the real Scheduler."""

from __future__ import annotations

import random

import pytest

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import BatchComposition, StepPlan, StepResult
from tidal.core.policy import SchedulerView
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.policies.compose import CompositePolicy
from tidal.policies.sla import BoundedBinarySearch, SLAPolicy

EMPTY = SchedulerView(now=0.0, running=(), waiting=(), num_free_blocks=100, num_total_blocks=100, block_size=16,
                      max_num_seqs=256, max_num_batched_tokens=512)


def decode_step(b: int, t: float, prefill: int = 0) -> tuple[StepPlan, StepResult]:
    comp = BatchComposition(num_prefill_tokens=prefill, num_prefill_seqs=1 if prefill else 0, num_decode_seqs=b)
    return StepPlan(0, (), comp), StepResult(0, step_time_s=t, composition=comp)


def drive(pol: SLAPolicy, a: float, c: float, steps: int, noise: float = 0.0, seed: int = 0) -> list[int]:
    """Each step runs a full batch of the controller's current cap, at t(b) = a + c*b (+ noise)."""
    rng = random.Random(seed)
    caps = []
    for _ in range(steps):
        b = pol.plan_step(EMPTY).max_num_seqs
        caps.append(b)
        pol.observe(*decode_step(b, (a + c * b) * (1 + rng.uniform(-noise, noise))))
    return caps


def sla(d_ms: float = 50.0, max_seqs: int = 256, **args) -> SLAPolicy:
    return build_policy(SchedulerConfig(max_num_seqs=max_seqs, tbt_slo_ms=d_ms, batching="sla",
                                        policy_args={f"sla.{k}": v for k, v in args.items()}))


@pytest.mark.parametrize("a, c, start_side", [
    (0.010, 0.0005, "above"),  # b* = (50 - 10) / 0.5 = 80; the search starts at (1 + 256) // 2 = 128
    (0.010, 0.0002, "below"),  # b* = 200; starts at 128
])
def test_converges_to_where_linear_latency_crosses_d_sla(a, c, start_side):
    pol = sla(window=1)
    b_star = (0.050 - a) / c
    caps = drive(pol, a, c, 40)
    assert (caps[0] > b_star) == (start_side == "above")
    # the band D_SLA +- eps_D (eps_D = 5% of 50 ms = 2.5 ms) is b* +- 2.5 ms / c
    tol = 0.0025 / c
    assert abs(caps[-1] - b_star) <= tol
    assert all(abs(b - b_star) <= tol for b in caps[-20:])  # and it stays there
    assert pol.state().batch_search.last_verdict == "within"


def test_binary_search_trace_by_hand():
    # Alg. 2 with alpha = 4, delta = 1, D = 50 ms, eps = 2.5 ms, space [1, 256], t(b) = 10 + 0.5 b ms
    s = BoundedBinarySearch(1, 256, 4, 1, 0.050, 0.0025)
    trace = [s.value]
    for _ in range(4):
        s.update(0.010 + 0.0005 * s.value, s.value)
        trace.append((s.low, s.high, s.value))
    assert trace == [
        128,
        (1, 128, 64),  # 74 ms > 52.5: high = max(128, 1 + 4), low = max(1 - 1, 1)
        (64, 129, 96),  # 42 ms < 47.5: low = min(64, 128 - 4), high = min(128 + 1, 256)
        (63, 96, 79),  # 58 ms > 52.5: high = max(96, 64 + 4), low = 64 - 1
        (77, 81, 79),  # 49.5 ms within: [79 - 2, 79 + 2]
    ]


def test_converges_with_noise_and_the_default_window():
    pol = sla()  # window 8
    caps = drive(pol, 0.010, 0.0005, 400, noise=0.03, seed=1)
    assert all(60 <= b <= 100 for b in caps[-100:]), caps[-100:]


def test_cap_never_below_running_decodes_and_only_decode_dominated_steps_count():
    pol = sla(window=1)
    running = tuple(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4), num_computed_tokens=1)
                    for i in range(200))  # 200 decodes (one token left each)
    v = SchedulerView(now=0.0, running=running, waiting=(), num_free_blocks=1, num_total_blocks=100,
                      block_size=16, max_num_seqs=256, max_num_batched_tokens=512)
    assert pol.plan_step(v).max_num_seqs == 200  # Alg. 2 line 18
    before = pol.batch.updates
    pol.observe(*decode_step(10, 0.5, prefill=400))  # prefill-dominated: the chunk controller's signal
    assert pol.batch.updates == before
    pol.observe(*decode_step(10, 0.5, prefill=0))
    assert pol.batch.updates == before + 1


def test_chunk_size_uses_the_same_search_in_tokens():
    pol = sla(window=1)
    v = SchedulerView(now=0.0, running=(), waiting=(), num_free_blocks=100, num_total_blocks=100, block_size=16,
                      max_num_seqs=256, max_num_batched_tokens=512)
    # space [16, 512] tokens, alpha = 4 blocks = 64 tokens, delta = 1 block; t = 5 ms + 0.1 ms/token -> 450 tokens
    budgets = []
    for _ in range(30):
        n = pol.plan_step(v).token_budget
        budgets.append(n)
        pol.observe(*decode_step(20, 0.005 + 0.0001 * n, prefill=n - 20))
    assert budgets[0] == (16 + 512) // 2  # Alg. 2 line 1: the middle of the search space
    assert abs(budgets[-1] - 450) <= 25  # band: 2.5 ms / 0.1 ms per token
    # the decodes are never cut: at least N_d + one block
    running = tuple(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4), num_computed_tokens=1) for i in range(500))
    v2 = SchedulerView(now=0.0, running=running, waiting=(), num_free_blocks=1, num_total_blocks=100, block_size=16,
                       max_num_seqs=1024, max_num_batched_tokens=512)
    assert pol.plan_step(v2).token_budget == 512  # min(max(c, 500 + 16), 512)


def test_needs_an_slo():
    with pytest.raises(ConfigError, match="tbt_slo_ms"):
        SLAPolicy(SchedulerConfig())
    assert build_policy(SchedulerConfig(batching="sla", policy_args={"sla.d_sla_ms": 30})).d_sla == pytest.approx(0.030)


def run_scheduler(num_blocks: int, n_requests: int = 120, steps: int = 4000):
    """memory+sla on the real Scheduler; fake step time 10 ms + 1 ms per decode + 0.1 ms per prefill token."""
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256, batching="memory+sla", tbt_slo_ms=50,
                          policy_args={"sla.window": 2})
    pol = build_policy(cfg)
    assert isinstance(pol, CompositePolicy) and pol.name == "memory+sla"
    sched = Scheduler(cfg, KVCacheManager(num_blocks, 16), policy=pol, watermark=0.0)
    for i in range(n_requests):  # 40 + 60 tokens = 7 blocks each
        sched.add_request(Request(f"r{i}", [100 + i % 50] * 40, SamplingParams(max_tokens=60)))
    log = []
    for step in range(steps):
        if not sched.has_unfinished():
            break
        before = sched.num_running
        plan = sched.schedule(step * 0.01)
        caps = sched.last_caps
        st = pol.state()
        # b* = min(b_mem, b_SLA), and the scheduler obeyed it
        mem, sla = st.parts
        assert caps.max_num_seqs == min(mem.b_mem, sla.b_sla)
        assert caps.token_budget == sla.chunk_tokens
        assert sched.num_running <= caps.max_num_seqs or sched.num_running <= before
        assert plan.num_tokens <= caps.token_budget
        comp = plan.composition
        t = 0.010 + 0.001 * comp.num_decode_seqs + 0.0001 * comp.num_prefill_tokens
        log.append((sched.num_running, caps.max_num_seqs, len(sched.waiting), st, t, comp))
        sched.update(plan, StepResult(plan.step_id, sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                                      step_time_s=t, composition=comp), step * 0.01)
    assert not sched.has_unfinished()
    return sched, log


def test_memory_and_sla_caps_bind_on_the_real_scheduler():
    # big pool: b_mem = 64 (B_max), the SLA binds: pure decode t = 10 + 1*b ms = 50 ms at b = 40
    sched, log = run_scheduler(num_blocks=2000)
    sla_bound = [r for r in log if r[2] and r[0] == r[1] < 64 and r[3].parts[1].b_sla < r[3].parts[0].b_mem]
    assert sla_bound, "the SLA cap never bound"
    # while requests queue, b_SLA mostly sits where the decode latency is in the band: b* = 40 +- 2.5 (+- alpha/2)
    loaded = [r[3].parts[1].batch_search.value for r in log if r[2]]
    mode = max(set(loaded), key=loaded.count)
    assert 36 <= mode <= 44 and loaded.count(mode) >= len(loaded) // 3
    at_mode = [t for n, cap, w, st, t, comp in log if w and cap == mode and n == mode and comp.num_prefill_tokens == 0]
    assert at_mode and all(abs(t - 0.050) <= 0.0025 for t in at_mode)

    # small pool: 200 blocks / 7 per request -> b_mem = 28 < b_SLA, memory binds
    sched, log = run_scheduler(num_blocks=200)
    mem_bound = [r for r in log if r[2] and r[0] == r[1] < 64 and r[3].parts[0].b_mem < r[3].parts[1].b_sla]
    assert mem_bound, "the memory cap never bound"
    assert max(r[0] for r in log) <= 28
    assert sched.num_preemptions == 0
