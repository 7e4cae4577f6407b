"""The queue bound's arithmetic (tidal.core.admission), worked by hand."""

from __future__ import annotations

from tidal.core.admission import InstanceLoad, admit, backlog, has_room


def test_requests_on_their_way_fill_free_slots_first():
    idle = InstanceLoad(cap=64, running=0, declined=0, untried=16)
    assert backlog(idle) == 0 and has_room(idle) and admit([idle], 8)
    full = InstanceLoad(cap=64, running=60, declined=0, untried=10)
    assert backlog(full) == 6 and not has_room(full)
    assert admit([full], 7) and not admit([full], 6)  # counting the new one: 7 would wait


def test_declined_requests_put_every_newer_one_behind_them():
    load = InstanceLoad(cap=64, running=3, declined=2, untried=1)  # e.g. out of KV blocks
    assert backlog(load) == 3 and not has_room(load)
    assert admit([load], 4) and not admit([load], 3)


def test_one_running_slot_and_a_bound_of_two():
    """The small test server: --max-num-seqs 1 --max-queued-requests 2 takes 1 + 2 requests."""
    accepted = 0
    for _ in range(10):
        if admit([InstanceLoad(1, 0, 0, accepted)], 2):
            accepted += 1
    assert accepted == 3


def test_unbounded_extra_backlog_and_entry_instances():
    a, b = InstanceLoad(4, 4, 0, 0), InstanceLoad(4, 0, 0, 0)
    assert admit([a], None)
    assert admit([a, b], 0)  # b has room
    assert not admit([a, b], 0, entry=[a])  # but new requests cannot go to b
    assert admit([a, b], 2, extra_backlog=1) and not admit([a, b], 1, extra_backlog=1, entry=[a])
