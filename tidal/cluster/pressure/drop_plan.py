"""KunServe's drop plan (Sec. 4.1, Fig. 6) and the KV moves a layout change implies (pure).

Every instance starts as a pipeline group of one holding all ``L`` decoder layers. Upon
throttling, the planner frees ``R`` bytes (the queued requests' shortage) by merging groups:

    freed = 0; Q = min-heap of the groups by size
    while |Q| >= 2 and freed < R:
        g0, g1 = pop, pop; new = merge(g0, g1); freed += size(L_g0 & L_g1); push(new)

Each of the two groups holds one full copy of the layers, so a merge frees one copy: the new
group of ``n = k0 + k1`` members holds ``L / n`` contiguous layers per member (a pipeline stage),
and for two groups of equal size each member keeps half of the layers it held -- "they will
drop half of the redundant parameters each" (GPU0 drops the second half and GPU1 the first,
Fig. 3d). Groups with fewer instances go first, so as few instances as possible share a
pipeline (Fig. 5: the more stages, the slower). ``O(N log N)`` for N instances.

Our choices where the paper leaves them open (the pop order among groups of equal size):

- ``g0`` is the group of the smallest size with the largest KV shortage (a throttled one);
- ``g1`` is, among the smallest remaining groups, the one with the most headroom (free KV
  less its queue), so a throttled instance pairs with a spare one;
- the new group's stage order sorts the members by the middle of the layers they held, and
  stage ``j`` of ``n`` keeps layers ``[j L // n, (j+1) L // n)``: every member keeps a part of
  what it held (nothing is loaded) whenever the sizes allow, and the stages are contiguous in
  pipeline order;
- only decoder layers are dropped: every instance keeps its embedding and LM head, so it can
  run alone again after a restore or a peer's failure without loading them (Sec. 4.4).

A plan that cannot cover ``R`` (a group would need more stages than layers, or one group is
left) is returned when it frees something (``satisfied`` False: the autoscale signal's case),
unless ``allow_partial`` is off; None when nothing can be merged.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Layers = tuple[int, int]  # [start, end) of contiguous decoder layers


@dataclass(frozen=True)
class ModelMemory:
    """What the planner needs of the model: its decoder layers' count and weight bytes, and the
    KV bytes of one token over all layers (all tensor-parallel shards of an instance)."""

    num_layers: int
    layer_bytes: int
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.layer_bytes <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("a model needs >= 1 layer and positive layer and KV sizes")

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def kv_bytes_per_token_layer(self) -> float:
        return self.kv_bytes_per_token / self.num_layers


def _len(r: Layers) -> int:
    return r[1] - r[0]


def _overlap(a: Layers, b: Layers) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _minus(a: Layers, b: Layers) -> list[Layers]:
    """The parts of ``a`` outside ``b``."""
    return [r for r in ((a[0], min(a[1], b[0])), (max(a[0], b[1]), a[1])) if r[0] < r[1]]


def stage_layers(num_layers: int, n: int) -> list[Layers]:
    """``n`` contiguous stages over ``num_layers`` layers, as even as integers allow."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {n} stages")
    return [(j * num_layers // n, (j + 1) * num_layers // n) for j in range(n)]


@dataclass(frozen=True, slots=True)
class Merge:
    """One iteration of Fig. 6: ``left`` and ``right`` became ``group`` (stage order)."""

    left: tuple[int, ...]
    right: tuple[int, ...]
    group: tuple[int, ...]
    freed_bytes: int


@dataclass(frozen=True)
class DropPlan:
    """A new group assignment. ``groups``: every group afterwards, in stage order (groups of one
    included); ``layers``: each instance's kept layers; ``freed_bytes`` / ``load_bytes``: the
    weights each instance drops / must fetch (normally none) to get there."""

    groups: tuple[tuple[int, ...], ...]
    layers: dict[int, Layers]
    freed_bytes: dict[int, int]
    load_bytes: dict[int, int]
    merges: tuple[Merge, ...]
    demand_bytes: int
    previous_layers: dict[int, Layers] = field(default_factory=dict)

    @property
    def freed_total(self) -> int:
        return sum(self.freed_bytes.values()) - sum(self.load_bytes.values())

    @property
    def satisfied(self) -> bool:
        return self.freed_total >= self.demand_bytes

    @property
    def changed(self) -> tuple[tuple[int, ...], ...]:
        """The groups this plan formed (each executes as one pipeline from now on)."""
        formed = {m.group for m in self.merges}
        return tuple(g for g in self.groups if g in formed)

    def group_of(self, index: int) -> tuple[int, ...]:
        return next(g for g in self.groups if index in g)

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [list(g) for g in self.changed], "layers": {i: list(self.layers[i]) for g in self.changed
                                                                       for i in g},
                "freed_bytes": self.freed_total, "demand_bytes": self.demand_bytes, "satisfied": self.satisfied,
                "merges": len(self.merges)}


def merge_layout(left: Sequence[int], right: Sequence[int], layers: Mapping[int, Layers],
                 num_layers: int) -> tuple[tuple[int, ...], dict[int, Layers]]:
    """The merged group's stage order and each member's new layers (see the module's notes)."""
    members = [*left, *right]
    n = len(members)
    order = sorted(range(n), key=lambda k: (layers[members[k]][0] + layers[members[k]][1], k))
    group = tuple(members[k] for k in order)
    return group, dict(zip(group, stage_layers(num_layers, n), strict=True))


class DropPlanner:
    """Fig. 6 over a model's layers; ``allow_partial``: return a plan that frees less than asked."""

    def __init__(self, model: ModelMemory, allow_partial: bool = True):
        self.model = model
        self.allow_partial = allow_partial

    def plan(self, groups: Sequence[Sequence[int]], layers: Mapping[int, Layers], demand_bytes: int,
             shortage: Mapping[int, int] | None = None, headroom: Mapping[int, int] | None = None
             ) -> DropPlan | None:
        """``groups``: the current assignment (stage order, every instance in one); ``layers``:
        each instance's layers; ``shortage`` / ``headroom`` (blocks, per instance; a group's is
        its members' sum) only order groups of equal size."""
        if demand_bytes <= 0:
            return None
        L, lb = self.model.num_layers, self.model.layer_bytes
        shortage, headroom = shortage or {}, headroom or {}
        live: dict[int, tuple[int, ...]] = {}  # group id -> members
        score: dict[int, tuple[int, int]] = {}  # group id -> (shortage, headroom)
        by_need: list[tuple[int, int, int, int]] = []  # (size, -shortage, first member, id)
        by_room: list[tuple[int, int, int, int]] = []  # (size, -headroom, first member, id)

        def push(members: tuple[int, ...], s: int, h: int) -> None:
            gid = len(score)
            live[gid], score[gid] = members, (s, h)
            heapq.heappush(by_need, (len(members), -s, min(members), gid))
            heapq.heappush(by_room, (len(members), -h, min(members), gid))

        def pop(heap: list[tuple[int, int, int, int]]) -> int | None:
            while heap:
                gid = heapq.heappop(heap)[3]
                if gid in live:
                    return gid
            return None

        for g in groups:
            g = tuple(g)
            push(g, sum(shortage.get(i, 0) for i in g), sum(headroom.get(i, 0) for i in g))
        now = {i: tuple(layers[i]) for g in groups for i in g}
        merges: list[Merge] = []
        freed = 0
        while len(live) >= 2 and freed < demand_bytes:
            g0 = pop(by_need)
            assert g0 is not None
            m0 = live.pop(g0)
            g1 = pop(by_room)
            assert g1 is not None
            m1 = live.pop(g1)
            if len(m0) + len(m1) > L:  # the smallest pair cannot split the layers further: no other can
                live[g0], live[g1] = m0, m1
                break
            group, new = merge_layout(m0, m1, now, L)
            dup = sum(_len(now[i]) for i in group) - L  # size(L_g0 & L_g1): one full copy
            now.update(new)
            freed += dup * lb
            merges.append(Merge(m0, m1, group, dup * lb))
            push(group, score[g0][0] + score[g1][0], score[g0][1] + score[g1][1])
        if not merges or (freed < demand_bytes and not self.allow_partial):
            return None
        before = {i: tuple(layers[i]) for i in now}
        freed_b = {i: (_len(before[i]) - _overlap(before[i], now[i])) * lb for i in now}
        load_b = {i: (_len(now[i]) - _overlap(before[i], now[i])) * lb for i in now}
        final = tuple(sorted(live.values(), key=min))
        return DropPlan(final, now, {i: b for i, b in freed_b.items() if b},
                        {i: b for i, b in load_b.items() if b}, tuple(merges), demand_bytes, before)


@dataclass(frozen=True, slots=True)
class KVMove:
    """Layers ``layers`` of a request's KV go from instance ``src`` to ``dst`` (Sec. 4.2)."""

    src: int
    dst: int
    layers: Layers


def kv_moves(before: Mapping[int, Layers], after: Mapping[int, Layers]) -> list[KVMove]:
    """How a request's KV must move when the layers its instances hold change from ``before``
    (instance -> the layers it held of this request's KV) to ``after`` (instance -> the layers
    it will compute for it): each instance receives the layers it will need and lacks, from
    the instance that held them. A drop (Sec. 4.2's exchange) and a restore (gathering the KV
    on the request's new home) are both this."""
    moves = []
    for dst, want in sorted(after.items()):
        have = before.get(dst)
        need = [want] if have is None else _minus(want, have)
        for src, held in sorted(before.items()):
            if src == dst:
                continue
            for seg in need:
                lo, hi = max(seg[0], held[0]), min(seg[1], held[1])
                if lo < hi:
                    moves.append(KVMove(src, dst, (lo, hi)))
    return moves


__all__ = ["DropPlan", "DropPlanner", "KVMove", "Layers", "Merge", "ModelMemory", "kv_moves", "merge_layout",
           "stage_layers"]
