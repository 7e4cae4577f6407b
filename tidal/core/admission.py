"""The server's queue bound (``--max-queued-requests``): how many requests are a backlog.

The bound limits the *backlog*, the requests that cannot start at the next step, not the batch.
A request on its way to admission (submitted by the HTTP side, not yet seen by a scheduling
step) is not waiting: the next step starts it if the instance has a free slot. So for one
instance, from its latest snapshot:

- ``declined``: requests a step has already seen and left waiting (no slot, no KV, or behind
  others). When there are any, every newer request queues behind them (admission is in order).
- ``untried``: requests submitted since the last step (added, or still on their way).
- ``cap`` and ``running``: the cap on running requests the scheduler last used, and how many run.

backlog = declined + untried                     when declined > 0
        = max(0, untried - max(0, cap - running)) otherwise

A new request is refused when, counting it, the backlog would exceed the bound. Decision code: no
threads or I/O here; :class:`tidal.engine.async_engine.AsyncLLM` and the cluster front end feed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    cap: int  # most requests that may run at once (the scheduler's last cap)
    running: int
    declined: int  # seen by a step and left waiting (or swapped out)
    untried: int  # submitted since the last step: added, or on their way


def backlog(load: InstanceLoad) -> int:
    """Requests of ``load`` that will not start at its next step."""
    if load.declined > 0:
        return load.declined + load.untried
    return max(0, load.untried - max(0, load.cap - load.running))


def has_room(load: InstanceLoad) -> bool:
    """One more request would start at the next step."""
    return load.declined == 0 and load.running + load.untried < load.cap


def admit(loads: Sequence[InstanceLoad], max_queued: int | None, extra_backlog: int = 0,
          entry: Sequence[InstanceLoad] | None = None) -> bool:
    """May one more request be accepted? ``loads``: every live instance; ``entry``: those a new
    request may be sent to (default: all); ``extra_backlog``: requests waiting outside any instance
    (e.g. prefilled requests waiting for room on a decode instance)."""
    if max_queued is None:
        return True
    queued = sum(backlog(x) for x in loads) + extra_backlog
    new_waits = not any(has_room(x) for x in (loads if entry is None else entry))
    return queued + new_waits <= max_queued


__all__ = ["InstanceLoad", "admit", "backlog", "has_room"]
