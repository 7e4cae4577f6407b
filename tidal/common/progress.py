"""The one progress helper: a tqdm bar on stderr, or nothing when progress is off.

Long jobs (load tests, simulations, profiles, benchmarks) report through :func:`progress_bar`, so
every command shows progress the same way and ``--no-progress`` turns it off everywhere. Jobs whose
steps are each worth a line (a benchmark's timed runs, a profile's passes) print them through
:func:`progress_lines` instead: ``[  3/12]    41.2s  message`` on stderr, also readable in a log file.

An engine's start (``serve``, ``generate``, ``LLM(...)``, each worker of a cluster) says on stderr what
it is doing whenever that may take seconds: :func:`startup_phase` prints a line when a phase begins
and one when it ends (``engine: building tidal's CPU kernels ...``, ``engine: kernels built in 95.2 s``),
:func:`startup_line` a single note; a cluster's worker labels its lines ``worker N engine``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO


class ProgressBar:
    """``update(n)`` counts work done; ``advance_to(x)`` moves to an absolute position (e.g. a
    simulated clock); ``close()`` ends the line. Disabled, every call does nothing."""

    def __init__(self, total: float | None, desc: str, unit: str, enabled: bool = True, **tqdm_kwargs: Any):
        self.bar = None
        self.pos = 0.0
        if enabled:
            from tqdm import tqdm

            kwargs = {"file": sys.stderr, "dynamic_ncols": True, "mininterval": 0.5, "leave": True, **tqdm_kwargs}
            self.bar = tqdm(total=total, desc=desc, unit=unit, **kwargs)

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


class ProgressLines:
    """Progress as whole lines: ``[  3/12]    41.2s  message`` (done/total, seconds since start).

    ``line(msg)`` counts one unit of work and prints; ``line(msg, count=False)`` prints a note
    (``[   ...]``); ``report(done, msg)`` sets the count and prints at most once per ``every_s``
    seconds (and always at the end), with the time left estimated from the rate so far.
    ``total`` may be corrected as the job learns its size. Disabled, nothing is printed.
    """

    def __init__(self, total: int | None, enabled: bool = True, every_s: float = 0.0, file: TextIO | None = None):
        self.total, self.done, self.enabled, self.every_s = total, 0, enabled, every_s
        self.file = file
        self.t0 = time.perf_counter()
        self._last = self.t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _print(self, head: str, msg: str) -> None:
        print(f"{head} {self.elapsed():7.1f}s  {msg}", file=self.file or sys.stderr, flush=True)

    def line(self, msg: str, count: bool = True) -> None:
        if count:
            self.done += 1
        if self.enabled:
            self._print(f"[{self.done:3d}/{self.total}]" if count else "[   ...]", msg)

    def report(self, done: int, msg: str) -> None:
        self.done = done
        now = time.perf_counter()
        end = self.total is not None and done >= self.total
        if not self.enabled or (not end and now - self._last < self.every_s):
            return
        self._last = now
        if self.total and 0 < done < self.total:
            msg += f", ~{self.elapsed() / done * (self.total - done):.0f}s left"
        self._print(f"[{done:3d}/{self.total}]", msg)


def progress_lines(total: int | None, enabled: bool = True, every_s: float = 0.0,
                   file: TextIO | None = None) -> ProgressLines:
    return ProgressLines(total, enabled, every_s, file)


_startup_label = "engine"
_startup_sink: Callable[[str], None] | None = None


def set_startup_label(label: str) -> None:
    """What this process's start-up lines begin with (``engine``; ``worker 2 engine`` in a cluster's worker)."""
    global _startup_label
    _startup_label = label


def set_startup_sink(sink: Callable[[str], None] | None) -> None:
    """Where else this process's start-up lines go (a Ray actor sends them to its front end, whose
    stderr is the one the user reads); None: stderr only."""
    global _startup_sink
    _startup_sink = sink


def startup_line(msg: str) -> None:
    """One line of an engine's start on stderr: ``engine: msg``."""
    line = f"{_startup_label}: {msg}"
    print(line, file=sys.stderr, flush=True)
    if _startup_sink is not None:
        with contextlib.suppress(Exception):  # a line that cannot be forwarded is still in this process's log
            _startup_sink(line)


@contextlib.contextmanager
def startup_phase(doing: str, done: str) -> Iterator[None]:
    """A phase of a start that may take seconds: ``engine: <doing> ...`` when it begins, ``engine: <done>
    in 12.3 s`` when it ends (nothing more when it raises: the error says why)."""
    startup_line(f"{doing} ...")
    t0 = time.perf_counter()
    yield
    startup_line(f"{done} in {time.perf_counter() - t0:.1f} s")


__all__ = ["ProgressBar", "ProgressLines", "progress_bar", "progress_lines", "set_startup_label", "set_startup_sink",
           "startup_line", "startup_phase"]
