"""A group head hands its stages the exchange's queued KV chunks up to a byte budget a loop turn
(Sec. 4.2), not one chunk a turn: the exchange is not paced by the group's steps."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from tidal.runtime import group as G


class Link:
    def __init__(self):
        self.sent = []

    def recv(self, timeout):
        return None

    def send(self, msg):
        self.sent.append(msg)


def _head(chunks):
    head = object.__new__(G.GroupHead)
    head.links = {1: Link(), 2: Link()}
    head.queue = deque(chunks)
    head.restoring, head.moves, head.reported = None, {"r0": object()}, False  # a move still open: no ExchangeDone
    head.engine = SimpleNamespace(transfer=SimpleNamespace(block_table=lambda rid: [0, 1]))
    return head


def _chunk(member, rid, nbytes, last=False):
    return (member, rid, SimpleNamespace(nbytes=nbytes), last)


def test_a_turn_sends_every_queued_chunk_within_the_budget():
    head = _head([_chunk(1 + k % 2, f"r{k // 4}", 1 << 20, k % 4 == 3) for k in range(40)])  # 40 MiB-sized chunks
    head.pump()
    per_turn = G.EXCHANGE_TURN_BYTES // (1 << 20)
    assert len(head.links[1].sent) + len(head.links[2].sent) == per_turn and len(head.queue) == 40 - per_turn
    assert all(m[0] == "kv" and m[2] == [0, 1] for m in head.links[1].sent)
    head.pump()
    assert not head.queue  # two turns, not forty


def test_a_chunk_over_the_budget_still_goes_alone():
    head = _head([_chunk(1, "r0", 2 * G.EXCHANGE_TURN_BYTES), _chunk(2, "r0", 10, True)])
    head.pump()
    assert len(head.links[1].sent) == 1 and len(head.queue) == 1
    head.pump()
    assert len(head.links[2].sent) == 1 and not head.queue
