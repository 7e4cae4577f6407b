"""What a scheduler's queue holds, as the monitor's reports carry it (a mixin of
:class:`tidal.core.scheduler.Scheduler`, reading its queues, KV manager and expected cache hits): the KV
blocks the waiting requests need, the head of the queue's, and the prompt tokens still to prefill with
their mean KV position (what a cache-aware router prices). The simulator and the runtime report the same."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class QueueReport:
    waiting: Any
    running: list[Any]
    swapped: Any
    kv: Any
    _expected_cached: dict[str, int]

    def queued_block_demand(self) -> int:
        """KV blocks the waiting requests need to start: each its tokens and the next one's slot
        (what the monitor's ``InstanceStatus`` reports, in the simulator and the runtime alike)."""
        bs = self.kv.block_size
        return sum(-(-(r.num_tokens + 1) // bs) for r in self.waiting)

    def _queued_prefills(self) -> Iterator[tuple[int, int]]:
        """(from, tokens) of each prefill still to compute: the waiting requests' past their computed or
        expected cached prefix, and the rest of the running ones' half-done prefills."""
        expected = self._expected_cached
        for r in self.waiting:
            cached = expected.get(r.request_id, 0) if not r.num_preemptions else 0
            yield r.num_computed_tokens + cached, r.num_uncomputed_tokens - cached
        for r in self.running:
            if r.in_prefill:
                yield r.num_computed_tokens, r.num_uncomputed_tokens

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting for their prefill (what a cache-aware router counts as work ahead of a
        new request)."""
        return sum(n for _, n in self._queued_prefills())

    def queued_prefill_position(self) -> float:
        """The mean KV position of :meth:`queued_prefill_tokens`' tokens, so that a router can price the
        attention over long prompts' prefixes (KunServe Eq. 1's prefix and self terms); 0.0 when nothing
        is queued."""
        tokens = total = 0.0
        for start, n in self._queued_prefills():
            n = max(0, n)
            tokens, total = tokens + n, total + n * (start + n / 2)
        return total / tokens if tokens > 0 else 0.0

    def hol_block_demand(self) -> int:
        """KV blocks the head of the queue needs: the first swapped request's host blocks (it
        comes back first), else the first waiting one's tokens and next slot; 0 for none."""
        if self.swapped:
            return self.kv.num_host_blocks_of(self.swapped[0].request_id)
        return -(-(self.waiting[0].num_tokens + 1) // self.kv.block_size) if self.waiting else 0


__all__ = ["QueueReport"]
