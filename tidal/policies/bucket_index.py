"""BucketServe's buckets and admission groups over a waiting queue, kept up to date change by change.

:class:`BucketIndex` holds what ``bucket`` (tidal/policies/bucket.py) decides from the waiting
queue: Alg. 1's bucket layout, N_max over the queue in arrival order (Eq. 6), and the groups
(priority, class, bucket) in admission order with their members sorted. Re-deriving all of it
from the whole queue at every change costs O(waiting) Python work per step (``assign`` and
``adjust_buckets`` in bucket.py, then grouping and sorting every member); here each change costs
O(changed x log waiting) plus C-speed set and list work, and the answer is the same
(tests/policies/test_bucket_index.py replays random queues against the reference).

Ties (equal job keys, equal arrivals) go in queue order, as the reference's stable sorts do. The
queue is assumed to change the way the scheduler's ``WaitingQueue`` does: removals, and requests
joining at the head (a preempted one) or the tail (an arrival), so the requests that stay keep
their order and each one can carry a sequence number in queue order. A change of any other
shape (requests joining in the middle) is seen, and the index is rebuilt from the queue.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence

from tidal.core.request import Request, RequestClass

_FIRST = (float("-inf"),)  # sorts before any (key, seq) pair


class IndexedBucket:
    """One length range [low, up) and its members' sorted (bucket key S, seq) pairs."""

    __slots__ = ("low", "up", "keys")

    def __init__(self, low: int, up: int):
        self.low, self.up = low, up
        self.keys: list[tuple[int, int]] = []

    @property
    def mid(self) -> int:
        return (self.low + self.up) // 2

    def below_mid(self) -> int:
        """Members with S below the midpoint (Alg. 1's split test)."""
        return bisect_left(self.keys, (self.mid,))


class IndexedGroup:
    """The waiting requests of one (priority, class, bucket), sorted by (job key, seq)."""

    __slots__ = ("priority", "cls", "bucket", "keys", "members", "arrivals", "index")

    def __init__(self, priority: int, cls: int, bucket: IndexedBucket):
        self.priority, self.cls, self.bucket = priority, cls, bucket
        self.keys: list[tuple[tuple, int]] = []
        self.members: list[Request] = []  # parallel to keys
        self.arrivals: list[tuple[float, int]] = []  # sorted: [0] is the group's earliest arrival
        self.index = -1  # position in the admission order


class BucketIndex:
    """The waiting queue in buckets and groups. ``sync`` takes the queue as it is now; the
    results are ``n_max``, ``buckets``, ``ordered`` (groups in admission order) and the counts of
    splits and merges."""

    def __init__(self, l_max: int, theta: float, bucket_key: Callable[[Request], int],
                 job_key: Callable[[Request], tuple], mem_tokens: Callable[[Request], int],
                 n_max_of: Callable[[Sequence[int]], int | None]):
        self.l_max, self.theta = l_max, theta
        self._bucket_key, self._job_key, self._mem = bucket_key, job_key, mem_tokens
        self._n_max_of = n_max_of  # N_max from the memory S of the queue in arrival order (Eq. 6)
        self.buckets: list[IndexedBucket] = [IndexedBucket(0, l_max)]
        self._lows = [0]
        self._groups: dict[tuple[int, int, int], IndexedGroup] = {}
        # per member: (seq, job key, arrival, bucket key S, its group)
        self._entry: dict[Request, tuple[int, tuple, float, int, IndexedGroup]] = {}
        self._members: set[Request] = set()
        self._by_arrival: list[tuple[float, int]] = []  # (arrival, seq) of every member, sorted
        self._mem_by_arrival: list[int] = []  # memory S of each, parallel to _by_arrival
        self._head = self._tail = 0  # the next sequence numbers at the queue's head (down) and tail (up)
        self._synced = False
        self.n_max: int | None = None
        self.ordered: list[IndexedGroup] = []
        self.num_splits = self.num_merges = 0

    def __len__(self) -> int:
        return len(self._members)

    # ---------------------------------------------------------------- changes
    def sync(self, waiting: Sequence[Request]) -> bool:
        """Take the queue as it is now and run one round of AdjustBuckets (Alg. 1) when it or
        N_max changed; False when nothing changed."""
        now = set(waiting)
        gone, new = self._members - now, now - self._members
        for r in gone:
            self._remove(r)
        if new:
            self._add_in_queue_order(waiting, new)
        n_max = self._n_max_of(self._mem_by_arrival) if self._by_arrival else None
        if self._synced and not gone and not new and n_max == self.n_max:
            return False
        self._synced = True
        self.n_max = n_max
        if n_max is not None:
            self._adjust(n_max)
        self._order()
        return True

    def _add_in_queue_order(self, waiting: Sequence[Request], new: set[Request]) -> None:
        n = len(waiting)
        head = 0
        while head < n and waiting[head] in new:
            head += 1
        tail = n
        while tail > head and waiting[tail - 1] in new:
            tail -= 1
        if head + (n - tail) != len(new):  # some joined in the middle: start again from the queue
            self._rebuild(waiting)
            return
        first = self._head - head
        for i in range(head):
            self._add(waiting[i], first + i)
        self._head = first
        for i in range(tail, n):
            self._add(waiting[i], self._tail)
            self._tail += 1

    def _rebuild(self, waiting: Sequence[Request]) -> None:
        for r in list(self._members):
            self._remove(r)
        self._head = self._tail = 0
        for r in waiting:
            self._add(r, self._tail)
            self._tail += 1

    def _bucket_for(self, s: int) -> IndexedBucket:
        # low <= S < up (Alg. 1 lines 2-9); the layout covers [0, L_max), and S >= L_max goes last
        return self.buckets[max(0, bisect_right(self._lows, s) - 1)]

    def _add(self, r: Request, seq: int) -> None:
        s = self._bucket_key(r)
        group = self._group(r, s)
        jk = self._job_key(r)
        self._entry[r] = (seq, jk, r.arrival_time, s, group)
        self._members.add(r)
        self._place(r, seq, jk, s, group)
        i = bisect_left(self._by_arrival, (r.arrival_time, seq))
        self._by_arrival.insert(i, (r.arrival_time, seq))
        self._mem_by_arrival.insert(i, self._mem(r))

    def _place(self, r: Request, seq: int, jk: tuple, s: int, group: IndexedGroup) -> None:
        i = bisect_left(group.keys, (jk, seq))
        group.keys.insert(i, (jk, seq))
        group.members.insert(i, r)
        insort(group.arrivals, (r.arrival_time, seq))
        insort(group.bucket.keys, (s, seq))

    def _group(self, r: Request, s: int) -> IndexedGroup:
        """The group of ``r`` (bucket key ``s``) under the current layout, made when first needed."""
        cls = 0 if r.request_class is RequestClass.ONLINE else 1
        bucket = self._bucket_for(s)
        key = (r.priority, cls, bucket.low)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = IndexedGroup(r.priority, cls, bucket)
        return group

    def _remove(self, r: Request) -> None:
        seq, jk, arrival, s, group = self._entry.pop(r)
        self._members.discard(r)
        i = bisect_left(group.keys, (jk, seq))
        del group.keys[i], group.members[i]
        del group.arrivals[bisect_left(group.arrivals, (arrival, seq))]
        keys = group.bucket.keys
        del keys[bisect_left(keys, (s, seq))]
        if not group.keys:
            del self._groups[(group.priority, group.cls, group.bucket.low)]
        i = bisect_left(self._by_arrival, (arrival, seq))
        del self._by_arrival[i], self._mem_by_arrival[i]

    # ---------------------------------------------------------------- Alg. 1
    def _adjust(self, n_max: int) -> None:
        """One round of AdjustBuckets (Alg. 1 lines 10-29): merge everything into [0, L_max) when
        the total is below N_max; else split each bucket holding more than N_max members of which
        more than theta lie below its midpoint."""
        if len(self._members) < n_max:
            if len(self.buckets) > 1:
                self.num_merges += 1
                self._relayout([(0, self.l_max)])
            return
        bounds: list[tuple[int, int]] = []
        for b in self.buckets:
            n = len(b.keys)
            if n > n_max and b.below_mid() / n > self.theta and b.up - b.low >= 2:
                bounds += [(b.low, b.mid), (b.mid, b.up)]
            else:
                bounds.append((b.low, b.up))
        if len(bounds) > len(self.buckets):
            self.num_splits += len(bounds) - len(self.buckets)
            self._relayout(bounds)

    def _relayout(self, bounds: list[tuple[int, int]]) -> None:
        """New bucket bounds: every member is placed again (its seq and keys stay)."""
        self.buckets = [IndexedBucket(lo, up) for lo, up in bounds]
        self._lows = [lo for lo, _ in bounds]
        self._groups = {}
        for r, (seq, jk, arrival, s, _) in list(self._entry.items()):
            group = self._group(r, s)
            self._entry[r] = (seq, jk, arrival, s, group)
            self._place(r, seq, jk, s, group)

    def _order(self) -> None:
        """Groups: lower priority first, then online before offline, then the group holding the
        earliest arrival first, then the lower bucket."""
        index = {b.low: i for i, b in enumerate(self.buckets)}
        self.ordered = sorted(self._groups.values(),
                              key=lambda g: (g.priority, g.cls, g.arrivals[0][0], index[g.bucket.low]))
        for i, g in enumerate(self.ordered):
            g.index = i

    # ---------------------------------------------------------------- reading
    def group_index(self, r: Request) -> int | None:
        """The position of ``r``'s group in the admission order; None if ``r`` is not indexed."""
        entry = self._entry.get(r)
        return None if entry is None else entry[4].index

    def ranks(self) -> dict[Request, int]:
        """Each member's position in the admission order."""
        return {r: i for i, r in enumerate(r for g in self.ordered for r in g.members)}

    def layout(self) -> list[tuple[int, int, list[int]]]:
        """(low, up, the members' S) of each bucket."""
        return [(b.low, b.up, [s for s, _ in b.keys]) for b in self.buckets]
