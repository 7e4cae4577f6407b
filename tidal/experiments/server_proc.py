"""A ``tidal serve`` process for a real-serving experiment: started, waited for, stopped by its pid.

Each experiment run gets a server of its own, one at a time, so runs never share the cores."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from tidal.runtime.worker import die_with_parent

READY = re.compile(r"serving \S+ on (http://[\d.]+:\d+)")


def _die_with_us() -> None:
    """``preexec_fn`` of every child started here: SIGTERM when this process dies first."""
    die_with_parent(signal.SIGTERM)


def serve(flags: list[str], engine: list[str], timeout_s: float = 600) -> tuple[subprocess.Popen, str, str]:
    """Start ``tidal serve --port 0 ENGINE FLAGS``; returns (process, base URL, log file) once
    ``/health`` answers 200. Raises SystemExit with the log's tail (and removes the log) if it exits
    or never gets ready. The server gets SIGTERM (and stops its workers) if this process dies first."""
    log = tempfile.NamedTemporaryFile("w+", prefix="tidal-serve-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "serve", "--port", "0", *engine, *flags],
                            stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_us)
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        with open(log.name) as f:
            text = f.read()
        m = READY.search(text)
        if m and httpx.get(f"{m.group(1)}/health", timeout=5, trust_env=False).status_code == 200:
            return proc, m.group(1), log.name
        if proc.poll() is not None:
            os.unlink(log.name)
            raise SystemExit(f"server exited:\n{text[-2000:]}")
        time.sleep(0.5)
    stop(proc)
    os.unlink(log.name)
    raise SystemExit(f"server did not start in {timeout_s:.0f} s:\n{text[-2000:]}")


def run_client(cmd: list[str]) -> None:
    """Run a load client (``tidal bench serve ...``) to its end, its stdout dropped (its progress
    lines go to stderr); like the server, it gets SIGTERM if this process dies first."""
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, preexec_fn=_die_with_us)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server stops its workers), then SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
