"""KunServe's pure decisions, on cases worked by hand from the paper's figures."""

from __future__ import annotations

import pytest

from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.pressure import (
    AutoscaleSignal,
    ChunkCost,
    DropPlan,
    DropPlanner,
    KunServeController,
    KVMove,
    ModelMemory,
    PressureDecision,
    RestorePlan,
    RestorePolicy,
    Span,
    ThrottleDetector,
    assign_homes,
    bubble_ratio,
    check_pressure_mode,
    demand_bytes,
    eq4_cost,
    kv_moves,
    lookahead_microbatches,
    pipeline_makespan,
    pipeline_period,
    plan_migrations,
    stage_layers,
    token_microbatches,
)

LB = 100  # bytes of one layer's weights
M8 = ModelMemory(num_layers=8, layer_bytes=LB, kv_bytes_per_token=16)


def singletons(n: int, layers: int = 8):
    return [(i,) for i in range(n)], {i: (0, layers) for i in range(n)}


# ---------------------------------------------------------------------------- drop plan (Fig. 3d, Fig. 6)
def test_two_throttled_gpus_drop_opposite_halves_fig3d():
    groups, layers = singletons(2)
    plan = DropPlanner(M8).plan(groups, layers, demand_bytes=1, shortage={0: 10})
    assert plan is not None and plan.groups == ((0, 1),)
    assert plan.layers == {0: (0, 4), 1: (4, 8)}  # GPU0 keeps the first half, GPU1 the second
    assert plan.freed_bytes == {0: 4 * LB, 1: 4 * LB} and plan.load_bytes == {}
    assert plan.freed_total == 8 * LB and plan.satisfied  # one full copy freed


def test_greedy_merges_the_smallest_groups_until_the_demand_is_covered():
    groups, layers = singletons(8)
    # 2.5 copies: three merges of two singletons each (a singleton is always smaller than a pair)
    plan = DropPlanner(M8).plan(groups, layers, int(2.5 * 8 * LB))
    assert [len(g) for g in plan.groups] == [2, 2, 2, 1, 1]
    assert len(plan.merges) == 3 and plan.freed_total == 3 * 8 * LB and plan.satisfied
    # 5 copies: all four pairs first, then two pairs into a group of four
    plan = DropPlanner(M8).plan(groups, layers, 5 * 8 * LB)
    assert sorted(len(g) for g in plan.groups) == [2, 2, 4] and plan.freed_total == 5 * 8 * LB
    four = next(g for g in plan.groups if len(g) == 4)
    assert [plan.layers[i] for i in four] == [(0, 2), (2, 4), (4, 6), (6, 8)]  # contiguous stages in order
    assert plan.load_bytes == {}  # every member kept a part of what it held: nothing to load


def test_a_plan_that_cannot_cover_the_demand_is_partial_or_none():
    groups, layers = singletons(4)
    plan = DropPlanner(M8).plan(groups, layers, 100 * 8 * LB)
    assert plan.groups == ((0, 2, 1, 3),) and plan.freed_total == 3 * 8 * LB and not plan.satisfied
    assert DropPlanner(M8, allow_partial=False).plan(groups, layers, 100 * 8 * LB) is None
    assert DropPlanner(M8).plan(groups, layers, 0) is None  # nothing to free
    assert DropPlanner(M8).plan([(0,)], {0: (0, 8)}, 10) is None  # one group: nothing to merge


def test_groups_never_have_more_stages_than_layers():
    m3 = ModelMemory(num_layers=3, layer_bytes=LB, kv_bytes_per_token=16)
    groups, layers = singletons(4, 3)
    plan = DropPlanner(m3).plan(groups, layers, 10**9)
    assert sorted(plan.groups) == [(0, 1), (2, 3)]  # two pairs; a group of 4 would need 4 layers
    assert {plan.layers[0], plan.layers[1]} == {(0, 1), (1, 3)}
    assert plan.freed_total == 2 * 3 * LB


def test_an_odd_merge_keeps_each_member_inside_what_it_held():
    m6 = ModelMemory(num_layers=6, layer_bytes=LB, kv_bytes_per_token=16)
    groups, layers = singletons(3, 6)
    plan = DropPlanner(m6).plan(groups, layers, 2 * 6 * LB)
    assert len(plan.groups) == 1 and len(plan.groups[0]) == 3
    g = plan.groups[0]
    assert [plan.layers[i] for i in g] == [(0, 2), (2, 4), (4, 6)]
    assert plan.load_bytes == {} and plan.freed_total == 2 * 6 * LB
    # the singleton that joined the pair sits between its two stages
    pair = plan.merges[0].group
    assert g[0] == pair[0] and g[2] == pair[1]


def test_the_throttled_group_goes_first_and_pairs_with_the_most_headroom():
    groups, layers = singletons(4)
    plan = DropPlanner(M8).plan(groups, layers, 1, shortage={2: 50}, headroom={0: 10, 1: 90, 3: 40})
    assert plan.changed == ((2, 1),)  # instance 2 (throttled) leads, with 1 (most headroom)
    assert plan.layers[2] == (0, 4) and plan.layers[1] == (4, 8)
    assert plan.groups == ((0,), (2, 1), (3,))


def test_many_instances_merge_into_one_copy():
    n = 256
    model = ModelMemory(num_layers=512, layer_bytes=1, kv_bytes_per_token=1)
    groups, layers = [(i,) for i in range(n)], {i: (0, 512) for i in range(n)}
    plan = DropPlanner(model).plan(groups, layers, 10**9)
    assert len(plan.groups) == 1 and len(plan.merges) == n - 1
    assert sum(b - a for a, b in plan.layers.values()) == 512  # exactly one copy left
    assert stage_layers(512, 256)[1] == (2, 4)


def test_a_second_plan_builds_on_the_groups_of_the_first():
    groups, layers = singletons(4)
    first = DropPlanner(M8).plan(groups, layers, 1, shortage={0: 5}, headroom={3: 9})
    assert first.changed == ((0, 3),)
    second = DropPlanner(M8).plan(first.groups, first.layers, 2 * 8 * LB, shortage={0: 5})
    # 1 + 2 pair first (singletons), then the two pairs interleave: 0 (0,2) 1 (2,4) 3 (4,6) 2 (6,8)
    assert second.groups == ((0, 1, 3, 2),)
    assert [second.layers[i] for i in (0, 1, 3, 2)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert second.freed_total == 2 * 8 * LB
    assert second.freed_bytes[0] == 2 * LB and second.freed_bytes[1] == 6 * LB  # a pair member drops 2 of 4


# ---------------------------------------------------------------------------- KV moves (Sec. 4.2, 4.4)
def test_kv_moves_of_a_drop_and_of_a_restore():
    # a request on 0 (all layers) when 0 and 1 form a pair: 0 sends the second half to 1
    assert kv_moves({0: (0, 8)}, {0: (0, 4), 1: (4, 8)}) == [KVMove(0, 1, (4, 8))]
    # restore: the pair splits and the request's new home is 1: 0 sends it the first half
    assert kv_moves({0: (0, 4), 1: (4, 8)}, {1: (0, 8)}) == [KVMove(0, 1, (0, 4))]
    # a pair's request when the pair joins another pair (0,1)+(2,3) -> 0:(0,2) 2:(2,4) 1:(4,6) 3:(6,8)
    moves = kv_moves({0: (0, 4), 1: (4, 8)}, {0: (0, 2), 2: (2, 4), 1: (4, 6), 3: (6, 8)})
    assert moves == [KVMove(0, 2, (2, 4)), KVMove(1, 3, (6, 8))]
    # a receiver already holding the middle gets both ends
    assert kv_moves({0: (0, 8), 1: (3, 5)}, {1: (0, 8)}) == [KVMove(0, 1, (0, 3)), KVMove(0, 1, (5, 8))]


# ---------------------------------------------------------------------------- throttle (Sec. 2.2, 3)
def _monitor(statuses):
    return GlobalMonitor([InstanceStatus(i, *s) for i, s in enumerate(statuses)])


def test_throttled_when_the_head_of_line_does_not_fit():
    # (num_blocks, free, block_size, running, waiting, queued, step, preemptions, hol)
    mon = _monitor([(100, 10, 16, 5, 3, 40, None, 0, 20),   # hol 20 > free 10 - 1: throttled
                    (100, 50, 16, 5, 3, 40, None, 0, 20),   # waits for the budget, not memory
                    (100, 20, 16, 5, 1, 20, None, 0, 20),   # 20 > 20 - 1 (the watermark): throttled
                    (100, 0, 16, 5, 0, 0, None, 0, 0)])     # full but nothing queued
    found = ThrottleDetector().scan(mon)
    assert [t.index for t in found] == [0, 2]  # the largest shortage first: 40 - 9 = 31, 20 - 19 = 1
    assert found[0].shortage_blocks == 31 and found[0].demand_blocks == 110
    assert demand_bytes(found, 16 * 16) == 32 * 256
    assert [t.index for t in ThrottleDetector(watermark=0.0).scan(mon)] == [0]


def test_a_group_is_seen_through_its_first_stage():
    mon = _monitor([(100, 10, 16, 5, 3, 40, None, 0, 20), (100, 10, 16, 5, 3, 40, None, 0, 20)])
    mon.on_groups([(1, 0)])
    assert [r.index for r in mon.routable()] == [1]
    assert [t.members for t in ThrottleDetector().scan(mon)] == [(1, 0)]


# ---------------------------------------------------------------------------- lookahead (Sec. 4.3, Fig. 11, Eq. 1)
def test_eq1_cost_of_a_chunk():
    c = ChunkCost(alpha=2.0, beta=3.0, gamma=5.0)
    assert c.chunk(10, 4) == 2.0 * (40 + 10) + 12 + 5  # prefix-attn 40, self-attn (16+4)/2
    assert c.batch([Span("a", 10, 4), Span("b", 0, 1)]) == 117 + (2.0 * 1 + 3 + 5)


def test_a_cost_split_balances_a_long_prefill_that_token_counts_do_not():
    # Fig. 17: an 8-token prompt in two microbatches; attention only (alpha 1): cost 36
    cost = ChunkCost(1.0, 0.0, 0.0)
    by_tokens = token_microbatches([Span("r", 0, 8)], 2)
    assert by_tokens == [[Span("r", 0, 4)], [Span("r", 4, 4)]]
    assert [cost.batch(b) for b in by_tokens] == [10.0, 26.0]  # the later chunk attends over the first
    balanced = lookahead_microbatches([Span("r", 0, 8)], cost, min_tokens=4, max_microbatches=2)
    assert balanced == [[Span("r", 0, 5)], [Span("r", 5, 3)]]
    assert [cost.batch(b) for b in balanced] == [15.0, 21.0]
    # two pipeline stages, each doing half of a microbatch's cost
    stages = lambda mbs: [[cost.batch(b) / 2 for b in mbs]] * 2  # noqa: E731
    assert pipeline_period(stages(by_tokens)) == 26.0 and pipeline_period(stages(balanced)) == 21.0
    assert bubble_ratio(stages(by_tokens), 26.0) == pytest.approx(1 - 36 / 52)
    assert bubble_ratio(stages(balanced), 21.0) == pytest.approx(1 - 36 / 42)


def test_lookahead_recurses_to_power_of_two_microbatches_and_keeps_order():
    cost = ChunkCost(1e-3, 1.0, 0.5)
    spans = [Span(f"d{i}", 300, 1) for i in range(6)] + [Span("p", 0, 200), Span("q", 100, 50)]
    mbs = lookahead_microbatches(spans, cost, min_tokens=8, max_microbatches=4)
    assert len(mbs) == 4
    costs = [cost.batch(b) for b in mbs]
    assert max(costs) / min(costs) < 1.2
    assert sum(costs) == pytest.approx(cost.batch(spans) + cost.gamma * (sum(map(len, mbs)) - len(spans)))
    flat = [s for b in mbs for s in b]  # every token once, each request's parts in order
    for rid, total in (("p", 200), ("q", 50)):
        parts = [s for s in flat if s.request_id == rid]
        assert sum(s.tokens for s in parts) == total
        assert all(a.prefix + a.tokens == b.prefix for a, b in zip(parts, parts[1:], strict=False))
    # few tokens: not split
    assert lookahead_microbatches([Span("a", 0, 3)], cost, min_tokens=4) == [[Span("a", 0, 3)]]


def test_pipeline_makespan_and_eq4():
    # per-stage costs (3, 1, 3) on two stages: stage 1 ends 3,4,7; stage 2 ends 6,7,10
    assert pipeline_makespan([[3, 1, 3], [3, 1, 3]]) == 10
    assert eq4_cost([3, 1, 3]) == 12 >= 10  # Eq. 4 bounds it
    assert pipeline_makespan([[2, 2], [2, 2]]) == eq4_cost([2, 2]) == 6  # equal microbatches: exact
    assert pipeline_makespan([[1], [1], [1]], transfer_s=0.5) == 4.0
    assert pipeline_period([[1, 1], [1, 1]], transfer_s=0.5) == 2.5  # a trip: 1 + 0.5 + 1


# ---------------------------------------------------------------------------- restore and autoscale (Sec. 4.4)
def test_restore_below_half_of_the_undropped_pools():
    p = RestorePolicy()
    assert p.should_restore(used_blocks=90, queued_blocks=9, undropped_blocks=200)
    assert not p.should_restore(used_blocks=90, queued_blocks=10, undropped_blocks=200)
    assert not p.should_restore(used_blocks=120, queued_blocks=0, undropped_blocks=200)
    # largest first onto the most room: a -> 0 (80 -> 30), c -> 1 (70 -> 30), b -> 0 (tie: lower index)
    assert assign_homes([("a", 50), ("b", 30), ("c", 40)], {0: 80, 1: 70}) == {"a": 0, "c": 1, "b": 0}
    assert assign_homes([("a", 50), ("b", 30), ("c", 40)], {0: 60, 1: 70}) is None  # b finds 20 and 20
    assert assign_homes([("a", 80)], {0: 60, 1: 70}) is None


def test_autoscale_fires_once_when_usage_keeps_rising_after_a_drop():
    s = AutoscaleSignal(window_s=10.0, min_rise=0.05, high=0.8)
    assert not s.observe(0.0, 0.99)  # not armed before a drop
    s.on_drop(0.0)
    assert [s.observe(t, u) for t, u in ((0.0, 0.76), (5.0, 0.79), (9.0, 0.80))] == [False] * 3
    assert s.observe(10.0, 0.82)  # +6 points in 10 s, never falling, above 80 %
    assert not s.observe(11.0, 0.9)  # once
    s.on_drop(20.0)
    assert not any(s.observe(20.0 + t, u) for t, u in ((0, 0.80), (5, 0.79), (10, 0.86), (14, 0.88)))  # fell at 5


# ---------------------------------------------------------------------------- controller (Sec. 3, Fig. 4)
def test_the_controller_drops_on_throttle_and_restores_when_calm():
    log: list[PressureDecision] = []
    mon = _monitor([(100, 5, 16, 9, 4, 60, None, 0, 30), (100, 70, 16, 2, 0, 0, None, 0, 0)])
    ctl = KunServeController(mon, M8, recorder=log.append)
    plan = ctl.decide(1.0)
    assert isinstance(plan, DropPlan) and plan.changed == ((0, 1),)
    assert ctl.decide(1.1) is None  # one plan at a time
    ctl.applied(plan, 1.2)
    assert ctl.groups == ((0, 1),) and [r.index for r in mon.routable()] == [0]
    # the group's pool, seen through stage 0: 200 blocks + one copy freed; busy, then calm
    mon.on_status(InstanceStatus(0, 264, 64, 16, 20, 0, 0, None, 0, 0), 2.0)
    assert ctl.decide(2.0) is None  # 200 used >= 50 % of the undropped 200
    mon.on_status(InstanceStatus(0, 264, 180, 16, 8, 1, 10, None, 0, 10), 3.0)
    restore = ctl.decide(3.0)  # 84 used + 10 queued < 100
    assert isinstance(restore, RestorePlan) and restore.load_bytes == {0: 4 * LB, 1: 4 * LB}
    ctl.withdraw(plan)  # not the pending plan: nothing changes
    assert ctl.decide(3.1) is None
    ctl.withdraw(restore)  # the caller will not run it now: the next decide plans it again
    restore = ctl.decide(3.2)
    assert isinstance(restore, RestorePlan)
    ctl.applied(restore, 3.5)
    assert ctl.groups == ((0,), (1,)) and ctl.layers == {0: (0, 8), 1: (0, 8)}
    assert [d.kind for d in log] == ["throttle", "drop", "restore", "restore"]
    assert log[1].instances == (0, 1) and log[1].details["freed_bytes"] == 8 * LB


def test_a_failure_in_a_group_dissolves_it_and_the_survivor_runs_whole():
    log: list[PressureDecision] = []
    mon = _monitor([(100, 5, 16, 9, 4, 60, None, 0, 30), (100, 70, 16, 2, 0, 0, None, 0, 0),
                    (100, 70, 16, 2, 0, 0, None, 0, 0)])
    ctl = KunServeController(mon, M8, recorder=log.append)
    plan = ctl.decide(1.0)
    ctl.applied(plan, 1.2)
    (g,) = plan.changed
    assert len(g) >= 2 and len(mon.routable()) == 3 - len(g) + 1
    alone = [i for i in range(3) if i not in g]
    for i in alone:
        assert ctl.on_failure(i, 1.5) == (i,) and ctl.groups == plan.groups  # alone: nothing to restore
    assert ctl.on_failure(g[1], 2.0) == g
    assert ctl.groups == ((0,), (1,), (2,)) and all(ctl.layers[i] == (0, 8) for i in range(3))
    assert [r.index for r in mon.routable()] == [0, 1, 2]
    assert log[-1].kind == "restore" and log[-1].details == {"reason": "failure", "failed": g[1]}


def test_the_controller_signals_autoscale_when_nothing_is_left_to_drop():
    log: list[PressureDecision] = []
    mon = _monitor([(100, 5, 16, 9, 4, 60, None, 0, 30), (100, 5, 16, 9, 4, 60, None, 0, 30)])
    mon.on_groups([(0, 1)])
    ctl = KunServeController(mon, M8, recorder=log.append)
    ctl.groups, ctl.layers = ((0, 1),), {0: (0, 4), 1: (4, 8)}
    assert ctl.decide(1.0) is None and ctl.decide(2.0) is None
    mon.on_status(InstanceStatus(0, 264, 100, 16, 9, 0, 0, None, 0, 0), 3.0)  # calm a moment (164 used: no
    assert ctl.decide(3.0) is None  # restore below 100), then throttled again
    mon.on_status(InstanceStatus(0, 264, 5, 16, 9, 4, 60, None, 0, 30), 4.0)
    assert ctl.decide(4.0) is None
    assert [d.kind for d in log] == ["throttle", "autoscale", "throttle"]  # one signal until a plan is applied


def test_observing_never_makes_a_plan():
    log: list[PressureDecision] = []
    mon = _monitor([(100, 5, 16, 9, 4, 60, None, 0, 30), (100, 70, 16, 2, 0, 0, None, 0, 0)])
    ctl = KunServeController(mon, M8, recorder=log.append)
    assert [t.index for t in ctl.observe(1.0)] == [0] and ctl.pending is None
    assert isinstance(ctl.decide(2.0), DropPlan)  # the throttle is still there: now a plan
    assert [d.kind for d in log] == ["throttle", "drop"]


# ---------------------------------------------------------------------------- migrate baseline (Llumnix)
def test_migrations_move_the_shortest_requests_to_the_most_room():
    mon = _monitor([(100, 2, 16, 9, 2, 30, None, 0, 20),   # throttled: lacks 20 - (2 - 1) = 19 blocks
                    (100, 40, 16, 2, 0, 0, None, 0, 0),
                    (100, 60, 16, 2, 0, 10, None, 0, 0)])  # 60 - 10 - 1 = 49 room
    moves = plan_migrations(mon, {0: [("big", 50), ("a", 8), ("b", 12), ("c", 15)]})
    assert [(m.request_id, m.dst) for m in moves] == [("a", 2), ("b", 2)]  # 8 + 12 >= 19
    assert plan_migrations(mon, {0: [("a", 8), ("b", 12)]}, leaving={0: 19}) == []


def test_given_prompt_names_a_migration_goes_where_its_prefix_is_cached_and_needs_room_for_the_rest():
    """tidal's extension (issue 52), not Llumnix's rule: without names (or with nothing cached) the
    destination is still the one with the most room."""
    from tidal.core.block_pool import CacheDelta

    mon = _monitor([(100, 2, 16, 9, 2, 30, None, 0, 20),
                    (100, 40, 16, 2, 0, 0, None, 0, 0),
                    (100, 60, 16, 2, 0, 10, None, 0, 0)])  # most room: 49
    prompt = {"a": (b"p1", b"p2", b"p3", b"p4", b"p5"), "b": (b"q1", b"q2")}
    mon.instances[1].cache.apply(CacheDelta(stored=prompt["a"][:4]))
    running = {0: [("a", 8), ("b", 12)]}
    assert [(m.dst, m.shared) for m in plan_migrations(mon, running)] == [(2, 0), (2, 0)]
    moves = plan_migrations(mon, running, names=prompt)
    assert [(m.request_id, m.dst, m.shared, m.dst_blocks) for m in moves] == [("a", 1, 4, 4), ("b", 2, 0, 12)]
    # a prefix as long as the whole request still leaves a block to send
    mon.instances[1].cache.apply(CacheDelta(stored=prompt["a"]))
    assert plan_migrations(mon, {0: [("a", 5)]}, names=prompt)[0].shared == 4
    # the cached destination without room for the rest is passed over
    assert plan_migrations(mon, {0: [("a", 80)]}, names=prompt) == []
    assert plan_migrations(mon, {0: [("a", 45)]}, names=prompt)[0].dst == 2


def test_bad_pressure_modes_are_one_line_errors():
    check_pressure_mode("preempt", 1)
    with pytest.raises(ValueError, match="at least 2 instances"):
        check_pressure_mode("drop", 1)
    with pytest.raises(ValueError, match="layers can be split"):
        check_pressure_mode("drop", 4, num_layers=1)
    with pytest.raises(ValueError, match="colocated"):
        check_pressure_mode("migrate", 4, disaggregated=True)
    with pytest.raises(ValueError, match="must be one of"):
        check_pressure_mode("swap", 4)


def test_every_plan_is_logged_with_its_view_and_replays_from_it():
    from tidal.cluster.pressure.record import ControllerDecision, replay

    plans: list[ControllerDecision] = []
    mon = _monitor([(100, 5, 16, 9, 4, 60, None, 0, 30), (100, 70, 16, 2, 0, 0, None, 0, 0)])
    ctl = KunServeController(mon, M8, decisions=plans.append)
    drop = ctl.decide(1.0)
    ctl.applied(drop, 1.2)
    mon.on_status(InstanceStatus(0, 264, 180, 16, 8, 1, 10, None, 0, 10), 3.0)
    restore = ctl.decide(3.0)
    assert [d.kind for d in plans] == ["drop", "restore"] and [d.plan for d in plans] == [drop, restore]
    assert plans[0].view(0).used_blocks == 95 and plans[0].view(0).hol_block_demand == 30
    assert plans[1].groups == ((0, 1),) and plans[1].view(0).num_blocks == 264 and plans[1].base_blocks == {0: 100, 1: 100}
    mon.on_status(InstanceStatus(0, 264, 0, 16, 20, 0, 0, None, 0, 0), 4.0)  # what the monitor says now is not replayed
    for d in plans:
        assert replay(d, M8) == d.plan
    assert plans[1].to_dict()["kind"] == "restore" and plans[1].to_dict()["views"][0]["used"] == 84


# ---------------------------------------------------------------------------- Eq. 1 profiled (Sec. 4.3)
@pytest.mark.parametrize("relative", [False, True])
def test_the_eq1_fit_recovers_known_coefficients_exactly(relative):
    from tidal.cluster.pressure import fit_chunk_cost

    true = ChunkCost(alpha=3.2e-9, beta=4.5e-6, gamma=7.0e-4)
    points = [(p, c, true.chunk(p, c)) for p in (0, 128, 512, 1024) for c in (1, 16, 64, 256)]
    got = fit_chunk_cost(points, relative=relative)
    assert got.alpha == pytest.approx(true.alpha, rel=1e-9)
    assert got.beta == pytest.approx(true.beta, rel=1e-9)
    assert got.gamma == pytest.approx(true.gamma, rel=1e-9)


def test_the_eq1_fit_drops_a_negative_coefficient_and_refits():
    from tidal.cluster.pressure import fit_chunk_cost

    # no fixed cost at all, and noise that would make gamma slightly negative
    points = [(p, c, 2e-9 * (p * c + (c * c + c) / 2) + 1e-6 * c - (1e-7 if c == 1 else 0.0))
              for p in (0, 256, 1024) for c in (1, 32, 128)]
    got = fit_chunk_cost(points)
    assert got.gamma == 0.0 and got.alpha > 0 and got.beta > 0
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_chunk_cost(points[:2])


def test_the_microbatch_split_follows_alpha_over_beta():
    """Fig. 11 on a chunk after a long prefix followed by a fresh one: the dearer attention is
    (alpha / beta up), the fewer of the first chunk's tokens the first microbatch takes."""
    spans = [Span("long", 2048, 128), Span("fresh", 0, 128)]

    def first_tokens(alpha: float, beta: float) -> int:
        mbs = lookahead_microbatches(spans, ChunkCost(alpha, beta, 0.0), min_tokens=16, max_microbatches=2)
        assert len(mbs) == 2 and sum(s.tokens for mb in mbs for s in mb) == 256
        return sum(s.tokens for s in mbs[0])

    cheap, flops, dear = first_tokens(1e-12, 1.0), first_tokens(1.0, 3072.0), first_tokens(1.0, 10.0)
    assert cheap == 128  # attention free: the tokens halve
    assert cheap > flops > dear  # the long-prefix chunk is cut ever shorter
