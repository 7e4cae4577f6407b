"""Where KV lives: the front end's view of which block names each instance holds (pure).

An instance's KV manager logs the names its pools gain and lose (:mod:`tidal.core.block_pool`);
its step reports carry them as a :class:`CacheDelta` (exact, not a guess), and the monitor applies
them to that instance's :class:`CacheView`. A front end that gets no such reports keeps an
approximate view instead: the names of the prompts it routed there, in an LRU of the instance's
capacity (what SGLang's router keeps in its approximate radix trees). Routers ask a view how much
of a request's prefix the instance holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tidal.core.block_pool import CacheDelta, net

Name = bytes


class CacheView:
    """The names one instance holds, on its device pool and in its host tier."""

    def __init__(self, approx_capacity: int | None = None):
        self.device: set[Name] = set()
        self.host: set[Name] = set()
        # approximate mode: the routed prompts' names, least recently routed first, at most this many
        self.approx_capacity = approx_capacity
        self._approx: OrderedDict[Name, None] = OrderedDict()

    def apply(self, d: CacheDelta) -> None:
        """An instance's report (exact mode)."""
        if d.reset:
            self.device.clear()
            self.host.clear()
        self.device.difference_update(d.evicted)
        self.device.update(d.stored)
        self.host.difference_update(d.host_evicted)
        self.host.update(d.host_stored)

    def note_routed(self, names: Sequence[Name]) -> None:
        """A request routed here (approximate mode): its prompt's blocks will be cached here."""
        if self.approx_capacity is None:
            return
        for n in names:
            if n in self._approx:
                self._approx.move_to_end(n)
            else:
                self._approx[n] = None
        while len(self._approx) > self.approx_capacity:
            self._approx.popitem(last=False)

    def clear(self) -> None:
        """The instance died or restarted: it holds nothing."""
        self.device.clear()
        self.host.clear()
        self._approx.clear()

    def __contains__(self, name: Name) -> bool:
        return name in self.device or name in self.host or name in self._approx

    def prefix(self, names: Sequence[Name]) -> int:
        """How many leading blocks of ``names`` the instance holds (pool or host tier)."""
        k = 0
        for n in names:
            if n not in self:
                break
            k += 1
        return k

    def __len__(self) -> int:
        return len(self.device | self.host) if self.approx_capacity is None else len(self._approx)


__all__ = ["CacheDelta", "CacheView", "net"]
