"""``BucketIndex`` (the bucket policy's incremental buckets and groups) against the reference: the
whole queue re-bucketed at every change with Alg. 1's ``assign`` and ``adjust_buckets`` and the
groups sorted from scratch, on random queues that change the way the scheduler's queue does."""

from __future__ import annotations

import random

import pytest

from tests.policies.bucket_reference import adjust_buckets, assign
from tidal.core.policy import SchedulerView
from tidal.core.request import Request, RequestClass
from tidal.core.sampling import SamplingParams
from tidal.policies.bucket import BucketPolicy


class Reference:
    """The bucket policy's layout re-derived from the whole queue at every change."""

    def __init__(self, pol: BucketPolicy):
        self.pol = pol
        self.bounds = [(0, pol.l_max)]
        self.sig: tuple | None = None
        self.splits = self.merges = 0
        self.groups: list[list[str]] = []
        self.n_max: int | None = None

    def sync(self, waiting: list[Request]) -> bool:
        pol = self.pol
        n_max = pol._nmax(sorted(waiting, key=lambda r: r.arrival_time))  # stable: ties in queue order
        sig = (tuple(waiting), n_max)
        if self.sig is not None and sig == self.sig:
            return False
        self.sig, self.n_max = sig, n_max
        buckets = assign(self.bounds, waiting)
        if n_max is not None:
            before = len(buckets)
            buckets = adjust_buckets(buckets, n_max, pol.theta, pol.l_max)
            if len(buckets) > before:
                self.splits += len(buckets) - before
            elif len(buckets) < before:
                self.merges += 1
            # members in queue order (a merge concatenates the old buckets'): ties go in queue order
            buckets = assign([(b.low, b.up) for b in buckets], waiting)
        self.bounds = [(b.low, b.up) for b in buckets]
        groups: dict[tuple, list[Request]] = {}
        for bi, b in enumerate(buckets):
            for r in b.members:
                groups.setdefault((r.priority, 0 if r.request_class is RequestClass.ONLINE else 1, bi), []).append(r)
        for members in groups.values():
            members.sort(key=pol._job_key)
        ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], min(r.arrival_time for r in kv[1]),
                                                         kv[0][2]))
        self.groups = [[r.request_id for r in members] for _, members in ordered]
        self.layout = tuple((b.low, b.up, len(b.members)) for b in buckets)
        return True


def _view(waiting: list[Request], total_blocks: int) -> SchedulerView:
    return SchedulerView(now=0.0, running=(), waiting=tuple(waiting), num_free_blocks=total_blocks,
                         num_total_blocks=total_blocks, block_size=4, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("offline_order", ["sjf", "ljf", "fcfs"])
def test_the_index_gives_the_reference_layout_and_order(seed, offline_order):
    rng = random.Random(seed)
    pol = BucketPolicy(l_max=256, theta=rng.choice([0.3, 0.5]), offline_order=offline_order)
    ref = Reference(pol)
    waiting: list[Request] = []
    left: list[Request] = []  # admitted ones, which may come back at the head (a preemption)
    n = 0
    total_blocks = rng.choice([120, 160, 240])
    changed = splits = merges = 0
    for t in range(200):
        load = (t // 25) % 2 == 0  # load and drain in turns: the buckets split, then merge
        for _ in range(rng.choice([0, 1, 3, 12] if load else [0, 0, 1])):  # arrivals at the tail, often tied
            n += 1
            waiting.append(Request(f"r{n}", [1] * rng.randint(1, rng.choice([60, 300])), SamplingParams(max_tokens=rng.randint(1, 64)),
                                   arrival_time=float(n // 3 if rng.random() < 0.7 else rng.randint(0, n)),
                                   priority=rng.choice([0, 0, 0, 1]),
                                   request_class=rng.choice([RequestClass.ONLINE, RequestClass.OFFLINE])))
        if left and rng.random() < 0.2:  # one admitted at an earlier step is preempted: back at the head
            waiting.insert(0, left.pop(rng.randrange(len(left))))
        for _ in range(rng.choice([0, 1, 2] if load else [3, 8, 16])):  # admissions, from anywhere in the queue
            if waiting:
                left.append(waiting.pop(rng.randrange(len(waiting))))
        if rng.random() < 0.05:  # the pool resized (KunServe): N_max moves with no change of the queue
            total_blocks = rng.choice([120, 160, 240])
        pol.plan_step(_view(waiting, total_blocks))
        changed += ref.sync(waiting)
        st = pol.state()
        assert pol.n_max == ref.n_max
        assert st.buckets == ref.layout
        assert [[r.request_id for r in g] for g in pol.groups] == ref.groups
        assert [r.request_id for r in pol.order_waiting(pol._view_waiting, 0.0)] == [i for g in ref.groups for i in g]
        assert (st.num_splits, st.num_merges) == (ref.splits, ref.merges)
        splits, merges = ref.splits, ref.merges
    assert changed > 100  # the queue did change
    assert splits > 0 and merges > 0  # the layout moved both ways


def test_a_request_joining_mid_queue_rebuilds_in_queue_order():
    pol = BucketPolicy(l_max=64)
    ref = Reference(pol)
    reqs = [Request(f"r{i}", [1] * 10, SamplingParams(max_tokens=2), arrival_time=0.0) for i in range(6)]
    for waiting in (reqs[:2] + reqs[3:5], reqs[:5], [reqs[5]] + reqs[:5]):  # r2 joins in the middle, then r5 at the head
        pol.plan_step(_view(waiting, 100))
        ref.sync(waiting)
        assert [[r.request_id for r in g] for g in pol.groups] == ref.groups
    assert ref.groups == [["r5", "r0", "r1", "r2", "r3", "r4"]]  # all tie on arrival: queue order
