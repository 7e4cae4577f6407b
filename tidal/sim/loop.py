"""The discrete-event loop: a heap of timed events; firing an event returns new events.

Ties are broken deterministically: by time, then by the event's ``priority`` (lower first),
then by insertion order. A run is therefore a pure function of its inputs. Pure: the clock
is virtual (``loop.now``); nothing here reads the wall clock or starts a thread.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable


class Event:
    """Something that happens at ``time``. Subclasses implement :meth:`fire`."""

    __slots__ = ("time",)
    priority = 0  # at equal times, lower fires first

    def __init__(self, time: float):
        self.time = time

    def fire(self, loop: EventLoop) -> Event | Iterable[Event] | None:
        """Do what happens now; return the events it causes (one, several, or None)."""
        raise NotImplementedError


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.now = 0.0
        self.num_fired = 0

    def push(self, event: Event) -> None:
        if event.time < self.now:
            raise ValueError(f"event {type(event).__name__} at t={event.time} is in the past (now={self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (event.time, event.priority, self._seq, event))

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, progress: Callable[[float], None] | None = None,
            progress_every: int = 4096) -> None:
        """Fire events in order until none is left (or the next one is after ``until``)."""
        heap, push = self._heap, self.push
        while heap:
            if until is not None and heap[0][0] > until:
                break
            time, _, _, event = heapq.heappop(heap)
            self.now = time
            new = event.fire(self)
            if new is not None:
                if isinstance(new, Event):
                    push(new)
                else:
                    for ev in new:
                        push(ev)
            self.num_fired += 1
            if progress is not None and self.num_fired % progress_every == 0:
                progress(time)
        if progress is not None:
            progress(self.now)
