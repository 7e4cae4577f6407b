"""One lock for work that one process of a machine does for all of them (tidal's kernel build, the
start-up timings): ``fcntl.flock`` on a file, which the kernel releases when its holder dies (Ctrl-C,
a SIGKILL, an OOM kill, a closed terminal), so no lock outlives the process that took it. The holder
writes its pid into the file; a process that has to wait more than a moment says on stderr for whom
and why (``engine: waiting for pid 123, which is building tidal's kernels``), and waits at most
``timeout_s``: then :class:`LockTimeout`, and the caller goes on without what the holder makes.

(The ``filelock`` package truncates the file at every try, so the holder's pid could not live in it.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from tidal.common.progress import startup_line

log = logging.getLogger("tidal.locks")
POLL_S = 0.1  # flock has no timed wait: a waiter tries again this often
QUIET_S = 1.0  # a wait shorter than this (a holder that only loads what is built) prints nothing


class LockTimeout(TimeoutError):
    def __init__(self, path: str, doing: str, holder: int | None, limit_s: float):
        self.path, self.holder, self.limit_s = path, holder, limit_s
        who = f"pid {holder}" if holder is not None else "another process"
        super().__init__(f"{who} has been {doing} for more than {limit_s:g} s (lock {path})")


def holder_pid(path: str) -> int | None:
    """The pid the lock's holder wrote into ``path``, None when there is none (free, or just taken)."""
    try:
        with open(path, "rb") as f:
            return int(f.read(32).split()[0])
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def exclusive(path: str, doing: str, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold the flock on ``path`` (created with its folder if missing) while the block runs. Yields
    True when held; False where no lock can be taken here (no fcntl, a file that cannot be opened:
    the block then runs as it would without the lock). A wait longer than :data:`QUIET_S` prints why
    (``doing`` names what the holder does) and its end; past ``timeout_s`` it raises :class:`LockTimeout`."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        f = open(path, "a+b")  # noqa: SIM115 - closed below, after the lock is released
    except OSError as e:
        log.warning("going on without the lock %s (%s)", path, e)
        yield False
        return
    with f:
        t0 = time.monotonic()
        announced: int | None | bool = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                if timeout_s is not None and waited >= timeout_s:
                    raise LockTimeout(path, doing, holder_pid(path), timeout_s) from None
                if announced is False and waited >= QUIET_S:
                    announced = holder_pid(path)
                    who = f"pid {announced}" if announced is not None else "another process"
                    limit = f"; at most {timeout_s:g} s" if timeout_s is not None else ""
                    startup_line(f"waiting for {who}, which is {doing} (lock {path}{limit}) ...")
                time.sleep(POLL_S)
        if announced is not False:
            startup_line(f"done waiting ({time.monotonic() - t0:.1f} s)")
        try:
            f.truncate(0)
            f.write(f"{os.getpid()}\n".encode())
            f.flush()
            yield True
        finally:
            with contextlib.suppress(OSError):
                f.truncate(0)  # a waiter that reads the file now finds no pid, not a stale one
            fcntl.flock(f, fcntl.LOCK_UN)


__all__ = ["LockTimeout", "exclusive", "holder_pid"]
