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


def test_a_killed_run_leaves_no_worker_computing_on():
    """The run that spawned the pool is SIGKILLed mid-call: its workers die with it (Linux's
    parent-death signal), not after their current call."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    import pytest

    from tests.processes import POPEN_KW, alive, process_tree

    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    code = "import time; from tidal.experiments.parallel import run_all; run_all(time.sleep, [(60,), (60,)], 2)"
    p = subprocess.Popen([sys.executable, "-c", code], **POPEN_KW)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers := process_tree(p.pid)[1:]) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) >= 2, "the pool never started"
        time.sleep(1.0)  # the workers are in their calls
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if alive(w)]
    finally:
        for w in {*process_tree(p.pid), *workers}:  # orphaned workers are no longer under p
            with contextlib.suppress(OSError):
                os.kill(w, signal.SIGKILL)
