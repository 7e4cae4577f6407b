"""The ``migrate`` baseline: Llumnix-like KV migration under throttling (pure).

KunServe Sec. 2.3 (Fig. 3c): Llumnix [41] "migrates requests from a memory-throttled GPU to
other (relatively) spare GPUs" with their KV, so the head of the throttled queue can start.
Here: for each throttled instance, largest shortage first, its running requests -- the
shortest first, the cheapest to move (Llumnix's choice) -- go one by one to the instance with
the most room (free blocks less its own queue's need, the admission watermark and what is
already migrating there) that is not throttled and can hold them, until the blocks leaving
cover what the head of its queue lacks. The executor moves the KV (the simulator charges
bytes over the link, the request stalls meanwhile) and frees the source's blocks on landing.

Given the requests' prompt block names (``names``: the cluster routes by cache, so the monitor keeps
each instance's cache view), tidal's extension (not Llumnix's rule, so the baselines never take it)
prefers the destination that holds the longest prefix of the request's prompt: it shares those blocks
(the import's reuse) and needs room only for the rest; among equal prefixes, the most room wins, so
with nothing cached anywhere the choice is Llumnix's (issue 52: move to where the prefix is).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tidal.cluster.monitor import GlobalMonitor
from tidal.cluster.pressure.events import PressureDecision, Recorder
from tidal.cluster.pressure.throttle import ThrottleDetector


@dataclass(frozen=True, slots=True)
class Migration:
    request_id: str
    src: int
    dst: int
    blocks: int  # KV blocks it holds
    shared: int = 0  # of them, those ``dst``'s prefix cache holds (it needs room for the rest)

    @property
    def dst_blocks(self) -> int:
        return self.blocks - self.shared


def plan_migrations(monitor: GlobalMonitor, running: Mapping[int, Sequence[tuple[str, int]]],
                    leaving: Mapping[int, int] | None = None, incoming: Mapping[int, int] | None = None,
                    detector: ThrottleDetector | None = None,
                    destinations: Collection[int] | None = None,
                    names: Mapping[str, Sequence[bytes]] | None = None) -> list[Migration]:
    """``running``: per instance its running requests that may move, as (id, blocks held);
    ``leaving`` / ``incoming``: blocks already migrating out of / into each instance;
    ``destinations``: the instances a request may go to (None: any that takes requests);
    ``names``: a request's prompt block names, to prefer where its prefix is cached."""
    detector = detector or ThrottleDetector()
    leaving, incoming = dict(leaving or {}), dict(incoming or {})
    throttled = detector.scan(monitor)
    hot = {t.index for t in throttled}
    room = {r.index: r.status.num_free_blocks - r.status.queued_block_demand - detector.reserve(r.status.num_blocks)
            - incoming.get(r.index, 0) for r in monitor.routable()
            if r.index not in hot and (destinations is None or r.index in destinations)}
    out: list[Migration] = []
    for t in throttled:
        need = t.hol_blocks - (t.free_blocks - t.reserve_blocks) - leaving.get(t.index, 0)
        for rid, blocks in sorted(running.get(t.index, ()), key=lambda rb: (rb[1], rb[0])):
            if need <= 0 or not room:
                break
            mine = names.get(rid, ()) if names else ()
            shared = {i: min(monitor.instances[i].cache.prefix(mine), blocks - 1) if mine else 0 for i in room}
            fits = [i for i in room if room[i] >= blocks - shared[i]]
            if not fits:
                continue
            dst = max(fits, key=lambda i: (shared[i], room[i], -i))
            room[dst] -= blocks - shared[dst]
            need -= blocks
            leaving[t.index] = leaving.get(t.index, 0) + blocks
            out.append(Migration(rid, t.index, dst, blocks, shared[dst]))
    return out


class MigrationController:
    """:func:`plan_migrations` over a monitor, with its decisions recorded."""

    def __init__(self, monitor: GlobalMonitor, detector: ThrottleDetector | None = None,
                 recorder: Recorder | None = None):
        self.monitor, self.detector, self.recorder = monitor, detector or ThrottleDetector(), recorder

    def decide(self, now: float, running: Mapping[int, Sequence[tuple[str, int]]],
               leaving: Mapping[int, int] | None = None, incoming: Mapping[int, int] | None = None,
               destinations: Collection[int] | None = None,
               names: Mapping[str, Sequence[bytes]] | None = None) -> list[Migration]:
        moves = plan_migrations(self.monitor, running, leaving, incoming, self.detector, destinations, names)
        if self.recorder is not None:
            for m in moves:
                self.recorder(PressureDecision("migrate", now, (m.src, m.dst),
                                               {"request_id": m.request_id, "blocks": m.blocks, "shared": m.shared}))
        return moves


__all__ = ["Migration", "MigrationController", "plan_migrations"]
