"""The request-move machine (tidal.cluster.moves): each way a move can go, event by event, with
the commands it asks for; every phase falls back by its deadline (a move never hangs); the moved
copy keeps the request's arrival time."""

from __future__ import annotations

import random

import pytest

from tidal.cluster.moves import (
    FailOver,
    FreeSource,
    Move,
    MoveDeadlines,
    MoveKind,
    Pause,
    Phase,
    Release,
    Reserve,
    Resume,
    Retry,
    SendChunk,
    moved_request,
)
from tidal.core.request import Request, RequestClass
from tidal.core.sampling import SamplingParams

DL = MoveDeadlines(reserve_s=5.0, transfer_s=2.0, free_s=1.0, retry_s=0.5)


def move(kind: MoveKind, dst: int | None = None, chunks: int = 3) -> Move:
    return Move("r", kind, src=0, blocks=4, num_chunks=chunks, dst=dst, deadlines=DL)


def test_a_move_that_goes_through():
    m = move(MoveKind.MIGRATE, dst=1)
    assert m.start(0.0) == [Reserve(4, 1)]  # room first, then the source pauses
    assert m.reserved(1, 0.1) == [Pause(0), SendChunk(1, 0), SendChunk(1, 1), SendChunk(1, 2)]
    assert m.chunk_landed(0, 0.2) == [] and m.chunk_landed(0, 0.2) == []  # a duplicate counts once
    assert m.chunk_landed(2, 0.3) == []
    assert m.chunk_landed(1, 0.4) == [Resume(1), FreeSource(0)]
    assert m.phase is Phase.LANDED and not m.over
    assert m.source_freed(0.5) == [] and m.phase is Phase.DONE
    assert [e for _, e in m.log] == ["start", "reserved 1", "landed 1", "done"]
    assert m.tick(100.0) == []  # over: no deadline any more


def test_the_source_freeing_before_the_last_chunk_lands_ends_the_move_at_landing():
    m = move(MoveKind.HANDOFF, chunks=1)
    m.start(0.0)
    m.reserved(2, 0.1)
    assert m.source_freed(0.2) == [] and m.phase is Phase.SENDING  # the prefill freed it after its last chunk
    assert m.chunk_landed(0, 0.3) == [Resume(2)] and m.phase is Phase.DONE


def test_a_refused_handoff_is_retried_and_lands_elsewhere():
    m = move(MoveKind.HANDOFF, chunks=2)
    assert m.start(0.0) == [Pause(0), Reserve(4)]  # its prefill is done: it waits paused
    assert m.reserved(1, 0.1) == [SendChunk(1, 0), SendChunk(1, 1)]
    m.chunk_landed(0, 0.2)
    assert m.refused(1, 0.3) == [Retry(0.8)]
    assert m.phase is Phase.RESERVING and m.dst is None and m.refusals == 1 and not m.landed
    assert m.refused(1, 0.35) == [Retry(0.85)]  # a stale refusal while pending: asked again
    assert m.reserved(2, 1.0) == [SendChunk(2, 0), SendChunk(2, 1)]
    m.chunk_landed(0, 1.1)
    assert m.chunk_landed(1, 1.2) == [Resume(2), FreeSource(0)]


def test_an_exchange_recomputes_what_its_group_cannot_take_its_source_retired():
    """KunServe Sec. 4.2: a member's requests move to the group that replaces it; the member holds
    them no more, so a refusal recomputes (on the group), and a landing needs no free."""
    m = move(MoveKind.EXCHANGE, dst=1, chunks=2)
    assert m.start(0.0) == [Reserve(4, 1)] and m.source_free and m.paused
    assert m.reserved(1, 0.1) == [SendChunk(1, 0), SendChunk(1, 1)]
    assert m.chunk_landed(0, 0.2) == [] and m.chunk_landed(1, 0.3) == [Resume(1)] and m.phase is Phase.DONE
    m = move(MoveKind.EXCHANGE, dst=1, chunks=2)
    m.start(0.0)
    assert m.refused(1, 0.1) == [FailOver("the destination refused it")] and m.phase is Phase.FAILED_OVER
    m = move(MoveKind.EXCHANGE, dst=1, chunks=2)  # no answer from the group: recomputed there by the deadline
    m.start(0.0)
    assert m.tick(5.0) == [Release(1), FailOver("the move timed out reserving")]


@pytest.mark.parametrize("kind", [MoveKind.MIGRATE, MoveKind.SPLIT])
def test_a_refusal_keeps_the_request_on_its_source_while_the_source_holds_it(kind):
    m = move(kind, dst=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.refused(3, 0.2) == []  # not its destination
    assert m.refused(1, 0.2) == [Resume(0)] and m.phase is Phase.STAYED
    # once the source let the KV go, a refusal recomputes the request
    m = move(kind, dst=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    m.source_freed(0.15)
    assert m.refused(1, 0.2) == [FailOver("the destination refused it")] and m.phase is Phase.FAILED_OVER


def test_a_source_that_cannot_start_the_move_keeps_the_request():
    m = move(MoveKind.MIGRATE, dst=1)
    m.start(0.0)
    assert m.refused(1, 0.1) == [] and m.phase is Phase.STAYED  # no room: it never paused
    m = move(MoveKind.MIGRATE, dst=1)
    m.start(0.0)
    m.reserved(1, 0.05)
    # the source finished (or was preempted) first: the reservation goes, the request runs on there
    assert m.refused(None, 0.1) == [Release(1), Resume(0)] and m.phase is Phase.STAYED
    assert m.reserved(1, 0.2) == []  # too late: the move is over


def test_failures_mid_move():
    # the destination dies while chunks travel: the migration stays on its source
    m = move(MoveKind.MIGRATE, dst=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.failed(5, 0.2) == []  # another instance
    assert m.failed(1, 0.2) == [Resume(0)] and m.phase is Phase.STAYED
    # the source dies before landing: recompute, releasing the destination's reservation
    m = move(MoveKind.SPLIT, dst=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.failed(0, 0.2) == [Release(1), FailOver("the source failed mid-move")]
    # the source dies after landing: the copy runs on, the move is done
    m = move(MoveKind.EXCHANGE, dst=1, chunks=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    m.chunk_landed(0, 0.2)
    assert m.failed(0, 0.3) == [] and m.phase is Phase.DONE
    # the destination dies after landing: the copy is lost, the request is recomputed
    m = move(MoveKind.MIGRATE, dst=1, chunks=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    m.chunk_landed(0, 0.2)
    assert m.failed(1, 0.3) == [FreeSource(0), FailOver("the destination failed")]
    # a P/D hand-off whose decode instance dies recomputes (the prefill instance does not decode)
    m = move(MoveKind.HANDOFF)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.failed(1, 0.2) == [FreeSource(0), FailOver("the destination failed mid-move")]


@pytest.mark.parametrize("kind", [MoveKind.HANDOFF, MoveKind.MIGRATE, MoveKind.SPLIT])
def test_every_phase_falls_back_by_its_deadline(kind):
    dst = None if kind is MoveKind.HANDOFF else 1
    m = move(kind, dst=dst)
    m.start(0.0)
    assert m.tick(4.9) == []
    assert m.tick(5.0) == ([Resume(0)] if dst is None else [Release(1)]) and m.phase is Phase.STAYED
    m = move(kind, dst=dst)
    m.start(0.0)
    m.reserved(1, 1.0)
    m.source_freed(1.5)
    assert m.tick(2.9) == []
    assert m.tick(3.0) == [Release(1), FailOver("the move timed out sending")]
    m = move(kind, dst=dst, chunks=1)
    m.start(0.0)
    m.reserved(1, 1.0)
    m.chunk_landed(0, 1.5)
    assert m.tick(2.5) == [FreeSource(0)] and m.phase is Phase.DONE


def test_a_handoff_with_no_destination_alive_stays_on_its_source():
    """Every decode instance is down: the request decodes where it was prefilled (P/D degrades to
    colocated) rather than wait for a restart; after its source let it go, it is recomputed."""
    m = move(MoveKind.HANDOFF)
    assert m.start(0.0) == [Pause(0), Reserve(4)]
    assert m.unplaceable(0.1) == [Resume(0)] and m.phase is Phase.STAYED
    assert [e for _, e in m.log] == ["start", "no destination alive", "stayed"]
    assert m.unplaceable(0.2) == []  # over
    m = move(MoveKind.HANDOFF)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.unplaceable(0.2) == []  # it has a destination: not this event's business
    m = move(MoveKind.HANDOFF)
    m.start(0.0)
    m.source_free = True  # (its last chunk went before the destination died)
    assert m.unplaceable(0.1) == [FailOver("no destination is alive")] and m.phase is Phase.FAILED_OVER


@pytest.mark.parametrize("seed", range(30))
def test_random_event_orders_always_end_by_the_deadlines(seed):
    """Whatever the shell reports, in whatever order, a move is over by the sum of its deadlines
    (each refusal of a hand-off restarts its reservation), and it ends exactly one way."""
    rng = random.Random(seed)
    kind = rng.choice(list(MoveKind))
    m = move(kind, dst=None if kind is MoveKind.HANDOFF else 1, chunks=rng.randint(1, 4))
    t = 0.0
    cmds = m.start(t)
    for _ in range(rng.randint(0, 12)):
        t += rng.uniform(0.0, 0.6)
        ev = rng.choice(["reserved", "refused", "landed", "freed", "failed", "unplaceable", "tick"])
        if ev == "reserved":
            cmds += m.reserved(rng.choice([1, 2]), t)
        elif ev == "refused":
            cmds += m.refused(rng.choice([None, 1, 2]), t)
        elif ev == "landed":
            cmds += m.chunk_landed(rng.randrange(m.num_chunks), t)
        elif ev == "freed":
            cmds += m.source_freed(t)
        elif ev == "failed":
            cmds += m.failed(rng.choice([0, 1, 2, 3]), t)
        elif ev == "unplaceable":
            cmds += m.unplaceable(t)
        else:
            cmds += m.tick(t)
    t_end = t + DL.reserve_s + DL.transfer_s + DL.free_s
    cmds += m.tick(t_end)
    cmds += m.tick(t_end + DL.reserve_s + DL.transfer_s + DL.free_s)
    assert m.over
    endings = [c for c in cmds if isinstance(c, FailOver)]
    assert len(endings) <= 1
    assert (m.phase is Phase.FAILED_OVER) == (len(endings) == 1)
    if m.phase is Phase.STAYED and not m.source_free:  # a paused source that holds it was told to resume
        assert (Pause(0) in cmds) == (Resume(0) in cmds)


def test_the_moved_copy_keeps_arrival_time_and_history():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), arrival_time=2.5, priority=-1,
                  request_class=RequestClass.OFFLINE)
    req.output_token_ids = [7, 8]
    req.num_computed_tokens = 4
    req.num_preemptions = 2
    req.first_scheduled_time, req.first_token_time, req.last_token_time = 2.6, 2.9, 3.4
    for with_kv, computed in ((True, 4), (False, 0)):
        c = moved_request(req, with_kv)
        assert c is not req and c.output_token_ids == [7, 8] and c.output_token_ids is not req.output_token_ids
        assert (c.arrival_time, c.priority, c.request_class, c.num_preemptions) == (2.5, -1, RequestClass.OFFLINE, 2)
        assert (c.first_scheduled_time, c.first_token_time, c.last_token_time) == (2.6, 2.9, None)
        assert c.num_computed_tokens == computed


def test_lost_kv_recomputes_a_handoff_and_leaves_another_move_on_a_source_that_holds_it():
    m = move(MoveKind.HANDOFF)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.lost(0.2) == [Release(1), FreeSource(0), FailOver("its KV was lost on the way")]
    m = move(MoveKind.MIGRATE, dst=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    assert m.lost(0.2) == [Release(1), Resume(0)] and m.phase is Phase.STAYED
    m = move(MoveKind.MIGRATE, dst=1, chunks=1)
    m.start(0.0)
    m.reserved(1, 0.1)
    m.chunk_landed(0, 0.2)
    assert m.lost(0.3) == [] and m.phase is Phase.LANDED  # every chunk is in already
