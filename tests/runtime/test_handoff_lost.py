"""The front end's answer to a destination that could not read a hand-off's KV (``Refused`` with
``kv_lost``): the request is recomputed from its prompt and streamed tokens, never handed the same
unreadable chunks again (which looped, refusal after refusal); a refusal for lack of room still
waits for an instance with room."""

from __future__ import annotations

import asyncio

from tidal.core.sampling import SamplingParams
from tidal.runtime import protocol as P
from tidal.runtime.handoffs import HandoffFront
from tidal.runtime.records import Handoff, Tracked


class _Monitor:
    def __init__(self) -> None:
        self.handoffs: list[tuple] = []

    def on_handoff(self, rid, src, dst, ok) -> None:
        self.handoffs.append((rid, src, dst, ok))


class _Front(HandoffFront):
    def __init__(self) -> None:
        self.monitor, self.pressure, self.split = _Monitor(), None, None
        self.recomputed: list[tuple[str, int]] = []

    def recompute(self, t, src, abort=True) -> None:
        self.recomputed.append((t.rid, src))


def _tracked() -> Tracked:
    loop = asyncio.new_event_loop()
    t = Tracked("a", [1, 2, 3], SamplingParams(max_tokens=4), 0, "online", loop, asyncio.Queue())
    t.handoff = Handoff(0, None, 1, 2, dst=1)
    loop.close()
    return t


def test_lost_kv_is_recomputed_and_no_room_waits():
    f = _Front()
    t = _tracked()
    f.by_wid = {t.wid: t}
    f._on_refused(1, P.Refused(t.wid, "KV chunk x cannot be read", kv_lost=True), 0.0)
    assert f.recomputed == [("a", 0)] and t.handoff.dst == 1  # (recompute drops the hand-off itself)

    t = _tracked()
    f.by_wid = {t.wid: t}
    f._on_refused(1, P.Refused(t.wid, "no room"), 0.0)
    assert f.recomputed == [("a", 0)]  # no new recompute
    assert t.handoff.dst is None and f.monitor.handoffs == [("a", 0, 1, False)]  # retried when room is reported
