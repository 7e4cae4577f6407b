"""Child processes that tests start die with the test process, even when it is killed (SIGKILL,
a CI timeout): Linux's parent-death signal, set in the child before it runs anything."""

from __future__ import annotations

import ctypes
import signal
import sys


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: SIGKILL the child when its parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


POPEN_KW = {"preexec_fn": die_with_parent} if sys.platform.startswith("linux") else {}
