"""``--kv-pressure auto``'s pure decision: predictions worked by hand, the choice and its hysteresis,
the record and its replay, and the controller over a monitor (gate, episodes, migrations)."""

from __future__ import annotations

import json
import math
from collections import deque

import pytest

from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.pressure import (
    AutoChoice,
    AutoChooser,
    AutoParams,
    AutoPressure,
    ChunkCost,
    DropOption,
    DropPlan,
    Episode,
    ModelMemory,
    PressureDecision,
    Prices,
    Victim,
    check_pressure_mode,
)
from tidal.cluster.pressure.choose import _Open, decide, replay
from tidal.cluster.pressure.predict import admit_walk, drain_steps, predict

# a prompt token costs 1 ms (Eq. 1's beta), nothing else; a block is 16 tokens x 16 bytes = 256 bytes; host and
# instance links move 256 kB/s, so a block crosses in 1 ms; an activation is 8 bytes a token
PRICES = Prices(ChunkCost(0.0, 1e-3, 0.0), token_budget=100, step_overhead_s=0.0, kv_bytes_per_token=16,
                block_size=16, host_bytes_per_s=256e3, link_bytes_per_s=256e3, link_latency_s=0.0,
                chunks_per_request=1, hidden_bytes=8)
RUNNING = (Victim(64, 4, True, 10), Victim(32, 2, True, 100))  # preemption order: the first goes first


def episode(peers=(), drop=DropOption(), host=100, running=RUNNING) -> Episode:
    return Episode(0, shortage_blocks=4, queued_tokens=100, queued_requests=1, running=running,
                   host_free_blocks=host, peer_room=tuple(peers), step_s=0.01, drop=drop)


def test_prefill_is_eq1_over_the_chunks_and_a_step_overhead_each():
    p = Prices(ChunkCost(2e-6, 1e-3, 5e-3), 100, 0.01, 16, 16, 1.0, 1.0, 0.0)
    # one prompt of 250 tokens in chunks 100, 100, 50: Eq. 1 per chunk after its prefix, three steps
    chunks = ChunkCost(2e-6, 1e-3, 5e-3).chunk(0, 100) + ChunkCost(2e-6, 1e-3, 5e-3).chunk(100, 100) \
        + ChunkCost(2e-6, 1e-3, 5e-3).chunk(200, 50)
    assert p.prefill_s(250) == pytest.approx(chunks + 3 * 0.01)
    assert p.prefill_s(0) == 0.0


def test_memory_drains_as_requests_finish_net_of_the_others_growth():
    # 4 blocks finish after 10 steps while the other grew 10 tokens (< 1 block): 3.4 net < 4; both done at 100
    assert drain_steps(RUNNING, 4, 16) == 100
    assert drain_steps(RUNNING, 3, 16) == 10
    assert drain_steps(RUNNING, 0, 16) == 0
    assert drain_steps(RUNNING, 99, 16) == 100  # never enough: when the last one ends


def test_the_queue_is_admitted_as_memory_recycles_through_it():
    """admit_walk's steps: the first queued request gets in when the 4-block request ends (step 10: 4 blocks back, the
    other grew 10 tokens); it gives its 2 blocks back after its prefill step and 5 tokens (step 16), and the
    second gets in then: 16 steps, where waiting for 4 blocks from the running requests alone takes 100."""
    queue = (Victim(16, 2, False, 5), Victim(16, 2, False, 5))
    assert admit_walk(RUNNING, queue, 0, 16)[0] == 16
    assert admit_walk(RUNNING, queue[:1], 0, 16)[0] == 10
    assert admit_walk(RUNNING, queue, 4, 16)[0] == 0  # room for both now
    # nothing runs and nothing is free: the first is taken in anyway (no finish can help it), the second after it
    assert admit_walk((), queue, 0, 16)[0] == 6
    e = Episode(0, shortage_blocks=4, queued_tokens=32, queued_requests=2, running=RUNNING, host_free_blocks=100,
                peer_room=(), step_s=0.01, queue=queue)
    pr = predict(e, PRICES)["recompute"]
    assert pr.terms["drain_steps"] == 16 and pr.terms["memory_wait_s"] == pytest.approx(0.16)
    assert pr.seconds == pytest.approx(max(0.16, 0.032) + 0.064)  # the wait, then the first victim's 64 again
    assert Episode.from_dict(json.loads(json.dumps(e.to_dict()))) == e  # the queue is in the record


def test_the_victims_are_what_the_growth_lacks_while_the_queue_waits():
    """A throttle preempts nothing (the queue waits for memory); the victims are the running requests
    the scheduler preempts when their growth finds no free block on the way (admit_walk's lack)."""

    two = (Victim(16, 2, False, 5), Victim(16, 2, False, 5))
    # nothing free: by step 10 the two running requests grew 20 tokens (1.25 blocks) into memory that is not there
    assert admit_walk(RUNNING, two, 0, 16) == (16, 2)
    # 4 blocks free for growth: the growth never runs out before the first finish gives 4 blocks back
    assert admit_walk(RUNNING, (Victim(48, 6, False, 5),), 4, 16) == (10, 0)
    roomy = Episode(0, shortage_blocks=2, queued_tokens=48, queued_requests=1, running=RUNNING, host_free_blocks=100,
                    peer_room=(), step_s=0.01, queue=(Victim(48, 6, False, 5),))
    pr = predict(roomy, PRICES)
    # no victim: the queue's wait (10 steps) and its prefill, nothing to re-run or copy (the first version's victims
    # covered the shortage: the 4-block request's 64 tokens again, 64 ms more)
    assert pr["recompute"].terms["victims"] == 0 and pr["recompute"].seconds == pytest.approx(max(0.1, 0.048))
    assert pr["swap"].terms["swapped"] == 0 and pr["swap"].seconds == pytest.approx(pr["recompute"].seconds)
    tight = Episode(0, shortage_blocks=4, queued_tokens=32, queued_requests=2, running=RUNNING, host_free_blocks=100,
                    peer_room=(), step_s=0.01, queue=two)
    pr = predict(tight, PRICES)
    assert pr["recompute"].terms["victims"] == 1 and pr["swap"].terms["swapped_blocks"] == 4  # 2 lacking: the first
    # without the queue the growth cannot be walked: the shortage's victims (the first version's rule)
    assert predict(episode(), PRICES)["recompute"].terms["victims"] == 1


def test_each_response_predicted_by_hand():
    pr = predict(episode(), PRICES)
    # recompute: wait 100 steps x 10 ms for the memory (the queue's 100 tokens prefill meanwhile: the later of the
    # two), then the first victim's 64 again (no queue given: the drain is the running requests')
    assert pr["recompute"].seconds == pytest.approx(max(1.0, 0.1) + 0.064)
    # swap: the same wait, the victim's 4 blocks out and back (2 x 4 ms) instead of its re-prefill
    assert pr["swap"].seconds == pytest.approx(max(1.0, 0.1) + 0.008)
    # no peer: a migration moves nothing and is a recompute; no drop plan: a drop cannot run
    assert pr["migrate"].seconds == pytest.approx(pr["recompute"].seconds) and pr["migrate"].note
    assert math.isinf(pr["drop"].seconds)
    # a peer with 10 blocks takes both decoding requests (2, then 4 blocks: 6 >= 4), 96 tokens' KV over the link
    pr = predict(episode(peers=(10,)), PRICES)
    assert pr["migrate"].terms["moved"] == 2 and pr["migrate"].seconds == pytest.approx(96 * 16 / 256e3 + 0.1)
    # a drop into a pair whose freed weights cover the shortage: the group's 200 queued tokens on 2 instances, one
    # group step whose microbatch crosses one stage boundary (100 tokens x 8 bytes)
    drop = DropOption(members=2, freed_blocks=50, queued_tokens=200, queued_requests=2)
    pr = predict(episode(peers=(10,), drop=drop), PRICES)
    assert pr["drop"].seconds == pytest.approx(0.2 / 2 + 100 * 8 / 256e3)


def test_the_least_predicted_response_is_chosen_and_ties_go_to_the_simpler():
    assert decide(episode(), PRICES, None, AutoParams()).choice == "swap"
    assert decide(episode(peers=(10,)), PRICES, None, AutoParams()).choice == "migrate"
    drop = DropOption(members=2, freed_blocks=50, queued_tokens=200, queued_requests=2)
    assert decide(episode(peers=(10,), drop=drop), PRICES, None, AutoParams()).choice == "drop"
    # no host room: swap is a recompute, migrate too (no peer): the tie goes to recompute
    c = decide(episode(host=0), PRICES, None, AutoParams())
    assert c.choice == "recompute" and c.predictions["swap"].seconds == c.predictions["recompute"].seconds


def test_a_new_episode_keeps_the_last_choice_unless_the_best_is_margin_faster():
    drop = DropOption(members=2, freed_blocks=50, queued_tokens=200, queued_requests=2)
    e = episode(peers=(10,), drop=drop)  # drop 0.103 s, migrate 0.106 s: within 20 %
    kept = decide(e, PRICES, "migrate", AutoParams(margin=0.2))
    assert kept.choice == "migrate" and "hysteresis" in kept.reason
    assert decide(e, PRICES, "migrate", AutoParams(margin=0.0)).choice == "drop"
    # recompute (1.064 s) against migrate (0.106 s): far more than 20 % slower, left
    assert decide(episode(peers=(10,)), PRICES, "recompute", AutoParams()).choice == "migrate"
    # a previous choice that cannot run now (inf) is always left
    assert decide(episode(), PRICES, "drop", AutoParams()).choice == "swap"


def test_a_recorded_choice_replays_from_its_json():
    drop = DropOption(members=2, freed_blocks=50, queued_tokens=200, queued_requests=2)
    for e, prev in ((episode(), None), (episode(peers=(10,), drop=drop), "migrate"), (episode(host=0), "swap")):
        c = decide(e, PRICES, prev, AutoParams(), now=3.5)
        back = AutoChoice.from_dict(json.loads(json.dumps(c.to_dict())))
        again = replay(back)
        assert again.choice == c.choice and again.reason == c.reason
        assert {k: v.seconds for k, v in again.predictions.items()} == {k: v.seconds for k, v in c.predictions.items()}


def test_a_pinned_schedule_takes_its_response_wherever_it_can_run_and_replays():
    # the hindsight bound's knob: recompute from 0 s, migrate from 10 s, whatever the predictions say
    params = AutoParams(pinned=((0.0, "recompute"), (10.0, "migrate")))
    drop = DropOption(members=2, freed_blocks=50, queued_tokens=200, queued_requests=2)
    e = episode(peers=(10,), drop=drop)  # drop is predicted least here
    early = decide(e, PRICES, "drop", params, now=3.0)
    assert early.choice == "recompute" and early.reason.startswith("pinned: recompute")  # no hysteresis either
    assert decide(e, PRICES, None, params, now=12.0).choice == "migrate"
    # before the first entry: the first response; a pinned response that cannot run falls back to the least
    assert AutoParams(pinned=((5.0, "swap"),)).pinned_at(1.0) == "swap" and AutoParams().pinned_at(1.0) is None
    fallback = decide(episode(), PRICES, None, AutoParams(pinned=((0.0, "drop"),)), now=1.0)
    assert fallback.choice == "swap" and fallback.reason.startswith("pinned drop cannot run now")
    for c in (early, fallback):
        again = replay(AutoChoice.from_dict(json.loads(json.dumps(c.to_dict()))))
        assert again.choice == c.choice and again.reason == c.reason and again.params == c.params
    with pytest.raises(ValueError, match="pinned"):
        AutoParams(pinned=((10.0, "swap"), (0.0, "drop")))
    with pytest.raises(ValueError, match="pinned"):
        AutoParams(techniques=("recompute", "swap"), pinned=((0.0, "drop"),))


def test_an_episode_lasts_while_throttled_and_hold_s_after():
    ch = AutoChooser(AutoParams(hold_s=2.0))
    assert not ch.in_episode(0, 0.0)
    ch.choose(0.0, episode(), PRICES)
    ch.throttled([0], 1.0)
    assert ch.in_episode(0, 2.9) and not ch.in_episode(0, 3.1)
    ch.forget([0])
    assert not ch.in_episode(0, 1.5)


def test_bad_parameters_and_modes():
    with pytest.raises(ValueError, match="margin"):
        AutoParams(margin=1.0)
    with pytest.raises(ValueError, match="some of"):
        AutoParams(techniques=("swap", "hope"))
    with pytest.raises(ValueError, match="some of"):
        AutoParams(techniques=())
    with pytest.raises(ValueError, match="at least 2 instances"):
        check_pressure_mode("auto", 1)
    with pytest.raises(ValueError, match="pipeline stages"):
        check_pressure_mode("auto", 2, num_layers=1)


# ---------------------------------------------------------------------------- over a monitor
M8 = ModelMemory(num_layers=8, layer_bytes=2560, kv_bytes_per_token=16)  # a layer's weights: 10 blocks


def _monitor(free0=2, waiting0=1):
    # instance 0: 100 blocks, 2 free, one request of 150 tokens queued needing 10 blocks; 1 and 2 have room
    st0 = InstanceStatus(0, 100, free0, 16, 5, waiting0, 10 * waiting0, 0.02, 0, 10 * waiting0,
                         queued_prefill_tokens=150 * waiting0, num_free_host_blocks=40)
    return GlobalMonitor([st0, InstanceStatus(1, 100, 60, 16, 2, 0, 0, 0.02, 0, 0),
                          InstanceStatus(2, 100, 60, 16, 2, 0, 0, 0.02, 0, 0)])


def test_an_onset_is_chosen_from_the_monitor_and_logged():
    log: list[PressureDecision] = []
    made: list[AutoChoice] = []
    mon = _monitor()
    auto = AutoPressure(mon, M8, PRICES, recorder=log.append, choices=made.append)
    [c] = auto.onsets(1.0, {0: list(RUNNING)})
    e = c.episode
    assert (e.index, e.shortage_blocks, e.queued_tokens, e.host_free_blocks, e.step_s) == (0, 9, 150, 40, 0.02)
    assert e.peer_room == (59, 59)  # free less the 1 % watermark
    assert e.drop.members == 2 and e.drop.freed_blocks == 8 * 2560 // 256  # one copy of the layers
    assert made == [c] and auto.mode == {0: c.choice} and replay(c).choice == c.choice
    assert [d.kind for d in log] == ["throttle", "choose"] and log[1].details["choice"] == c.choice
    assert set(log[1].details["predicted_s"]) == {"recompute", "swap", "migrate", "drop"}
    # the episode goes on while throttled (and hold_s after): no new choice
    assert auto.onsets(1.5, {0: list(RUNNING)}) == [] and auto.onsets(3.0, {0: list(RUNNING)}) == []
    mon.on_status(_monitor(free0=60, waiting0=0).instances[0].status, 3.2)  # the throttle clears
    assert auto.onsets(3.2, {}) == []
    mon.on_status(_monitor().instances[0].status, 4.0)  # back within hold_s of the last seen: the same episode
    assert auto.onsets(4.0, {0: list(RUNNING)}) == []
    mon.on_status(_monitor(free0=60, waiting0=0).instances[0].status, 4.5)
    auto.onsets(4.5, {})
    mon.on_status(_monitor().instances[0].status, 9.0)
    [again] = auto.onsets(9.0, {0: list(RUNNING)})
    assert again.previous == c.choice


def test_kunserve_drops_only_for_the_throttles_auto_gave_to_drop():
    mon = _monitor()
    decisions: list = []
    auto = AutoPressure(mon, M8, PRICES, decisions=decisions.append)
    auto.onsets(1.0, {0: list(RUNNING)})
    auto.mode[0] = "migrate"
    assert auto.decide(1.0) is None  # throttled, but not given to drop (and no restore while throttled)
    auto.mode[0] = "drop"
    plan = auto.decide(1.1)
    assert isinstance(plan, DropPlan) and 0 in plan.changed[0]
    assert decisions[-1].only == (0,)
    from tidal.cluster.pressure.record import replay as replay_plan

    assert replay_plan(decisions[-1], M8) == plan  # the gate is part of the record
    auto.applied(plan, 1.2)
    assert not auto.chooser.in_episode(0, 1.3)  # a new shape: its next throttle is an onset


def test_migrations_only_from_migrate_instances_to_instances_running_alone():
    mon = _monitor()
    auto = AutoPressure(mon, M8, PRICES)
    auto.onsets(1.0, {0: list(RUNNING)})
    running = {0: [("a", 4), ("b", 6)]}
    auto.mode[0] = "swap"
    assert auto.migrations(1.0, running) == []
    auto.mode[0] = "migrate"
    moves = auto.migrations(1.0, running)
    assert moves and {m.src for m in moves} == {0} and {m.dst for m in moves} <= {1, 2}
    mon.on_groups(((0,), (1, 2)))  # 1 and 2 now run as a pipeline group: no migration goes there
    assert auto.migrations(1.0, running) == []
    assert auto.preemption_mode(0) == "recompute"
    auto.mode[0] = "swap"
    assert auto.preemption_mode(0) == "swap"


def test_auto_learns_how_far_a_response_runs_from_its_prediction():
    """When the last request waiting at an episode's onset has its first token, realized / predicted is
    that response's ratio; later predictions of it are scaled by the median of its ratios (the reason says
    so), and a recorded choice replays with the scales it used."""
    from dataclasses import replace as dc_replace

    drop = DropOption(members=2, freed_blocks=50, queued_tokens=200, queued_requests=2)
    queue = (Victim(50, 4, False, 5, "a"), Victim(50, 4, False, 5, "b"))
    e = dc_replace(episode(peers=(10,), drop=drop), queue=queue)
    ch = AutoChooser(AutoParams(margin=0.0))
    first = ch.choose(10.0, e, PRICES)
    assert first.choice == "drop" and not first.scales
    predicted = first.predictions["drop"].seconds
    ch.first_token("a", 10.1)
    assert not ch.scales()  # "b" still waits
    ch.first_token("b", 10.0 + 3 * predicted)
    # drop's own ratio; the responses not yet taken are scaled by the error shown so far, drop's alone
    assert ch.ratios.keys() == {"drop"} and ch.scales() == {t: pytest.approx(3.0) for t in AutoParams().techniques}
    ch.first_token("b", 99.0)  # a served episode is not counted twice
    assert list(ch.ratios["drop"]) == [pytest.approx(3.0)]
    ch.ratios["migrate"] = deque([1.0], maxlen=8)  # a migration served as predicted
    second = ch.choose(20.0, e, PRICES)
    assert second.choice == "migrate" and second.scales["drop"] == pytest.approx(3.0)
    assert "drop predicted 0.0516 s (0.103 x 0.5 learned)" in decide(e, PRICES, None, AutoParams(), scales={"drop": 0.5}).reason
    back = AutoChoice.from_dict(json.loads(json.dumps(second.to_dict())))
    assert replay(back).choice == "migrate" and replay(back).reason == second.reason
    # a queue served at its onset's own instant teaches nothing (a scale of 0 would make inf * 0 a nan)
    instant = AutoChooser(AutoParams(margin=0.0))
    instant.choose(30.0, e, PRICES)
    instant.first_token("a", 30.0)
    instant.first_token("b", 30.0)
    assert not instant.scales() and not instant.open
    # learn 0: no episode is followed, nothing is scaled
    off = AutoChooser(AutoParams(margin=0.0, learn=0))
    off.choose(10.0, e, PRICES)
    off.first_token("a", 11.0)
    off.first_token("b", 50.0)
    assert not off.scales() and off.choose(20.0, e, PRICES).choice == "drop"
    with pytest.raises(ValueError, match="learn"):
        AutoParams(learn=-1)


def test_a_migration_that_moves_nothing_is_scaled_and_learned_as_recompute():
    """No peer has room: migrate's prediction is recompute's (the same queue under the scheduler's recompute),
    so it takes recompute's learned scale, the tie goes to recompute, and an episode of it teaches recompute
    (before this, migrate kept scale 1 beside recompute's 1.44 and the same recompute was taken as migrate)."""
    from dataclasses import replace as dc_replace

    queue = (Victim(50, 4, False, 5, "a"),)
    e = dc_replace(episode(host=0), queue=queue)  # no host room, no peer: swap and migrate are recompute here
    pr = predict(e, PRICES)
    assert pr["migrate"].same_as == "recompute" and pr["migrate"].to_dict()["same_as"] == "recompute"
    assert predict(episode(peers=(10,)), PRICES)["migrate"].same_as == ""  # it moves: its own
    c = decide(e, PRICES, None, AutoParams(techniques=("recompute", "migrate")), scales={"recompute": 1.44})
    assert c.choice == "recompute" and "x 1.4 learned" in c.reason
    # the previous choice kept by hysteresis is still migrate; its served episode is learned as recompute
    ch = AutoChooser(AutoParams(techniques=("migrate", "recompute")))
    first = ch.choose(10.0, e, PRICES)
    assert first.choice == "migrate"  # the tie goes to the first of the techniques, as always
    ch.first_token("a", 10.0 + 2 * first.predictions["migrate"].seconds)
    assert set(ch.ratios) == {"recompute"} and ch.scales()["recompute"] == pytest.approx(2.0)
    again = ch.choose(20.0, dc_replace(e, index=1), PRICES)
    assert again.scales == {"recompute": pytest.approx(2.0)}
    assert again.predictions["migrate"].seconds == pytest.approx(again.predictions["recompute"].seconds)
    assert replay(AutoChoice.from_dict(json.loads(json.dumps(again.to_dict())))).reason == again.reason


def test_a_response_not_yet_taken_is_scaled_by_every_response_s_error_so_far():
    """A queue with no victims waits the same under recompute and swap (their predictions equal). Swap's served
    episode took 1.3x its prediction: recompute, never taken, is scaled by that error too (the median of every
    response's latest ratios), so the tie keeps the instance's swap; before, recompute kept scale 1, looked 1.3x
    faster and was taken (auto-nodrop at 1.25x, seed 2). Once recompute has its own ratio, that one is its scale."""
    from dataclasses import replace as dc_replace

    q = (Victim(48, 6, False, 5, "a"),)
    roomy = Episode(0, shortage_blocks=2, queued_tokens=48, queued_requests=1, running=RUNNING, host_free_blocks=100,
                    peer_room=(), step_s=0.01, queue=q)
    ch = AutoChooser(AutoParams(techniques=("swap", "recompute")))  # a tie goes to swap, the first
    assert ch.scales() == {}  # nothing served yet: every scale is 1
    first = ch.choose(0.0, roomy, PRICES)
    assert first.choice == "swap" and first.scales == {}
    ch.first_token("a", 1.3 * first.predictions["swap"].seconds)
    assert set(ch.ratios) == {"swap"} and ch.scales() == {"recompute": pytest.approx(1.3), "swap": pytest.approx(1.3)}
    again = ch.choose(5.0, dc_replace(roomy, queue=(Victim(48, 6, False, 5, "b"),)), PRICES)
    assert again.predictions["recompute"].seconds == pytest.approx(again.predictions["swap"].seconds)
    assert again.choice == "swap" and again.scales == {"recompute": pytest.approx(1.3), "swap": pytest.approx(1.3)}
    assert replay(AutoChoice.from_dict(json.loads(json.dumps(again.to_dict())))).choice == "swap"
    # recompute's own episode, served at twice its prediction: its own ratio replaces the shared one
    ch.open.append(_Open("recompute", 1.0, 10.0, {"c"}))
    ch.first_token("c", 12.0)
    assert ch.scales() == {"recompute": pytest.approx(2.0), "swap": pytest.approx(1.3)}


def test_undo_at_limit_restores_the_groups_and_keeps_drop_off_until_demand_falls():
    """The ablation ``undo_at_limit``: once KunServe's limit signal fires (KV use still rising after a
    drop), ``decide`` restores the group even while it is throttled, no drop is offered, and drop comes
    back only when every instance runs alone and the cluster's KV demand is under the restore threshold.
    Off (the default), the same throttled group is left as it is."""
    from tidal.cluster.pressure import AutoscaleSignal, RestorePlan

    def run(undo: bool):
        log: list[PressureDecision] = []
        mon = _monitor()
        auto = AutoPressure(mon, M8, PRICES, params=AutoParams(undo_at_limit=undo), recorder=log.append,
                            autoscale=AutoscaleSignal(window_s=1.0, min_rise=0.01, high=0.1))
        auto.onsets(1.0, {0: list(RUNNING)})
        auto.mode[0] = "drop"
        plan = auto.decide(1.1)
        assert isinstance(plan, DropPlan)
        auto.applied(plan, 1.2)
        (g,) = plan.changed
        auto.mode[g[0]] = "recompute"  # the group's next episode took recompute
        for t, free in ((2.0, 20), (3.5, 5)):  # the group stays throttled and its KV use keeps rising
            mon.on_status(InstanceStatus(g[0], 264, free, 16, 9, 4, 60, None, 0, 30), t)
            out = auto.decide(t)
        return auto, mon, log, g, out

    auto, mon, log, g, out = run(undo=False)
    assert out is None and auto.limited_since is None and "limit" not in [d.kind for d in log]
    assert [d.kind for d in log].count("autoscale") == 1  # the signal fired; the group stays

    auto, mon, log, g, out = run(undo=True)
    assert isinstance(out, RestorePlan) and out.group == g and auto.limited_since == 3.5
    assert [d.kind for d in log][-3:] == ["autoscale", "limit", "restore"] and log[-1].details["reason"] == "limit"
    assert auto.decide(3.6) is None  # one plan at a time
    auto.applied(out, 4.0)
    assert auto.groups == ((0,), (1,), (2,))
    # alone and throttled again, while KV demand stays high: drop is not offered, the spell goes on
    for i in range(3):
        mon.on_status(_monitor().instances[0].status if i == 0 else
                      InstanceStatus(i, 100, 10, 16, 8, 0, 0, 0.02, 0, 0), 9.0)
    [c] = auto.onsets(9.0, {0: list(RUNNING)})
    assert math.isinf(c.predictions["drop"].seconds) and "limit signal" in c.predictions["drop"].note
    assert c.choice != "drop" and replay(c).choice == c.choice
    auto.mode[0] = "drop"  # even a drop left over from an earlier choice is gated
    assert auto.decide(9.1) is None and auto.limited_since == 3.5
    # calm, under half of the pools: drop comes back
    for i in range(3):
        mon.on_status(InstanceStatus(i, 100, 70, 16, 2, 0, 0, 0.02, 0, 0), 12.0)
    assert auto.decide(12.0) is None and auto.limited_since is None and log[-1].kind == "limit-over"
    assert auto.snapshot()["limited_since"] is None
