"""``--jobs`` of the sim benches: independent runs on several processes, the results in order and
equal to running them here."""

from __future__ import annotations

import os

from tidal.experiments.parallel import run_all


def _square_and_pid(x: int, y: int = 0) -> tuple[int, int]:
    return x * x + y, os.getpid()


def test_run_all_keeps_the_order_and_runs_elsewhere_with_jobs():
    calls = [(x, 1) for x in range(5)]
    here = run_all(_square_and_pid, calls, 1)
    there = run_all(_square_and_pid, calls, 2)
    assert [v for v, _ in here] == [v for v, _ in there] == [x * x + 1 for x in range(5)]
    assert {pid for _, pid in here} == {os.getpid()}
    assert os.getpid() not in {pid for _, pid in there}  # spawned processes did the work
    assert run_all(_square_and_pid, [(3,)], 4)[0] == (9, os.getpid())  # one call: no pool
