"""The waiting queue of one instance: requests in queue order, and whether that order is already
the baseline's admission order (priority, then arrival).

Pure bookkeeping, so that a step with a long queue costs no sort: new requests join at the tail
and a preempted one at the head; the queue counts the adjacent pairs out of (priority, arrival)
order, and while there are none the FCFS order is the queue itself. A stable sort of an ordered
list leaves it as it is, so the order handed out is exactly ``sorted(queue, key=(priority,
arrival))`` either way.
"""

from __future__ import annotations

from collections.abc import Iterator

from tidal.core.policy import fcfs_key as _key
from tidal.core.request import Request


class WaitingQueue:
    """A list of requests with ``append`` (tail), ``appendleft`` (head) and ``remove``; it reads
    like a list (iteration, ``len``, ``in``, indexing)."""

    __slots__ = ("_items", "_descents")

    def __init__(self) -> None:
        self._items: list[Request] = []
        self._descents = 0  # adjacent pairs (a, b) with key(a) > key(b)

    # ---------------------------------------------------------------- changes
    def append(self, req: Request) -> None:
        items = self._items
        if items and _key(items[-1]) > _key(req):
            self._descents += 1
        items.append(req)

    def appendleft(self, req: Request) -> None:
        items = self._items
        if items and _key(req) > _key(items[0]):
            self._descents += 1
        items.insert(0, req)

    def remove(self, req: Request) -> None:
        items = self._items
        i = items.index(req)  # identity first (requests compare by identity)
        if self._descents:
            prev = items[i - 1] if i > 0 else None
            nxt = items[i + 1] if i + 1 < len(items) else None
            k = _key(req)
            if prev is not None and _key(prev) > k:
                self._descents -= 1
            if nxt is not None and k > _key(nxt):
                self._descents -= 1
            if prev is not None and nxt is not None and _key(prev) > _key(nxt):
                self._descents += 1
        del items[i]

    # ---------------------------------------------------------------- reading
    @property
    def in_fcfs_order(self) -> bool:
        """True when the queue order is already (priority, arrival) order."""
        return self._descents == 0

    def snapshot(self) -> tuple[Request, ...]:
        return tuple(self._items)

    def fcfs(self, snapshot: tuple[Request, ...] | None = None) -> tuple[Request, ...] | list[Request]:
        """The baseline admission order (lower priority first, then earlier arrival), sorted only
        when the queue is out of that order. ``snapshot``: this queue's current snapshot, reused."""
        items = snapshot if snapshot is not None else tuple(self._items)
        return items if self._descents == 0 else sorted(items, key=_key)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __contains__(self, req: object) -> bool:
        return req in self._items

    def __repr__(self) -> str:
        return f"WaitingQueue({[r.request_id for r in self._items]!r})"
