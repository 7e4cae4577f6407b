"""The real-serving experiments' server helper: a ``tidal serve`` started, found ready and stopped by
its pid (every worker with it), and a server that cannot start reported with its log."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.processes import alive, process_tree
from tidal.experiments.server_proc import serve, stop


def test_serve_waits_for_health_and_stop_leaves_no_process():
    proc, url, log = serve(["--instances", "2", "--threads-per-instance", "1"],
                           ["--kv-cache-memory", "32MiB", "--max-num-seqs", "2"])
    try:
        assert httpx.get(f"{url}/health", timeout=10, trust_env=False).status_code == 200
        children = process_tree(proc.pid)[1:]
        assert len(children) >= 2  # the two instances' workers
    finally:
        stop(proc)
        os.unlink(log)
    assert proc.poll() is not None
    # the workers are stopped by the server; multiprocessing's resource tracker (also a child) exits
    # on its own once the server's end of its pipe closes: give it a moment, then none may be left
    deadline = time.monotonic() + 15
    while [c for c in children if alive(c)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in children if alive(c)]


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # the log goes under tmp_path
    with pytest.raises(SystemExit, match="server exited") as e:
        serve(["--batching", "nope"], [])
    assert "nope" in str(e.value)
    assert not list(tmp_path.iterdir())  # its log is removed once quoted


def test_a_server_dies_with_the_experiment_that_started_it(tmp_path):
    """An experiment killed outright (SIGKILL: no ``finally`` runs) takes its server along: the
    server gets SIGTERM from the kernel and stops its workers, so nothing is orphaned."""
    import signal
    import subprocess
    import sys

    script = ("import sys, time\nfrom tidal.experiments.server_proc import serve\n"
              "proc, url, log = serve(['--max-num-seqs', '2'], ['--kv-cache-memory', '16MiB'])\n"
              "print(proc.pid, log, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid, log = parent.stdout.readline().split()
        tree = process_tree(int(server_pid))
        assert alive(int(server_pid))
    finally:
        parent.kill()
        parent.wait(10)
    deadline = time.monotonic() + 30
    while [p for p in tree if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in tree if alive(p)]
    for p in left:  # a failing run cleans up after itself
        os.kill(p, signal.SIGKILL)
    os.unlink(log)
    assert not left
