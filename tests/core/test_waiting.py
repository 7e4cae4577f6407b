"""WaitingQueue: its FCFS order is always sorted(queue, key=(priority, arrival)), sorting only when needed."""

from __future__ import annotations

import random

from tidal.core.policy import fcfs_key
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.waiting import WaitingQueue


def test_fcfs_order_matches_a_stable_sort_under_random_changes():
    rng = random.Random(7)
    q, mirror = WaitingQueue(), []
    for step in range(3000):
        op = rng.random()
        if op < 0.5 or not mirror:
            r = Request(f"r{step}", [1], SamplingParams(), arrival_time=float(rng.randint(0, 50)),
                        priority=rng.choice((0, 0, 0, 1)))
            if rng.random() < 0.2:
                q.appendleft(r)
                mirror.insert(0, r)
            else:
                q.append(r)
                mirror.append(r)
        else:
            r = rng.choice(mirror)
            q.remove(r)
            mirror.remove(r)
        assert list(q) == mirror and len(q) == len(mirror)
        expected = sorted(mirror, key=fcfs_key)
        assert list(q.fcfs()) == expected
        assert q.in_fcfs_order == (expected == mirror)
