"""Independent simulator runs of an experiment on several cores: ``--jobs N`` of the sim benches.

Each simulator run is single-threaded and independent of the others (its own requests, its own
cluster), so a sweep's runs go to ``jobs`` processes (spawned: nothing of the parent's state is
shared) and come back in order; ``jobs <= 1`` runs them here, one after another. The results are
the same either way: every run is deterministic in its inputs.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def run_all(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], jobs: int) -> list[Any]:
    """``[fn(*c) for c in calls]``, on up to ``jobs`` processes (``fn`` must be a module-level function)."""
    if jobs <= 1 or len(calls) <= 1:
        return [fn(*c) for c in calls]
    with ProcessPoolExecutor(min(jobs, len(calls)), mp_context=multiprocessing.get_context("spawn")) as ex:
        return list(ex.map(fn, *zip(*calls, strict=True)))
