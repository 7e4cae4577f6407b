"""The front end's moves (tidal.runtime.handoffs driving tidal.cluster.moves.Move) against a
stand-in cluster: the worker replies a move can meet, in the orders they can come, and what the
front end sends and books for each: a migration that lands, one its source cannot start, a
refusal before and after the source let the request go, a destination or a source dying mid-move,
a P/D hand-off refused and retried elsewhere, a split whose beta refuses, and a move that times
out. Every ending leaves the books clean: nothing reserved, the request on one instance, every
chunk handle released or read."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from tidal.cluster.dispatch import ClusterLayout, Dispatcher
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.moves import MoveDeadlines, MoveKind
from tidal.cluster.router import build_router
from tidal.core.sampling import SamplingParams
from tidal.runtime import protocol as P
from tidal.runtime.handoffs import HandoffFront
from tidal.runtime.migrate import MigrateCoordinator
from tidal.runtime.records import Tracked


class Handle:
    def __init__(self, k: int):
        self.k, self.nbytes = k, 100

    def __repr__(self) -> str:
        return f"H{self.k}"


class Transport:
    def __init__(self) -> None:
        self.released: list[Handle] = []

    def release(self, h: Handle) -> None:
        self.released.append(h)


class Front(HandoffFront):
    """The cluster front end's state a move touches, with sends recorded and fail-overs counted."""

    ready = True
    cache_routing = False  # round-robin: no cache views

    def __init__(self, statuses: list[InstanceStatus], layout: ClusterLayout, migrate: bool = False):
        self.monitor = GlobalMonitor(statuses, layout.roles())
        self.dispatcher = Dispatcher(layout, self.monitor, build_router("round-robin"))
        self.requests: dict[str, Tracked] = {}
        self.by_wid: dict[str, Tracked] = {}
        self.transport = Transport()
        self.split = None
        self.kv_bytes_moved = 0
        self.move_deadlines = MoveDeadlines(reserve_s=10, transfer_s=10, free_s=10)
        self.moves_ended: dict[str, int] = {}
        self.move_records: deque = deque()
        self.sent: list[tuple[int, Any]] = []
        self.failed_over: list[str] = []
        self.clock = 0.0
        self.pressure = MigrateCoordinator(self) if migrate else None

    def now(self) -> float:
        return self.clock

    def send(self, i: int, cmd: Any) -> None:
        self.sent.append((i, cmd))

    def failover(self, t: Tracked) -> None:
        self.drop_handoff(t)
        self.failed_over.append(t.rid)
        t.instance = -1

    def recompute(self, t: Tracked, src: int, abort: bool = True) -> None:
        raise AssertionError("moves end through the machine, not a coordinator's recompute")

    def track(self, rid: str, instance: int, prompt: int, tokens: int) -> Tracked:
        t = Tracked(rid, [1] * prompt, SamplingParams(max_tokens=64), 0, "online", None,  # type: ignore[arg-type]
                    asyncio.Queue(), instance=instance, tokens=[2] * tokens)  # nothing is delivered here
        self.requests[rid] = self.by_wid[rid] = t
        self.monitor.on_dispatch(instance, rid, 0.0)
        return t

    def reply(self, i: int, r: Any) -> None:
        table = {P.HandoffStarted: self._on_handoff, P.KVChunk: self._on_kv, P.Landed: self._on_landed,
                 P.Refused: self._on_refused, P.Unmoved: self._on_unmoved}
        table[type(r)](i, r, self.clock)

    def sent_kinds(self) -> list[tuple[int, str]]:
        return [(i, type(c).__name__) for i, c in self.sent]

    def reserved(self) -> dict[int, dict[str, int]]:
        return {r.index: dict(r.reserved) for r in self.monitor.instances if r.reserved}


def _migrating() -> tuple[Front, Tracked]:
    # instance 0: 20 blocks, 2 free, its head of line needs 12 (throttled); instance 1: 40 free of 40
    front = Front([InstanceStatus(0, 20, 2, 16, 2, 1, 12, None, 0, 12), InstanceStatus(1, 40, 40, 16, 0, 0, 0)],
                  ClusterLayout(2), migrate=True)
    t = front.track("a", 0, 100, 12)
    front.pressure.tick(1.0)
    assert front.sent == [(0, P.Migrate("a"))] and front.reserved() == {1: {"a": 8}}
    return front, t


def _started(front: Front, chunks: int, last: bool) -> list[Handle]:
    front.reply(0, P.HandoffStarted("a", "snap", 8, chunks))  # type: ignore[arg-type]
    hs = [Handle(k) for k in range(chunks)]
    for k, h in enumerate(hs[: chunks if last else chunks - 1]):
        front.reply(0, P.KVChunk("a", h, k == chunks - 1))  # type: ignore[arg-type]
    return hs


def test_a_migration_reserves_starts_the_source_forwards_its_chunks_and_lands():
    front, t = _migrating()
    hs = _started(front, 2, last=True)
    assert front.sent[1:] == [(1, P.Import("snap", True)), (1, P.KVChunk("a", hs[0], False)),  # type: ignore[arg-type]
                              (1, P.KVChunk("a", hs[1], True))]  # type: ignore[arg-type]
    front.reply(1, P.Landed("a"))
    assert t.instance == 1 and t.handoff is None and front.reserved() == {}
    assert "a" in front.monitor.instances[1].outstanding and "a" not in front.monitor.instances[0].outstanding
    assert front.transport.released == []  # the destination read (and released) them
    assert front.pressure.snapshot()["migrated"] == 1 and front.moves_ended == {"done": 1}
    (rec,) = front.move_records
    assert (rec.request_id, rec.kind, rec.src, rec.dst, rec.outcome) == ("a", "migrate", 0, 1, "done")
    assert rec.events == ("start", "reserved 1", "landed 1", "done")


def test_a_source_that_cannot_start_keeps_the_request_and_nothing_stays_reserved():
    front, t = _migrating()
    front.reply(0, P.Unmoved("a"))
    assert t.instance == 0 and t.handoff is None and front.reserved() == {}
    assert front.sent == [(0, P.Migrate("a"))]  # nothing to resume: the source never paused it
    assert front.pressure.snapshot()["failed"] == 1 and front.moves_ended == {"stayed": 1}


def test_a_refusal_while_the_source_holds_the_request_keeps_it_there():
    front, t = _migrating()
    hs = _started(front, 3, last=False)  # two of three chunks put: the source still holds it
    front.reply(1, P.Refused("a", "no room"))
    assert front.sent[-1] == (0, P.Stay("a")) and t.instance == 0 and t.handoff is None
    assert front.reserved() == {} and front.transport.released == hs[:2] and front.failed_over == []
    # its last chunk was already on its way: the source let it go after all, so it is re-run
    front.reply(0, P.KVChunk("a", hs[2], True))  # type: ignore[arg-type]
    assert front.transport.released == hs and front.failed_over == ["a"]


def test_a_refusal_after_the_source_let_the_request_go_reruns_it():
    front, t = _migrating()
    hs = _started(front, 2, last=True)
    front.reply(1, P.Refused("a", "no room"))
    assert front.failed_over == ["a"] and front.reserved() == {} and front.transport.released == hs
    assert (0, P.Stay("a")) not in front.sent and front.moves_ended == {"failed_over": 1}


def test_a_destination_dying_mid_move_leaves_the_request_on_its_source_and_a_source_dying_reruns_it():
    front, t = _migrating()
    _started(front, 2, last=False)
    assert front.on_instance_failed(t, 1, 2.0)
    assert t.instance == 0 and front.sent[-1] == (0, P.Stay("a")) and front.failed_over == [] and front.reserved() == {}
    front2, t2 = _migrating()
    _started(front2, 2, last=False)
    assert front2.on_instance_failed(t2, 0, 2.0)
    assert front2.failed_over == ["a"] and front2.sent[-1] == (1, P.Abort("a")) and front2.reserved() == {}
    assert not front2.on_instance_failed(t2, 0, 3.0)  # no move any more


def test_a_source_that_starts_after_its_destination_died_is_told_to_stay_and_is_no_new_move():
    """The destination died before the source read ``migrate``: the move stays and the source, which
    will start anyway, is told to ``stay`` (it was not: it moved the request out and let it go, to be
    re-run). Its late ``handoff`` is no P/D hand-off of a colocated instance (one was started: it
    waited for a decode instance for the move's deadline, then re-ran the request), its chunks are
    released; only one whose last chunk came first (it let the request go) is re-run."""
    for last in (False, True):
        front, t = _migrating()
        assert front.on_instance_failed(t, 1, 2.0) and front.sent[-1] == (0, P.Stay("a"))
        hs = _started(front, 2, last=last)
        assert t.handoff is None and front.transport.released == hs[: 2 if last else 1]
        assert front.failed_over == (["a"] if last else []) and t.instance == (-1 if last else 0)
        assert [(m.kind, m.outcome) for m in front.move_records] == [("migrate", "stayed")] and front.reserved() == {}


def test_a_move_past_its_deadline_falls_back_and_never_waits_forever():
    front, t = _migrating()
    _started(front, 2, last=False)
    front.clock = 9.0
    front.tick_moves(9.0)
    assert t.handoff is not None  # within its 10 s
    front.clock = 11.5
    front.tick_moves(11.5)
    assert t.handoff is None and t.instance == 0 and front.sent[-2:] == [(1, P.Abort("a")), (0, P.Stay("a"))]
    assert front.reserved() == {}


def _pd() -> Front:
    # 1 prefill + 2 decode instances; decode 2 looks roomier, so it is asked first
    return Front([InstanceStatus(0, 40, 40, 16), InstanceStatus(1, 40, 30, 16), InstanceStatus(2, 40, 40, 16)],
                 ClusterLayout(3, "disaggregate", 1))


def test_a_refused_handoff_waits_and_goes_with_all_its_chunks_to_the_next_decode_instance():
    front = _pd()
    t = front.track("a", 0, 64, 1)
    front.reply(0, P.HandoffStarted("a", "snap", 5, 2))  # type: ignore[arg-type]
    hs = [Handle(0), Handle(1)]
    for k, h in enumerate(hs):
        front.reply(0, P.KVChunk("a", h, k == 1))  # type: ignore[arg-type]
    assert front.sent_kinds() == [(2, "Import"), (2, "KVChunk"), (2, "KVChunk")] and front.reserved() == {2: {"a": 5}}
    front.monitor.on_status(InstanceStatus(2, 40, 0, 16), 0.5)  # a fresher report: 2 is full
    front.reply(2, P.Refused("a", "no room"))
    assert t.handoff is not None and t.handoff.dst is None and front.reserved() == {}
    front.tick_moves(1.0)  # the next report: 1 has room
    assert front.sent_kinds()[3:] == [(1, "Import"), (1, "KVChunk"), (1, "KVChunk")]
    assert [c.last for _, c in front.sent[4:]] == [False, True]
    front.reply(1, P.Landed("a"))
    assert t.instance == 1 and front.monitor.num_handoffs == 1 and front.transport.released == []
    assert [e for _, e in front.moves_ended.items()] == [1] and "done" in front.moves_ended


def test_a_split_whose_beta_refuses_stays_whole_on_alpha_and_one_after_alpha_let_go_is_rerun():
    front = Front([InstanceStatus(0, 40, 40, 16), InstanceStatus(1, 40, 40, 16)], ClusterLayout(2, "split"))
    t = front.track("a", 0, 64, 0)
    front.begin_move(t, MoveKind.SPLIT, 0, 3, dst=1, split=40, started=True)
    assert front.sent_kinds() == [(1, "Reserve")] and front.sent[0][1].num_kv_tokens == 40
    front.reply(0, P.KVChunk("a", Handle(0), False))  # type: ignore[arg-type]
    assert front.sent_kinds()[-1] == (1, "KVChunk")  # streamed on as alpha computes
    front.reply(1, P.Refused("a", "no room"))
    assert front.sent[-1] == (0, P.Stay("a")) and t.instance == 0 and front.reserved() == {}
    u = front.track("b", 0, 64, 0)
    front.begin_move(u, MoveKind.SPLIT, 0, 3, dst=1, split=40, started=True)
    front.carry_out(u, u.handoff.move.source_freed(1.0))  # alpha's split_done: it let its part go
    front.reply(1, P.Refused("b", "no room"))
    assert front.failed_over == ["b"] and front.reserved() == {}


def test_a_handoff_whose_kv_cannot_be_read_is_recomputed_not_sent_again():
    """``Refused`` with ``kv_lost`` (the chunks' owner is gone, across Ray nodes): the machine's
    ``lost``: a hand-off is recomputed (handing the same unreadable chunks to another instance
    looped, refusal after refusal); a migration would stay on a source that holds it."""
    front = _pd()
    front.track("a", 0, 64, 1)
    front.reply(0, P.HandoffStarted("a", "snap", 5, 1))  # type: ignore[arg-type]
    h = Handle(0)
    front.reply(0, P.KVChunk("a", h, True))  # type: ignore[arg-type]
    front.reply(2, P.Refused("a", "KV chunk x cannot be read", kv_lost=True))
    assert front.failed_over == ["a"] and front.reserved() == {} and front.transport.released == [h]
    assert front.move_records[-1].outcome == "failed_over" and "lost" in front.move_records[-1].events
    front2, t2 = _migrating()
    _started(front2, 2, last=False)
    front2.reply(1, P.Refused("a", "KV chunk x cannot be read", kv_lost=True))
    assert t2.instance == 0 and front2.sent[-1] == (0, P.Stay("a")) and front2.failed_over == []


def test_a_handoff_while_no_decode_instance_is_alive_stays_on_its_prefill_instance():
    """1P1D with its decode instance down: the prefilled request is told to ``stay`` (its prefill
    instance decodes it to its end) instead of waiting for the restart, its chunks are released and
    nothing is left pending; with the decode instance back, the next one is handed off."""
    front = Front([InstanceStatus(0, 40, 40, 16), InstanceStatus(1, 40, 40, 16)], ClusterLayout(2, "disaggregate", 1))
    front.monitor.on_failure(1)
    t = front.track("a", 0, 64, 1)
    front.reply(0, P.HandoffStarted("a", "snap", 5, 2))  # type: ignore[arg-type]
    h = Handle(0)
    front.reply(0, P.KVChunk("a", h, False))  # type: ignore[arg-type]
    assert front.sent == [(0, P.Stay("a"))] and t.instance == 0 and t.handoff is None
    assert front.monitor.pending_handoffs == {} and front.reserved() == {} and front.transport.released == [h]
    assert front.move_records[-1].events == ("start", "no destination alive", "stayed")
    front.monitor.on_restart(InstanceStatus(1, 40, 40, 16), 1.0)
    front.track("b", 0, 64, 1)
    front.reply(0, P.HandoffStarted("b", "snap", 5, 1))  # type: ignore[arg-type]
    assert front.sent_kinds()[1:] == [(1, "Import")] and front.reserved() == {1: {"b": 5}}


def test_a_waiting_handoff_stays_when_the_decode_instances_die_and_an_aborted_one_leaves_no_pending():
    front = Front([InstanceStatus(0, 40, 40, 16), InstanceStatus(1, 40, 0, 16)], ClusterLayout(2, "disaggregate", 1))
    t = front.track("a", 0, 64, 1)
    front.reply(0, P.HandoffStarted("a", "snap", 5, 1))  # type: ignore[arg-type]
    assert front.monitor.pending_handoffs == {"a": 5} and t.handoff is not None  # no room: it waits
    u = front.track("b", 0, 64, 1)
    front.reply(0, P.HandoffStarted("b", "snap", 5, 1))  # type: ignore[arg-type]
    front.drop_handoff(u)  # the client went away
    assert front.monitor.pending_handoffs == {"a": 5}
    front.monitor.on_failure(1)
    front.tick_moves(1.0)  # it asks again: no decode instance is alive any more
    assert front.sent == [(0, P.Stay("a"))] and t.handoff is None and front.monitor.pending_handoffs == {}
