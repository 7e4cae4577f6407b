"""Memory throttling, seen by the global monitor (pure).

KunServe Sec. 2.2 / 3: an instance is *throttled* when requests queue for KV memory. Its KV
demand is counted the way Llumnix [41] counts it: the blocks of the requests in flight (used)
plus the blocks the head-of-line queued request needs to start (``hol_block_demand`` in
:class:`tidal.cluster.monitor.InstanceStatus`). When that exceeds the pool -- the head of the
queue does not fit in the free blocks, less the scheduler's admission watermark -- the queue
waits for memory, not for compute. A request that waits only for the token budget or
``max_num_seqs`` does not throttle.

A pipeline group (Sec. 4.1) is seen through its first stage, whose status is the group's pool
(in blocks of all layers), so a group is throttled or not as one instance is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.cluster.monitor import GlobalMonitor, InstanceRecord

ADMISSION_WATERMARK = 0.01  # tidal.core.scheduler.Scheduler's default: blocks kept free on admission


@dataclass(frozen=True, slots=True)
class Throttle:
    """One throttled instance (or group, by its first stage) as the monitor saw it."""

    index: int
    members: tuple[int, ...]  # the group it heads, in stage order ((index,) when alone)
    num_blocks: int
    free_blocks: int
    hol_blocks: int  # the head of the queue's need
    queued_blocks: int  # every queued request's need
    reserve_blocks: int  # the admission watermark

    @property
    def demand_blocks(self) -> int:
        """Llumnix's count: in flight (used) plus the head of the queue."""
        return self.num_blocks - self.free_blocks + self.hol_blocks

    @property
    def shortage_blocks(self) -> int:
        """Blocks the whole queue lacks: what must be freed so every queued request can start (Sec. 4.1's R)."""
        return max(self.queued_blocks, self.hol_blocks) - (self.free_blocks - self.reserve_blocks)


class ThrottleDetector:
    """``watermark``: the fraction of blocks the scheduler keeps free when admitting."""

    def __init__(self, watermark: float = ADMISSION_WATERMARK):
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = watermark

    def reserve(self, num_blocks: int) -> int:
        return int(self.watermark * num_blocks)

    def check(self, rec: InstanceRecord) -> Throttle | None:
        """The record's throttle, or None when its head of line fits (or nothing queues)."""
        st = rec.status
        hol = getattr(st, "hol_block_demand", 0)
        reserve = self.reserve(st.num_blocks)
        if hol <= 0 or hol <= st.num_free_blocks - reserve:
            return None
        return Throttle(rec.index, rec.group or (rec.index,), st.num_blocks, st.num_free_blocks, hol,
                        st.queued_block_demand, reserve)

    def scan(self, monitor: GlobalMonitor) -> list[Throttle]:
        """Every throttled instance or group that takes requests, the largest shortage first."""
        found = [t for r in monitor.routable() if (t := self.check(r)) is not None]
        return sorted(found, key=lambda t: (-t.shortage_blocks, t.index))


def demand_bytes(throttles: list[Throttle], block_bytes: int) -> int:
    """Sec. 4.1: "we first compute the memory demand of all queuing requests (R)": the blocks
    the throttled instances' queues lack, in bytes of KV (``block_bytes``: one block, all layers)."""
    return sum(max(0, t.shortage_blocks) for t in throttles) * block_bytes


__all__ = ["ADMISSION_WATERMARK", "Throttle", "ThrottleDetector", "demand_bytes"]
