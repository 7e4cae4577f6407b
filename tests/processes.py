"""Child processes that tests start die with the test process, even when it is killed (SIGKILL,
a CI timeout): Linux's parent-death signal, set in the child before it runs anything."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: SIGKILL the child when its parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


POPEN_KW = {"preexec_fn": die_with_parent} if sys.platform.startswith("linux") else {}


def alive(pid: int) -> bool:
    """``pid`` runs: it exists and is not a zombie (a process that exited and its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out
