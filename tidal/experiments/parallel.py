"""Independent simulator runs of an experiment on several cores: ``--jobs N`` of the sim benches.

Each simulator run is single-threaded and independent of the others (its own requests, its own
cluster), so a sweep's runs go to ``jobs`` processes (spawned: nothing of the parent's state is
shared) and come back in order; ``jobs <= 1`` runs them here, one after another. A worker dies
with the run that spawned it (Linux: a killed run leaves none computing on). The results are
the same either way: every run is deterministic in its inputs.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any


def run_all(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], jobs: int,
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
    """``[fn(*c) for c in calls]``, on up to ``jobs`` processes (``fn`` must be a module-level function).
    ``on_done(i, result)`` as each call ends, in the order they end (a progress line)."""
    if jobs <= 1 or len(calls) <= 1:
        out = []
        for i, c in enumerate(calls):
            out.append(fn(*c))
            if on_done is not None:
                on_done(i, out[-1])
        return out
    results: list[Any] = [None] * len(calls)
    from tidal.runtime.worker import die_with_parent  # a killed run leaves no worker computing on

    with ProcessPoolExecutor(min(jobs, len(calls)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent, initargs=(signal.SIGTERM,)) as ex:
        futures = {ex.submit(fn, *c): i for i, c in enumerate(calls)}  # taken by the workers in this order
        for fut in as_completed(futures):
            i = futures[fut]
            results[i] = fut.result()
            if on_done is not None:
                on_done(i, results[i])
    return results
