"""The one progress helper: a tqdm bar on stderr, or nothing when progress is off.

Long jobs (load tests, simulations, profiles, benchmarks) report through :func:`progress_bar`, so
every command shows progress the same way and ``--no-progress`` turns it off everywhere.
"""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    """``update(n)`` counts work done; ``advance_to(x)`` moves to an absolute position (e.g. a
    simulated clock); ``close()`` ends the line. Disabled, every call does nothing."""

    def __init__(self, total: float | None, desc: str, unit: str, enabled: bool = True, **tqdm_kwargs: Any):
        self.bar = None
        self.pos = 0.0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                            mininterval=0.5, leave=True, **tqdm_kwargs)

    def update(self, n: float = 1, *_: Any) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.pos += n

    def advance_to(self, x: float) -> None:
        if self.bar is None:
            return
        if self.bar.total is not None:
            x = min(x, self.bar.total)
        if x > self.pos:
            self.bar.update(x - self.pos)
            self.pos = x

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(total: float | None, desc: str, unit: str = "it", enabled: bool = True,
                 **tqdm_kwargs: Any) -> ProgressBar:
    return ProgressBar(total, desc, unit, enabled, **tqdm_kwargs)


__all__ = ["ProgressBar", "progress_bar"]
