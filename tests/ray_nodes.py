"""A real two-node Ray cluster on this machine, for the tests that run tidal across Ray nodes.

The head and a second node are two ``ray start --block`` processes (one CPU each, token
authentication, every port their own, a temp dir of their own), so each node's GCS, raylet,
agents and workers are processes under its ``ray start``: :meth:`RayNodes.stop_node` and
:meth:`RayNodes.stop` end exactly those, by pid (never ``ray stop``, which stops every Ray of the
machine). A ``ray start`` dies with the test process (parent-death signal), and Ray's own
processes with their ``ray start`` (``--block`` makes them share its fate).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tests.processes import alive, die_with_parent, process_tree

START_TIMEOUT_S = 180.0  # a node's start (seconds on an idle machine, more on a loaded 2-core one)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNodes:
    """``RayNodes().start()``: a head and one more node; ``address`` is the head's ``host:port``;
    ``env`` is what a process that joins the cluster needs (the token, and this checkout on the
    workers' path)."""

    def __init__(self, num_cpus: int = 1):
        self.num_cpus = num_cpus
        self.tmp = tempfile.mkdtemp(prefix="tr-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "PYTHONPATH": os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])]),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.nodes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, str] = {}

    def _ports(self) -> list[str]:
        return ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]

    def _start(self, name: str, args: list[str], attempts: int = 2) -> None:
        """Start node ``name``; a raylet that exits before it registers (Ray waits a fixed 30 s for
        the head to register it, too short on a busy 2-core machine) is started once more."""
        for left in range(attempts - 1, -1, -1):
            try:
                self._start_once(name, args)
                return
            except RuntimeError:
                if left == 0 or self.nodes[name].poll() is None:
                    raise

    def _start_once(self, name: str, args: list[str]) -> None:
        log = os.path.join(self.tmp, f"{name}.log")
        self.logs[name] = log
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", str(self.num_cpus),
               "--temp-dir", os.path.join(self.tmp, "t"), "--object-store-memory", str(200 << 20),
               "--disable-usage-stats", *self._ports(), *args]
        with open(log, "w") as f:
            self.nodes[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                                preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with open(log) as f:
                if "Ray runtime started" in f.read():
                    return
            if self.nodes[name].poll() is not None:
                break
            time.sleep(0.5)
        with open(log) as f:
            raise RuntimeError(f"Ray node {name} did not start:\n{f.read()[-3000:]}")

    def start(self) -> RayNodes:
        try:
            self._start("head", ["--head", "--port", str(self.port), "--include-dashboard", "false"])
            self.add_node("node2")
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(self, name: str) -> None:
        """Another node joins (a stopped one may come back under its name)."""
        self._start(name, ["--address", self.address])
        self.wait_nodes(len(self.nodes))

    def alive_nodes(self) -> int:
        out = subprocess.run([sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], "
                              "log_to_driver=False); print('ALIVE', sum(n['Alive'] for n in ray.nodes()))",
                              self.address], env=self.env, capture_output=True, text=True, timeout=120)
        # Ray may print its own lines (e.g. "raylet has lagging heartbeats" on a busy machine): read ours
        counts = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("ALIVE ")]
        return counts[-1] if out.returncode == 0 and counts else -1

    def wait_nodes(self, n: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.alive_nodes() == n:
                return
            time.sleep(1)
        raise RuntimeError(f"the Ray cluster did not show {n} live nodes")

    def stop_node(self, name: str) -> None:
        """Stop one node: its ``ray start`` and every process under it (raylet, agents, workers), by pid."""
        proc = self.nodes.pop(name, None)
        if proc is None:
            return
        tree = process_tree(proc.pid)
        for pid in reversed(tree):  # children first: none is reparented and missed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self) -> None:
        for name in [n for n in self.nodes if n != "head"] + ["head"]:
            self.stop_node(name)
        shutil.rmtree(self.tmp, ignore_errors=True)
