"""The pure cluster decisions: layouts, the global monitor and the dispatcher, worked by hand."""

from __future__ import annotations

import pytest

from tidal.cluster.dispatch import ClusterLayout, Dispatcher
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.router import RouteRequest, build_router
from tidal.config import ConfigError


def status(i: int, free: int = 100, total: int = 100, queued: int = 0, step: float | None = None) -> InstanceStatus:
    return InstanceStatus(i, total, free, 16, queued_block_demand=queued, step_time_s=step)


def make(layout: ClusterLayout, router: str = "least-outstanding", free: list[int] | None = None):
    free = free or [100] * layout.instances
    mon = GlobalMonitor([status(i, f) for i, f in enumerate(free)], layout.roles())
    return mon, Dispatcher(layout, mon, build_router(router))


def rq(rid: str, prompt: int = 32, out: int = 8) -> RouteRequest:
    return RouteRequest(rid, prompt, out)


@pytest.mark.parametrize("kwargs, match", [
    (dict(instances=0), "instances must be >= 1"),
    (dict(instances=2, mode="pipeline"), "mode must be one of"),
    (dict(instances=3, mode="split"), "even number >= 2, got 3"),
    (dict(instances=2, mode="split", prefill_instances=1), "needs --mode disaggregate"),
    (dict(instances=1, mode="disaggregate", prefill_instances=1), "at least 2 instances"),
    (dict(instances=2, mode="disaggregate", prefill_instances=2), r"\[1, 1\]"),
    (dict(instances=3, mode="disaggregate", prefill_instances=0), r"\[1, 2\]"),
    (dict(instances=2, prefill_instances=1), "needs --mode disaggregate"),
])
def test_bad_layouts_are_one_line_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ClusterLayout(**kwargs)


def test_roles():
    assert ClusterLayout(3).roles() == ["colocated"] * 3
    assert ClusterLayout(3, "disaggregate", 1).roles() == ["prefill", "decode", "decode"]
    split = ClusterLayout(4, "split")  # unified instances, paired 2k alpha / 2k+1 beta
    assert split.roles() == ["colocated"] * 4 and split.pairs() == [(0, 1), (2, 3)] and split.split


def test_colocated_dispatch_balances_outstanding_and_skips_dead_instances():
    mon, disp = make(ClusterLayout(3))
    assert [disp.dispatch(rq(f"r{i}"), 0.0) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    mon.on_finish(1, "r1")
    mon.on_finish(1, "r4")
    assert disp.dispatch(rq("r6"), 1.0) == 1  # the least outstanding
    lost = mon.on_failure(0)
    assert lost == {"r0", "r3"}
    assert {disp.dispatch(rq(f"x{i}"), 2.0) for i in range(4)} == {1, 2}  # 0 is dead
    mon.on_restart(status(0), 3.0)
    assert disp.dispatch(rq("y"), 3.0) == 0 and mon.instances[0].restarts == 1


def test_no_live_instance_gives_none():
    mon, disp = make(ClusterLayout(2))
    mon.on_failure(0)
    mon.on_failure(1)
    assert disp.dispatch(rq("r"), 0.0) is None


def test_disaggregated_dispatch_goes_to_prefill_instances_only():
    mon, disp = make(ClusterLayout(4, "disaggregate", 2), router="round-robin")
    assert [disp.dispatch(rq(f"r{i}"), 0.0) for i in range(4)] == [0, 1, 0, 1]


def test_a_role_nobody_alive_holds_is_covered_by_the_survivors():
    """1P1D with an instance down degrades to colocated: no prefill instance alive, a decode one
    takes new requests and runs them whole; no decode instance alive, the prefill one keeps what it
    prefills (no hand-off); back to P/D once the role is back; None only with nobody alive."""
    mon, disp = make(ClusterLayout(3, "disaggregate", 1))
    assert disp.can_hand_off() and not disp.runs_whole(0) and disp.runs_whole(1)
    mon.on_failure(0)  # the prefill instance
    assert {disp.dispatch(rq(f"r{i}"), 0.0) for i in range(4)} == {1, 2}
    mon.on_failure(1)
    mon.on_failure(2)
    assert disp.dispatch(rq("x"), 1.0) is None and not disp.can_hand_off()
    mon.on_restart(status(0), 2.0)  # the prefill instance is back, no decode instance yet
    assert disp.dispatch(rq("y"), 2.0) == 0 and disp.runs_whole(0) and not disp.can_hand_off()
    assert disp.choose_decode("y", 1) is None  # (the front end asks can_hand_off first: it would wait forever)
    mon.on_restart(status(2), 3.0)
    assert disp.can_hand_off() and not disp.runs_whole(0) and disp.dispatch(rq("z"), 3.0) == 0
    mon.on_handoff_cancel("y")
    assert mon.pending_handoffs == {}


def test_handoff_goes_to_the_decode_instance_with_the_most_room_that_fits():
    # decode instances 1, 2, 3 with 30, 50 and 40 free blocks; instance 2 has 25 blocks queued
    mon, disp = make(ClusterLayout(4, "disaggregate", 1), free=[100, 30, 50, 40])
    mon.on_status(status(2, free=50, queued=25), 0.0)
    assert disp.choose_decode("a", 10) == 3  # rooms: 30, 25, 40
    assert mon.instances[3].handoff_room == 30  # 10 reserved for a
    assert disp.choose_decode("b", 10) == 1  # rooms now 30, 25, 30: the tie goes to fewer outstanding, then index
    mon.on_handoff("a", 0, 3)
    assert mon.instances[3].reserved == {} and "a" in mon.instances[3].outstanding
    # nothing has room for 45 blocks: the request waits, visible in the monitor
    assert disp.choose_decode("big", 45) is None
    assert mon.pending_handoffs == {"big": 45} and mon.snapshot(0.0)["pending_handoffs"] == 1
    mon.on_status(status(1, free=60), 1.0)
    assert disp.choose_decode("big", 45) == 1 and mon.pending_handoffs == {}


def test_a_refused_handoff_keeps_the_request_on_its_prefill_instance():
    mon, disp = make(ClusterLayout(2, "disaggregate", 1))
    disp.dispatch(rq("a"), 0.0)
    assert disp.choose_decode("a", 5) == 1
    mon.on_handoff("a", 0, 1, ok=False)
    assert "a" in mon.instances[0].outstanding and mon.instances[1].reserved == {} and mon.num_handoffs == 0


def test_arrival_rate_and_step_time_ema():
    mon, disp = make(ClusterLayout(1))
    for t in (0.0, 1.0, 2.0, 11.5):
        disp.dispatch(rq(f"r{t}"), t)
    assert mon.arrival_rate(0, 11.5) == pytest.approx(2 / 10)  # 2.0 and 11.5 are within 10 s
    mon.on_status(status(0, step=0.10), 12.0)
    mon.on_status(status(0, step=0.20), 12.1)
    assert mon.instances[0].step_time_ema_s == pytest.approx(0.8 * 0.10 + 0.2 * 0.20)


def test_each_role_runs_its_own_policy_with_only_its_arguments():
    from tidal.cluster.dispatch import check_role_policies, role_scheduler
    from tidal.config import SchedulerConfig
    from tidal.policies import check_policy

    sched = SchedulerConfig(batching="sla", tbt_slo_ms=50, policy_args=["bucket.theta=0.4", "sla.alpha=4"])
    pd = ClusterLayout(3, "disaggregate", 1)
    pre, dec = (role_scheduler(sched, r, "bucket") for r in ("prefill", "decode"))
    assert (pre.batching, pre.policy_args) == ("bucket", {"bucket.theta": "0.4"})
    assert (dec.batching, dec.policy_args) == ("sla", {"sla.alpha": "4"})
    assert role_scheduler(sched, "decode", None) is sched
    check_role_policies(sched, pd, "bucket", check_policy)
    with pytest.raises(ConfigError, match="needs --mode disaggregate"):
        check_role_policies(sched, ClusterLayout(2), "bucket", check_policy)
    with pytest.raises(ConfigError, match="'sla.alpha' names a policy no instance runs"):
        check_role_policies(SchedulerConfig(policy_args=["sla.alpha=4"]), pd, "bucket", check_policy)
    with pytest.raises(ConfigError, match="nope"):
        check_role_policies(sched, pd, "nope", check_policy)
