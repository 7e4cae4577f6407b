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
from tidal.core.block_hash import block_hashes
from tidal.core.block_pool import CacheDelta, net
from tidal.core.kv_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams

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
