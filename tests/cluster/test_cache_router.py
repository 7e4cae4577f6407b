"""Cache-aware routing, pure: the cache views the monitor keeps from the instances' reports (and the
approximate one from its own decisions), the TTFT prediction, the balance guard, the admission bound,
and decisions that replay from their log."""

from __future__ import annotations

import pytest

from tidal.cluster.cache_router import CacheAwareParams, CacheAwareRouter, predicted_ttft
from tidal.cluster.cache_view import CacheView
from tidal.cluster.decisions import replay
from tidal.cluster.dispatch import ClusterLayout, Dispatcher
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.router import RouteRequest, build_router
from tidal.cluster.step_fit import StepFit
from tidal.core.block_hash import block_hashes
from tidal.core.block_pool import CacheDelta, net
from tidal.core.kv_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.policies.profile_table import steps_time

BS = 16


def names(tokens: list[int]) -> tuple[bytes, ...]:
    return tuple(block_hashes(tokens, BS))


def monitor(n: int = 2, **status) -> GlobalMonitor:
    return GlobalMonitor([InstanceStatus(i, 1000, 1000, BS, token_budget=256, **status) for i in range(n)])


def test_a_pool_log_nets_to_the_last_word_on_each_name_after_the_last_reset():
    assert net([(True, b"a"), (True, b"b"), (False, b"a")]) == (False, (b"b",), (b"a",))
    assert net([(True, b"a"), (False, None), (True, b"c")]) == (True, (b"c",), ())
    kv = KVCacheManager(8, 4, enable_caching=True)
    kv.track_names()
    r = Request("r", list(range(12)), SamplingParams(max_tokens=1))
    kv.allocate("r", 12)
    r.num_computed_tokens = 12
    kv.cache_blocks(r)
    d = kv.drain_delta()
    assert set(d.stored) == set(r.block_hashes) and not d.evicted and not d.reset
    assert kv.drain_delta().empty
    kv.free("r")
    kv.allocate("x", 32)  # takes every block: the three cached ones are evicted
    assert set(kv.drain_delta().evicted) == set(r.block_hashes)
    kv.reset_prefix_cache()
    assert kv.drain_delta().reset


def test_a_view_follows_the_reports_and_an_approximate_one_the_routing():
    v = CacheView()
    v.apply(CacheDelta(stored=(b"a", b"b", b"c"), host_stored=(b"d",)))
    assert v.prefix([b"a", b"b", b"x", b"c"]) == 2 and v.prefix([b"a", b"b", b"c", b"d", b"e"]) == 4
    v.apply(CacheDelta(evicted=(b"b",)))
    assert v.prefix([b"a", b"b"]) == 1
    v.apply(CacheDelta(reset=True, stored=(b"z",)))
    assert v.prefix([b"a"]) == 0 and v.prefix([b"z"]) == 1
    approx = CacheView(approx_capacity=3)
    approx.note_routed([b"1", b"2", b"3"])
    approx.note_routed([b"1", b"4"])  # "2" is now the least recently routed: out
    assert approx.prefix([b"1", b"2"]) == 1 and approx.prefix([b"3", b"1", b"4"]) == 3


def test_the_prediction_counts_queued_work_the_uncached_prompt_and_the_decodes():
    class Inst:
        token_budget, num_running, queued_prefill_tokens, recent_step_s = 256, 56, 400, 0.1

    # (400 queued + 1000 - 600 cached) tokens at 200 a step (256 less 56 decodes): 4 steps of 0.1 s
    assert predicted_ttft(Inst(), 1000, 600) == pytest.approx(0.4)
    assert predicted_ttft(Inst(), 1000, 0) == pytest.approx(0.7)


def test_the_instance_holding_the_prefix_wins_until_its_queue_costs_more():
    mon = monitor()
    prompt = list(range(1000, 1640))  # 40 blocks
    mon.instances[1].cache.apply(CacheDelta(stored=names(prompt)))
    disp = Dispatcher(ClusterLayout(2), mon, CacheAwareRouter())
    req = RouteRequest("r1", len(prompt) + 8, 16, names(prompt + list(range(8))))
    assert disp.dispatch(req, 0.0) == 1
    # instance 1 now has 2,000 prompt tokens queued; computing the 648 tokens on idle instance 0 is faster
    mon.on_status(InstanceStatus(1, 1000, 1000, BS, token_budget=256, queued_prefill_tokens=2000), 0.1)
    mon.on_status(InstanceStatus(0, 1000, 1000, BS, token_budget=256), 0.1)
    assert disp.dispatch(RouteRequest("r2", len(prompt) + 8, 16, req.block_hashes), 0.2) == 0


def test_the_balance_guard_overrides_the_cache_and_uses_sglangs_thresholds():
    p = CacheAwareParams()
    assert (p.balance_abs, p.balance_rel) == (64, 1.5)
    mon = monitor()
    prompt = list(range(640))
    mon.instances[1].cache.apply(CacheDelta(stored=names(prompt)))
    mon.instances[1].outstanding = {f"x{i}" for i in range(70)}
    router = CacheAwareRouter()
    disp = Dispatcher(ClusterLayout(2), mon, router)
    assert disp.dispatch(RouteRequest("r", 650, 16, names(prompt + [1] * 10)), 0.0) == 0
    assert router.last["why"] == "balance"
    mon.instances[1].outstanding = {f"x{i}" for i in range(60)}  # within 64: the cache decides again
    assert disp.dispatch(RouteRequest("s", 650, 16, names(prompt + [1] * 10)), 0.0) == 1


def test_an_admission_bound_refuses_what_no_instance_can_start_in_time():
    mon = monitor(queued_prefill_tokens=100_000)
    disp = Dispatcher(ClusterLayout(2), mon, CacheAwareRouter(CacheAwareParams(admission_ttft_s=1.0)))
    assert disp.dispatch(RouteRequest("r", 500, 16, names(list(range(500)))), 0.0) is None
    assert not any(r.outstanding for r in mon.instances)
    with pytest.raises(ValueError):
        CacheAwareParams(balance_rel=0.5)


def test_cache_aware_decisions_replay_from_their_log():
    mon = monitor(3)
    log = []
    disp = Dispatcher(ClusterLayout(3), mon, build_router("cache-aware"), recorder=log.append)
    families = [list(range(k * 1000, k * 1000 + 320)) for k in range(3)]
    for i in range(12):
        prompt = families[i % 3] + [i] * 20
        k = disp.dispatch(RouteRequest(f"r{i}", len(prompt), 8, names(prompt)), float(i))
        mon.instances[k].cache.apply(CacheDelta(stored=names(prompt)))  # as its next report would say
    assert all(d.request.block_hashes == () and len(d.request.cached) == 3 for d in log)
    assert [replay(d, ClusterLayout(3), "cache-aware") for d in log] == [d.choice for d in log]
    # each family stays where its prefix went first
    assert len({log[i].choice for i in range(0, 12, 3)}) == 1


# ---- the prefill steps' fit (the prediction's step prices) ----
def _true_step(p: int, prefix: float, sq: float, d: int, ctx: float) -> float:
    """A step-time model of the features' kind: fixed cost, tokens, decodes and their context, the
    chunks' attention over their prefix and over themselves."""
    return 0.004 + 4e-5 * p + 2e-4 * d + 1e-8 * d * ctx + 2e-9 * p * prefix + 1e-9 * sq


def _fed_fit(n: int = 60) -> StepFit:
    fit = StepFit()
    for k in range(n):
        p, prefix, d, ctx = 64 + 37 * k % 480, float(300 * k % 9000), k % 9, float(100 + 53 * k % 4000)
        fit.record(p, prefix, float(p * p), d, ctx, _true_step(p, prefix, p * p, d, ctx))
    return fit


def test_the_fit_of_prefill_steps_prices_chunks_with_their_prefix_in_closed_form():
    fit = _fed_fit()
    w = fit.fit()
    assert w is not None
    # a 5,000-token prompt from a 3,000-token cached prefix, in 400-token chunks beside 6 decodes
    chunks = [(3000 + j * 400, min(400, 5000 - j * 400)) for j in range(13)]
    by_chunk = sum(_true_step(c, x, c * c, 6, 1500.0) for x, c in chunks)
    cx, sq = sum(c * x for x, c in chunks), sum(c * c for _, c in chunks)
    assert steps_time(w, 13, 5000, cx, sq, 6, 1500.0) == pytest.approx(by_chunk, rel=1e-3)
    assert StepFit().fit() is None  # too few steps: none
    assert StepFit.of(w).fit() == w


def test_with_the_fit_a_prediction_sums_the_chunks_of_the_queue_and_the_prompt():
    w = _fed_fit().fit()

    class Inst:
        token_budget, num_running, recent_step_s, decode_context = 256, 56, 0.01, 1500.0
        queued_prefill_tokens, queued_prefill_position = 0, 0.0
        step_fit = w

    # a cold 4,000-token prompt alone: 20 chunks of 200 (256 less 56 decodes), each at its own prefix
    chunks = [(j * 200, 200) for j in range(20)]
    assert predicted_ttft(Inst(), 4000, 0) == pytest.approx(
        sum(_true_step(c, x, c * c, 56, 1500.0) for x, c in chunks), rel=1e-3)
    # priced at the recent (decode) step time it would be 20 x 0.01 s: far less
    assert predicted_ttft(Inst(), 4000, 0) > 2 * 20 * 0.01
    Inst.step_fit = None
    assert predicted_ttft(Inst(), 4000, 0) == pytest.approx(20 * 0.01)
    # a queue of one 2,000-token prompt from position 0 (mean position 1,000) comes first
    Inst.step_fit, Inst.queued_prefill_tokens, Inst.queued_prefill_position = w, 2000, 1000.0
    chunks = [(j * 200, 200) for j in range(10)] + [(j * 200, 200) for j in range(20)]
    assert predicted_ttft(Inst(), 4000, 0) == pytest.approx(
        sum(_true_step(c, x, c * c, 56, 1500.0) for x, c in chunks), rel=1e-3)


def test_the_monitor_learns_each_instance_fit_from_its_prefill_steps_only():
    mon = GlobalMonitor([InstanceStatus(i, 1000, 1000, BS, token_budget=256) for i in range(2)], learn_steps=True)
    for k in range(100):  # decode steps teach nothing
        mon.on_status(InstanceStatus(0, 1000, 1000, BS, step_time_s=0.02, step_decode_count=8), float(k))
    assert mon.instances[0].step_fit is None
    for k in range(60):
        p, prefix, d = 64 + 37 * k % 480, float(300 * k % 9000), k % 9
        st = InstanceStatus(0, 1000, 1000, BS, step_time_s=_true_step(p, prefix, p * p, d, 800.0),
                            step_prefill_tokens=p, step_prefill_prefix=prefix, step_prefill_sq=float(p * p),
                            step_decode_count=d, step_decode_context=800.0)
        mon.on_status(st, 100.0 + k)
        mon.on_step(1, p, prefix, float(p * p), d, 800.0, _true_step(p, prefix, p * p, d, 800.0))
    assert mon.instances[0].step_fit == pytest.approx(mon.instances[1].step_fit)
    assert GlobalMonitor([InstanceStatus(0, 10, 10, BS)]).instances[0].step_fit is None  # not asked to learn


def test_a_busy_instance_holding_a_long_prefix_beats_a_cold_prefill_once_prefill_is_priced():
    """The case the prediction audit found (issue 52): priced at each instance's last step time, a cold
    16K-token prefill on an instance that was decoding (6 ms steps) looked cheaper than waiting behind
    6,000 queued tokens on the one holding the prefix, which was prefilling (40 ms steps)."""
    w = _fed_fit().fit()
    prompt = list(range(16_000))
    for fit, expected in ((None, 0), (w, 1)):
        mon = GlobalMonitor([InstanceStatus(0, 5000, 5000, BS, token_budget=512, step_time_s=0.006),
                             InstanceStatus(1, 5000, 5000, BS, token_budget=512, step_time_s=0.04,
                                            queued_prefill_tokens=6000, queued_prefill_position=3000.0)],
                            learn_steps=True)
        mon.instances[1].cache.apply(CacheDelta(stored=names(prompt)))
        if fit is not None:
            for rec in mon.instances:
                rec.steps = StepFit.of(fit)
        log = []
        disp = Dispatcher(ClusterLayout(2), mon, CacheAwareRouter(), recorder=log.append)
        assert disp.dispatch(RouteRequest("r", 16_008, 16, names(prompt + list(range(8)))), 0.0) == expected
        assert replay(log[0], ClusterLayout(2), "cache-aware") == expected  # the record carries the fit


def test_the_queued_prefill_position_is_the_mean_position_of_the_tokens_still_to_compute():
    from tests.core.test_scheduler import make_request, make_scheduler

    sched = make_scheduler(num_blocks=64, block_size=4, budget=8)
    assert sched.queued_prefill_position() == 0.0
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 4))
    # a: 20 tokens at positions 0..19 (mean 10); b: 4 at 0..3 (mean 2)
    assert sched.queued_prefill_position() == pytest.approx((20 * 10 + 4 * 2) / 24)
    sched.schedule(0.0)  # a's first 8 tokens are computed in this step
    a = next(r for r in sched.running if r.request_id == "a")
    a.num_computed_tokens = 8
    assert sched.queued_prefill_tokens() == 16
    assert sched.queued_prefill_position() == pytest.approx((12 * (8 + 6) + 4 * 2) / 16)
