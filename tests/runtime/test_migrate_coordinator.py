"""The front end's side of ``--kv-pressure migrate`` (tidal.runtime.migrate) against a stand-in
front end: which moves it starts, the reservations it keeps on the monitor, and how each way a
move can end (landed, refused, source could not start it, destination died, request ended)
leaves the books: nothing reserved, the request's instance and outstanding sets right."""

from __future__ import annotations

import asyncio

from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.core.sampling import SamplingParams
from tidal.runtime.migrate import MigrateCoordinator
from tidal.runtime.protocol import Abort, Migrate
from tidal.runtime.records import Handoff, Tracked


class FakeFront:
    """The part of tidal.runtime.front.Front that MigrateCoordinator uses."""

    ready = True

    def __init__(self, statuses: list[InstanceStatus]):
        self.monitor = GlobalMonitor(statuses)
        self.requests: dict[str, Tracked] = {}
        self.by_wid: dict[str, Tracked] = {}
        self.sent: list[tuple[int, tuple]] = []
        self.failed_over: list[str] = []

    def track(self, rid: str, instance: int, prompt: int, tokens: int) -> Tracked:
        t = Tracked(rid, [1] * prompt, SamplingParams(max_tokens=64), 0, "online", None,  # type: ignore[arg-type]
                    asyncio.Queue(), instance=instance, tokens=[2] * tokens)  # nothing is delivered here
        self.requests[rid] = self.by_wid[rid] = t
        self.monitor.on_dispatch(instance, rid, 0.0)
        return t

    def send(self, i: int, cmd: object) -> None:
        self.sent.append((i, cmd))

    def recompute(self, t: Tracked, src: int, abort: bool = True) -> None:
        if abort:
            self.send(src, Abort(t.wid))
        self.monitor.on_finish(src, t.rid)
        self.failed_over.append(t.rid)


def _front() -> tuple[FakeFront, MigrateCoordinator]:
    # instance 0: 20 blocks, 2 free, its head of line needs 12 (throttled); instance 1: 40 free of 40
    front = FakeFront([InstanceStatus(0, 20, 2, 16, 2, 1, 12, None, 0, 12), InstanceStatus(1, 40, 40, 16, 0, 0, 0)])
    return front, MigrateCoordinator(front)


def test_a_throttled_instance_moves_its_shortest_running_request_and_reserves_its_blocks():
    front, mc = _front()
    front.track("long", 0, 150, 10)  # 160 tokens and the next one: 11 blocks
    front.track("short", 0, 100, 12)  # 8 blocks
    front.track("new", 0, 40, 0)  # still in prefill: never moves
    mc.tick(1.0)  # the head of line lacks 12 - 2 = 10 blocks: shortest first, 8 then 11
    assert front.sent == [(0, Migrate("short")), (0, Migrate("long"))]
    assert front.monitor.instances[1].reserved == {"short": 8, "long": 11}
    mc.tick(2.0)  # the same view again: both are counted as leaving already
    assert len(front.sent) == 2
    # "short" lands on 1: it runs there now, its reservation is gone
    t = front.requests["short"]
    t.handoff = Handoff(0, None, 7, 1, dst=1)
    assert mc.target("short") == 1
    mc.on_landed(t, 1)
    assert mc.target("short") is None and "short" in front.monitor.instances[1].outstanding
    assert "short" not in front.monitor.instances[0].outstanding
    assert front.monitor.instances[1].reserved == {"long": 11}
    # "long" finishes on 0 before its move starts: the source says unmoved; nothing stays reserved
    mc.on_unmoved(front.requests["long"])
    assert front.monitor.instances[1].reserved == {} and mc.snapshot()["moving"] == 0
    assert mc.snapshot()["migrated"] == 1 and mc.snapshot()["failed"] == 1
    assert mc.snapshot()["events_total"] == {"migrate": 2}


def test_a_refused_move_is_rerun_from_its_tokens_and_a_dead_destination_voids_the_moves_into_it():
    front, mc = _front()
    a = front.track("a", 0, 100, 12)
    mc.tick(1.0)
    assert [m for _, m in front.sent] == [Migrate("a")]
    a.handoff = Handoff(0, None, 7, 1, dst=1)
    mc.on_refused(a, 1)  # a stale report: no room on 1 after all
    assert front.sent[-1] == (0, Abort("a")) and front.failed_over == ["a"]
    assert front.monitor.instances[1].reserved == {} and "a" not in front.monitor.instances[0].outstanding
    # a move whose destination dies before the source said handoff: the source may already be
    # exporting it, so it is aborted there and re-run
    front2, mc2 = _front()
    front2.track("c", 0, 100, 12)
    mc2.tick(1.0)
    mc2.on_failure(1, 2.0)
    assert front2.sent[-1] == (0, Abort("c")) and front2.failed_over == ["c"] and mc2.target("c") is None
    # a request that ends while moving gives its reservation back
    front3, mc3 = _front()
    d = front3.track("d", 0, 100, 12)
    mc3.tick(1.0)
    assert mc3.forget(d) and front3.monitor.instances[1].reserved == {} and not mc3.forget(d)
