"""The dispatcher's decision log and its replay; the pure hand-off sizing and chunk plan."""

from __future__ import annotations

import pytest

from tidal.cluster.decisions import Decision, monitor_of, replay, views_of
from tidal.cluster.dispatch import ClusterLayout, Dispatcher
from tidal.cluster.handoff import ChunkSpec, handoff_blocks, plan_chunks
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.router import RouteRequest, build_router


def _cluster(layout: ClusterLayout, free: list[int], router: str = "least-outstanding"):
    mon = GlobalMonitor([InstanceStatus(i, 100, f, 16) for i, f in enumerate(free)], layout.roles())
    log: list[Decision] = []
    return mon, Dispatcher(layout, mon, build_router(router), recorder=log.append), log


def test_every_decision_is_logged_with_the_view_it_saw():
    layout = ClusterLayout(3, "disaggregate", 1)
    mon, disp, log = _cluster(layout, [100, 40, 60])
    assert disp.dispatch(RouteRequest("a", 30, 5), 1.5) == 0
    assert disp.choose_decode("a", 10, 2.0) == 2
    assert disp.choose_decode("b", 70, 2.5) is None
    assert [(d.kind, d.request_id, d.now, d.choice) for d in log] == [
        ("dispatch", "a", 1.5, 0), ("handoff", "a", 2.0, 2), ("handoff", "b", 2.5, None)]
    assert log[0].request == RouteRequest("a", 30, 5) and log[0].view(0).num_outstanding == 0  # before dispatch
    assert log[2].blocks == 70 and log[2].view(2).reserved_blocks == 10 and log[2].view(2).handoff_room == 50
    assert [v.role for v in log[1].views] == ["prefill", "decode", "decode"]


@pytest.mark.parametrize("router", ["least-outstanding", "kv-aware"])
def test_a_replay_on_the_logged_view_gives_the_same_answer(router):
    layout = ClusterLayout(4, "disaggregate", 2)
    mon, disp, log = _cluster(layout, [80, 90, 50, 70], router)
    for i in range(6):
        disp.dispatch(RouteRequest(f"r{i}", 10 + 100 * i, 4), float(i))
        disp.choose_decode(f"r{i}", 5 + 7 * i, float(i))
        if i == 2:  # a report and a landing between decisions
            mon.on_status(InstanceStatus(3, 100, 20, 16, queued_block_demand=4), float(i))
            first = next(d for d in log if d.kind == "handoff" and d.request_id == "r0")
            mon.on_handoff("r0", 0, first.choice)
    assert {d.choice for d in log if d.kind == "handoff"} >= {None, 2}
    for d in log:
        assert replay(d, layout, router) == d.choice, d


def test_monitor_of_rebuilds_the_view():
    layout = ClusterLayout(3, "disaggregate", 1)
    mon, disp, _ = _cluster(layout, [100, 40, 60])
    disp.dispatch(RouteRequest("a", 30, 5), 0.0)
    disp.choose_decode("a", 10)
    mon.on_failure(1)
    assert views_of(monitor_of(views_of(mon))) == views_of(mon)


def test_the_snapshot_reads_live_statuses():
    class Live:  # what the simulator hands the monitor: an object with InstanceStatus's fields
        index, num_blocks, num_free_blocks, block_size = 0, 10, 7, 16
        num_running, num_waiting, queued_block_demand, step_time_s, num_preemptions = 1, 2, 3, None, 0

    snap = GlobalMonitor([Live()]).snapshot(0.0)  # type: ignore[list-item]
    assert snap["instances"][0]["num_free_blocks"] == 7 and snap["instances"][0]["kv_usage"] == pytest.approx(0.3)


def test_handoff_blocks_and_chunks():
    assert [handoff_blocks(n, 16) for n in (1, 15, 16, 31, 32)] == [1, 1, 2, 2, 3]
    chunks = plan_chunks(range(5), 0, 40, 2, 16)
    assert chunks[:3] == [ChunkSpec((0, 1), 0, 16), ChunkSpec((0, 1), 16, 32), ChunkSpec((0, 1), 32, 40)]
    assert len(chunks) == 9 and chunks[-1] == ChunkSpec((4,), 32, 40) and chunks[-1].num_tokens == 8
    assert plan_chunks(range(3), 0, 10) == [ChunkSpec((0, 1, 2), 0, 10)]
    assert plan_chunks(range(3), 5, 5) == []
