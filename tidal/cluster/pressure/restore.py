"""Restoring dropped layers, and the autoscale signal (KunServe Sec. 4.4) (pure).

- :class:`RestorePolicy`: "when the monitor detects that the total KVCache usage is below a
  threshold ... below 50% of the GPU (without drop)", a group loads its dropped layers back and
  its members run alone again. We apply it per group, and count the group's queued demand with
  its usage (Llumnix's count, as the throttle does), so a restore never throttles at once.
- :func:`restore_plan`: what each member loads (the layers it lacks, pulled from the peers over
  the network) and :func:`assign_homes`: which member each of the group's requests runs on
  afterwards (largest first onto the member with the most room).
- :class:`AutoscaleSignal`: "we autoscale ... when we detect a continuous increase in the
  memory usage after the drop". After a drop it watches the cluster's KV usage; it fires once
  (until the next drop or restore) when the usage rose by ``min_rise`` over the last
  ``window_s`` seconds, never falling in between, to at least ``high``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tidal.cluster.pressure.drop_plan import Layers, ModelMemory

RESTORE_THRESHOLD = 0.5  # Sec. 4.4: "below 50% of the GPU (without drop)"


@dataclass(frozen=True)
class RestorePolicy:
    threshold: float = RESTORE_THRESHOLD

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"restore threshold must be in (0, 1], got {self.threshold}")

    def should_restore(self, used_blocks: int, queued_blocks: int, undropped_blocks: int) -> bool:
        """A group restores when its KV in use plus its queue's need is below ``threshold`` of what
        its members' pools hold without any drop (blocks of all layers)."""
        return undropped_blocks > 0 and used_blocks + queued_blocks < self.threshold * undropped_blocks


@dataclass(frozen=True)
class RestorePlan:
    """Group ``group`` splits: every member holds all layers again after loading ``load_bytes``."""

    group: tuple[int, ...]
    layers: dict[int, Layers]  # each member's layers afterwards (all of them)
    load_bytes: dict[int, int]  # weights each member fetches

    def to_dict(self) -> dict:
        return {"group": list(self.group), "load_bytes": sum(self.load_bytes.values())}


def restore_plan(group: Sequence[int], layers: Mapping[int, Layers], model: ModelMemory) -> RestorePlan:
    full = (0, model.num_layers)
    load = {i: (model.num_layers - (layers[i][1] - layers[i][0])) * model.layer_bytes for i in group}
    return RestorePlan(tuple(group), {i: full for i in group}, load)


def assign_homes(needs: Sequence[tuple[str, int]], capacity: Mapping[int, int]) -> dict[str, int] | None:
    """Each request (id, KV blocks it holds) onto a member with room, largest first onto the
    member with the most room left (ties: the lower index); None when one does not fit."""
    room = dict(capacity)
    out: dict[str, int] = {}
    for rid, blocks in sorted(needs, key=lambda n: (-n[1], n[0])):
        best = max(room, key=lambda i: (room[i], -i))
        if room[best] < blocks:
            return None
        room[best] -= blocks
        out[rid] = best
    return out


class AutoscaleSignal:
    """Fires when KV usage keeps rising after a drop (see the module's notes)."""

    def __init__(self, window_s: float = 10.0, min_rise: float = 0.05, high: float = 0.8):
        if window_s <= 0 or min_rise <= 0 or not 0 < high <= 1:
            raise ValueError("autoscale needs window_s > 0, min_rise > 0 and high in (0, 1]")
        self.window_s, self.min_rise, self.high = window_s, min_rise, high
        self.armed = False
        self.fired = False
        self._samples: deque[tuple[float, float]] = deque()

    def on_drop(self, now: float) -> None:
        self.armed, self.fired = True, False
        self._samples.clear()

    def on_restore(self) -> None:
        self.armed = False
        self._samples.clear()

    def observe(self, now: float, usage: float) -> bool:
        """One usage sample (fraction of the KV the cluster holds now); True the first time the
        rise is seen after a drop."""
        if not self.armed or self.fired:
            return False
        s = self._samples
        if s and usage < s[-1][1]:  # a fall breaks the "continuous increase"
            s.clear()
        s.append((now, usage))
        while len(s) > 1 and s[1][0] <= now - self.window_s:
            s.popleft()
        t0, u0 = s[0]
        if now - t0 >= self.window_s and usage - u0 >= self.min_rise and usage >= self.high:
            self.fired = True
            return True
        return False


__all__ = ["RESTORE_THRESHOLD", "AutoscaleSignal", "RestorePlan", "RestorePolicy", "assign_homes", "restore_plan"]
