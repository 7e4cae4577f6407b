"""``slo-compose``: DynaServe Alg. 2's budget from a profile table, the table's refinement, and the
real Scheduler keeping each step's prefill within the budget M."""

from __future__ import annotations

import json
import random

import pytest

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan, StepResult
from tidal.core.policy import SchedulerView
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.policies.profile_table import ProfileTable, features, fill, prefill_shape
from tidal.policies.slo_compose import SLOComposePolicy


def hand_table() -> ProfileTable:
    # prefill-only batches (d = 0, ctx = 0, prefix 0): 10 ms at p = 0, 30 ms at p = 100, 90 ms at p = 200
    return ProfileTable.load([
        {"prefill_tokens": 0, "mean_context": 0, "decode_count": 0, "time_s": 0.010},
        {"prefill_tokens": 100, "mean_context": 0, "decode_count": 0, "time_s": 0.030},
        {"prefill_tokens": 200, "mean_context": 0, "decode_count": 0, "time_s": 0.090},
    ])


def test_prediction_by_hand():
    t = hand_table()
    assert len(t) == 3  # cells p // 64 = 0, 1, 3
    # least squares on [1, p, d, d*ctx, p*ctx, p*prefix, p^2]: the d, ctx and prefix columns are all
    # zero (they stay 0), and 1, p, p^2 fit the three points exactly: t = 10 ms + 0.002 ms * p^2
    law = lambda p: 0.010 + 2e-6 * p * p  # noqa: E731
    # a seen cell: its mean, moved along the slope from its centroid
    assert t.predict(200, 0, 0) == pytest.approx(0.090, abs=1e-6)
    assert t.predict(220, 0, 0) == pytest.approx(0.090 + law(220) - law(200), abs=1e-6)
    assert t.predict(50, 0, 0) == pytest.approx(law(50), abs=1e-6)
    # an unseen cell (p // 64 == 2): the regression
    assert t.predict(150, 0, 0) == pytest.approx(law(150), abs=1e-6)
    # two chunks of 100 (sum of squares 20,000) cost less attention than one of 200 (40,000)
    assert t.predict(200, 0, 0, sq=20000.0) == pytest.approx(0.090 - 2e-6 * 20000, abs=1e-5)


def test_max_prefill_allowed_by_hand():
    t = hand_table()
    # t = 10 ms + 0.002 ms * p^2 everywhere (the fit is exact): target 60 ms -> p^2 <= 25,000 -> 158
    assert t.max_prefill(0.060, 0, 0, limit=255) == 158
    assert t.max_prefill(0.030, 0, 0, limit=255) == 100  # 10 + 0.002 p^2 <= 30
    assert t.max_prefill(0.005, 0, 0, limit=255) == 0  # even p = 0 misses it
    assert t.max_prefill(1.0, 0, 0, limit=255) == 255
    assert ProfileTable().max_prefill(0.05, 0, 0, limit=300) == 300  # an empty table allows everything

    # the policy: all decodes first (none here), then M = 158, as the token budget
    cfg = SchedulerConfig(max_num_batched_tokens=255, tbt_slo_ms=60, batching="slo-compose")
    pol = SLOComposePolicy(cfg, table=t)
    v = SchedulerView(now=0.0, running=(), waiting=(), num_free_blocks=10, num_total_blocks=10, block_size=16,
                      max_num_seqs=64, max_num_batched_tokens=255)
    assert pol.plan_step(v).token_budget == 158 and pol.M == 158
    assert pol.state().budget_predicted_ms == pytest.approx(10 + 0.002 * 158 ** 2, abs=1e-3)
    # a target nothing meets: M falls to the floor of one block
    tight = SLOComposePolicy(SchedulerConfig(max_num_batched_tokens=255, tbt_slo_ms=5), table=t)
    assert tight.plan_step(v).token_budget == 16


def test_max_prefill_costs_each_chunk_at_its_own_prefix():
    # a law with a prefix term: 5 ms + 0.05 ms a token + 20 ns per (token x prefix) pair
    t = ProfileTable()
    rng = random.Random(3)
    law = lambda p, x: 0.005 + 5e-5 * p + 2e-8 * p * x  # noqa: E731
    for _ in range(400):
        p, x = rng.randrange(1, 2048), rng.randrange(0, 8192)
        t.record(p, 0, 0, law(p, x), prefix=x)
    assert t.predict(500, 0, 0, prefix=6000) == pytest.approx(law(500, 6000), rel=1e-3)
    # 100 ms: at prefix 0, M = (0.1 - 0.005) / 5e-5 = 1900; deep into a prompt (prefix 6000) far less
    assert abs(t.max_prefill(0.1, 0, 0, 2048) - 1900) <= 2
    deep = t.max_prefill(0.1, 0, 0, 2048, prefills=[(6000, 4000)])
    assert abs(deep - 0.095 / (5e-5 + 2e-8 * 6000)) <= 2  # 558
    # a queue: 300 tokens left of a prompt at prefix 6000, then a new one: the rest goes at prefix 0
    q = [(6000, 300), (0, 5000)]
    m = t.max_prefill(0.1, 0, 0, 2048, prefills=q)
    assert law(m, 0) + 2e-8 * 300 * 6000 == pytest.approx(0.1, abs=2e-4)
    assert t.predict_queue(m, 0, 0, q) <= 0.1 < t.predict_queue(m + 1, 0, 0, q)
    assert fill(q, 500) == (300 * 6000, 300 ** 2 + 200 ** 2)
    assert prefill_shape([(6000, 300), (0, 200)]) == (500, 300 * 6000 / 500, 300.0 ** 2 + 200 ** 2)


def test_the_composer_sees_the_prefill_queue_and_records_prefixes():
    cfg = SchedulerConfig(max_num_batched_tokens=2048, tbt_slo_ms=100, batching="slo-compose",
                          long_prefill_token_threshold=1024)
    pol = SLOComposePolicy(cfg)
    deep = Request("a", [1] * 9000, SamplingParams(max_tokens=4), num_computed_tokens=6000)
    alpha = Request("b", [1] * 3000, SamplingParams(max_tokens=4), num_computed_tokens=100, pause_at=400)
    new = Request("c", [1] * 500, SamplingParams(max_tokens=4))
    v = SchedulerView(now=0.0, running=(deep, alpha), waiting=(new,), num_free_blocks=10, num_total_blocks=10,
                      block_size=16, max_num_seqs=64, max_num_batched_tokens=2048)
    # the long-prefill cap, an alpha's split point, the waiting request's prompt
    assert pol.prefill_queue(v, 2048) == [(6000, 1024), (100, 300), (0, 500)]
    assert pol.prefill_queue(v, 1000) == [(6000, 1024)]
    # observe records the chunks' own prefixes: a step of 500 tokens at 6000 and 200 at 0
    sp = SamplingParams(max_tokens=4)
    chunks = (ScheduledChunk("a", (1,) * 500, 6000, (), False, sp), ScheduledChunk("c", (1,) * 200, 0, (), False, sp))
    plan = StepPlan(1, chunks, BatchComposition.of(chunks))
    pol.observe(plan, StepResult(1, sampled={}, step_time_s=0.05, composition=plan.composition))
    (key, cell), = pol.table.cells.items()
    assert key == (700 // 64, 0, 0, (6000 * 500 // 700 // 512).bit_length())
    assert cell.mean_x == pytest.approx(features(700, 0, 0, 500 * 6000 / 700, 500.0 ** 2 + 200 ** 2))


def _max_prefill_by_predict(t: ProfileTable, target: float, ctx: float, d: int, limit: int) -> int:
    """MAXPREFILLALLOWED written plainly over the public predict(): the same bisection."""
    ok = lambda p: (x := t.predict(p, ctx, d)) is None or x <= target  # noqa: E731
    if ok(limit):
        return limit
    if not ok(0):
        return 0
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def test_max_prefill_is_the_bisection_over_predict_and_the_fit_is_least_squares():
    rng = random.Random(7)
    t = ProfileTable()
    for _ in range(300):  # a step-time law with decodes and context, and noise
        p, ctx, d = rng.randrange(0, 2048), rng.uniform(0, 4000), rng.randrange(0, 64)
        t.record(p, ctx, d, 0.004 + 2e-5 * p + 3e-4 * d + 4e-8 * d * ctx + 1e-9 * p * ctx + rng.gauss(0, 1e-3))
    for _ in range(300):
        target, ctx, d, limit = rng.uniform(0.0, 0.08), rng.uniform(0, 4000), rng.randrange(0, 64), rng.randrange(0, 2048)
        assert t.max_prefill(target, ctx, d, limit) == _max_prefill_by_predict(t, target, ctx, d, limit)
    np = pytest.importorskip("numpy")
    a = np.array(t._xtx) + np.diag([0.0] + [t.ridge * t._weight] * 6)
    assert np.allclose(t.coefficients(), np.linalg.solve(a, np.array(t._xty)), rtol=1e-9, atol=1e-12)


def test_budget_adds_the_decodes_and_respects_the_configured_budget():
    # 20 decodes at context 100: t = 5 ms + 0.5 ms * d + 0.05 ms * p (a table learned from that model)
    t = ProfileTable()
    rng = random.Random(0)
    for _ in range(200):
        p, d, ctx = rng.randrange(0, 512), rng.randrange(0, 64), rng.randrange(10, 1000)
        t.record(p, ctx, d, 0.005 + 0.0005 * d + 0.00005 * p)
    running = tuple(Request(f"r{i}", [1] * 99, SamplingParams(max_tokens=8), output_token_ids=[7],
                            num_computed_tokens=99) for i in range(20))
    v = SchedulerView(now=0.0, running=running, waiting=(), num_free_blocks=10, num_total_blocks=100,
                      block_size=16, max_num_seqs=64, max_num_batched_tokens=1024)
    pol = SLOComposePolicy(SchedulerConfig(max_num_batched_tokens=1024, tbt_slo_ms=40), table=t)
    # M = (40 - 5 - 10) / 0.05 = 500 tokens, on top of the 20 decodes
    assert pol.plan_step(v).token_budget == 20 + pol.M
    assert abs(pol.M - 500) <= 1
    assert pol.state().decode_count == 20 and pol.state().decode_context == 100
    small = SLOComposePolicy(SchedulerConfig(max_num_batched_tokens=256, tbt_slo_ms=40), table=t)
    assert small.plan_step(v).token_budget == 256 and small.M == 236  # capped by the configured budget


def test_table_refines_toward_measured_times():
    t = ProfileTable()
    # learned elsewhere: 1 ms per decode
    for d in (4, 8, 16, 32):
        t.record(0, 512, d, 0.001 * d)
    guess = t.predict(128, 512, 8)  # an unseen cell: extrapolated from decode-only data
    truth = 0.030
    errs = [abs(guess - truth)]
    for _ in range(10):
        t.record(128, 512, 8, truth)
        errs.append(abs(t.predict(128, 512, 8) - truth))
    assert errs[0] > 0.015 and errs[-1] < 1e-9
    assert all(a >= b - 1e-12 for a, b in zip(errs, errs[1:], strict=False))
    # drift: the machine slows to 40 ms; the capped running mean follows it
    errs = []
    for _ in range(300):
        t.record(128, 512, 8, 0.040)
        errs.append(abs(t.predict(128, 512, 8) - 0.040))
    assert errs[-1] < 1e-3 and errs[-1] < errs[0] / 50
    # the regression extrapolates a linear law to unseen cells
    r = ProfileTable()
    rng = random.Random(1)
    law = lambda p, c, d: 0.004 + 0.0001 * p + 0.0004 * d + 2e-7 * d * c + 1e-8 * p * c  # noqa: E731
    for _ in range(50):
        p, c, d = rng.randrange(512), rng.randrange(2048), rng.randrange(64)
        r.record(p, c, d, law(p, c, d))
    assert r.predict(700, 3000, 100) == pytest.approx(law(700, 3000, 100), rel=1e-4)


def test_dump_and_load_round_trip_through_json():
    t = hand_table()
    t.record(10, 300, 5, 0.02)
    u = ProfileTable.load(json.loads(json.dumps(t.dump())))
    for q in [(0, 0, 0), (150, 0, 0), (220, 0, 0), (10, 300, 5), (400, 900, 30)]:
        assert u.predict(*q) == pytest.approx(t.predict(*q), abs=1e-12)
    assert len(u) == len(t) and u.num_samples == t.num_samples
    pol = SLOComposePolicy(SchedulerConfig(tbt_slo_ms=50))
    pol.seed(t.dump())
    assert pol.state().table_cells == len(t)


def test_needs_an_slo():
    with pytest.raises(ConfigError, match="tbt_slo_ms"):
        build_policy(SchedulerConfig(batching="slo-compose"))


def step_time(plan) -> float:
    """A fake GPU: 5 ms + 0.5 ms per decode + 1 us per decode per context token + 0.1 ms per prefill token."""
    dec = [c.context_len for c in plan.chunks if c.is_decode]
    ctx = sum(dec) / len(dec) if dec else 0.0
    comp = plan.composition
    return 0.005 + 0.0005 * comp.num_decode_seqs + 1e-6 * comp.num_decode_seqs * ctx + 0.0001 * comp.num_prefill_tokens


def test_slo_compose_keeps_prefill_within_m_on_the_real_scheduler():
    cfg = SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=512, batching="slo-compose", tbt_slo_ms=50)
    pol = build_policy(cfg)
    sched = Scheduler(cfg, KVCacheManager(2000, 16), policy=pol, watermark=0.0)
    rng = random.Random(0)
    arrivals = sorted((rng.uniform(0, 3.0), i) for i in range(80))
    now, k, log = 0.0, 0, []
    for _ in range(5000):
        while k < len(arrivals) and arrivals[k][0] <= now:
            i = arrivals[k][1]
            sched.add_request(Request(f"r{i}", [100 + i % 50] * rng.randrange(50, 700),
                                      SamplingParams(max_tokens=rng.randrange(10, 80)), arrival_time=now))
            k += 1
        if not sched.has_unfinished():
            if k == len(arrivals):
                break
            now = arrivals[k][0]
            continue
        plan = sched.schedule(now)
        st = pol.state()
        assert plan.composition.num_prefill_tokens <= st.M  # prefill never exceeds M
        assert sched.last_caps.token_budget == st.token_budget <= cfg.max_num_batched_tokens
        t = step_time(plan)
        log.append((plan.composition, st.M, t))
        sched.update(plan, StepResult(plan.step_id, sampled={c.request_id: 7 for c in plan.chunks if c.sample},
                                      step_time_s=t, composition=plan.composition), now)
        now += t
    assert k == len(arrivals) and not sched.has_unfinished()
    assert any(c.num_prefill_tokens == m < cfg.max_num_batched_tokens - c.num_decode_seqs for c, m, _ in log)
    # once the table has a few samples, every step that carries prefill stays within the 50 ms SLO
    late = [t for c, _, t in log[20:] if c.num_prefill_tokens]
    assert late and max(late) <= 0.050 + 1e-6
    assert pol.state().table_cells > 5


@pytest.mark.parametrize("catch_up, waited, m", [(False, 0.03, 158), (True, 0.0, 158), (True, 0.028, 104),
                                                 (True, 0.08, 16)])
def test_catch_up_gives_a_decode_that_waited_less_step(catch_up, waited, m):
    # target 60 ms; a decode whose KV landed 28 ms after its last token leaves 32 ms: M = 104
    # (10 + 0.002 p^2 <= 32, as above); one that waited past the target gets the one-block floor
    cfg = SchedulerConfig(max_num_batched_tokens=255, tbt_slo_ms=60, batching="slo-compose")
    from tidal.policies.slo_compose import SLOComposeParams

    pol = SLOComposePolicy(cfg, table=hand_table(), params=SLOComposeParams(catch_up=catch_up))
    landed = Request("h", [1] * 8, SamplingParams(max_tokens=4))
    landed.output_token_ids, landed.num_computed_tokens = [5], 8  # only its decode left
    landed.last_token_time = 1.0 - waited
    fresh = Request("f", [1] * 8, SamplingParams(max_tokens=4))
    fresh.output_token_ids, fresh.num_computed_tokens, fresh.last_token_time = [5], 8, 1.0
    v = SchedulerView(now=1.0, running=(fresh, landed), waiting=(), num_free_blocks=10, num_total_blocks=10,
                      block_size=16, max_num_seqs=64, max_num_batched_tokens=255)
    caps = pol.plan_step(v)
    assert (pol.M, caps.token_budget) == (m, 2 + m)
    assert pol.state().step_target_ms == pytest.approx(1000 * max(0.06 - (waited if catch_up else 0.0), 0.0))
