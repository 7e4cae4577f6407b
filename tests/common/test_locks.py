"""tidal.common.locks: the flock that one process of a machine holds while it builds or times for all
of them. It names its holder, dies with it, and a wait for it is bounded and says why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.processes import POPEN_KW
from tidal.common import locks
from tidal.common.locks import LockTimeout, exclusive, holder_pid


def test_the_holder_names_itself_and_a_waiter_gives_up_saying_for_whom(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(locks, "QUIET_S", 0.0)  # say so at once (a real wait says so after a second)
    path = str(tmp_path / "sub" / "x.lock")  # its folder is made
    with exclusive(path, "building the thing", timeout_s=5) as held:
        assert held and holder_pid(path) == os.getpid()
        # a second open file of the same path is a second lock, even in this process: it waits
        with pytest.raises(LockTimeout) as e, exclusive(path, "building the thing", timeout_s=0.3):
            pytest.fail("took a lock that is held")
        assert e.value.holder == os.getpid()
        assert str(e.value) == f"pid {os.getpid()} has been building the thing for more than 0.3 s (lock {path})"
    err = capsys.readouterr().err
    assert err.startswith(f"engine: waiting for pid {os.getpid()}, which is building the thing (lock {path}; "
                          "at most 0.3 s) ..."), err
    assert holder_pid(path) is None  # released: the file names nobody
    with exclusive(path, "building the thing", timeout_s=0) as held:  # free: no wait, no line
        assert held
    assert capsys.readouterr().err == ""


HOLD = """
import sys, time
from tidal.common.locks import exclusive
with exclusive(sys.argv[1], "holding it"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lock_dies_with_its_holder(tmp_path):
    """A holder killed with SIGKILL (no clean-up of its own) leaves a lock the next process takes."""
    path = str(tmp_path / "x.lock")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", HOLD, path], cwd=root, stdout=subprocess.PIPE, text=True,
                            **POPEN_KW)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeout) as e, exclusive(path, "x", timeout_s=0.2):
            pass
        assert e.value.holder == proc.pid
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        with exclusive(path, "x", timeout_s=30) as held:  # a bound, not a timing: it is taken at once
            assert held and holder_pid(path) == os.getpid()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_the_wait_bound_comes_from_the_environment(monkeypatch):
    from tidal.config import ConfigError, start_wait_s

    monkeypatch.delenv("TIDAL_START_WAIT_S", raising=False)
    assert start_wait_s() == 600.0
    monkeypatch.setenv("TIDAL_START_WAIT_S", "2.5")
    assert start_wait_s() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("TIDAL_START_WAIT_S", bad)
        with pytest.raises(ConfigError, match="TIDAL_START_WAIT_S must be a number of seconds >= 0"):
            start_wait_s()
