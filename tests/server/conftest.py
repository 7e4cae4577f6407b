"""Real servers in subprocesses (``python -m tidal.cli serve --port 0``), started once per session.

Loading a server takes ~10 s of CPU each (imports, the GGUF, the tokenizer, the weights), mostly on
one core, and the suite leaves about one core of two idle on average. So when the session will use
the servers, both are launched early, as soon as the tests that time something to within
milliseconds (``QUIET_MODULES``) are behind, under ``SCHED_IDLE``: they load only on CPU that no
test wants, and a test's thread that wakes up preempts them at once. The first server test puts
every thread of theirs back under the normal policy; each fixture then waits for its server's
"serving <name> on http://host:port" line and a 200 from /health. Where the normal policy cannot be
restored (not root and RLIMIT_NICE < 20) they are launched when first needed, as before; their loads
then overlap with the in-process reference engine.

The multi-instance servers of ``test_cluster_api.py`` (a front end and two worker processes each,
~1 GiB a worker) are launched the same way when the first server test starts (not earlier: the
runtime tests' own workers are gone by then, so the session holds no more memory than before),
except the Ray one: Ray's start-up has its own time limits, which a server starved under
``SCHED_IDLE`` could overrun, so it starts at the normal policy when the module needs it. Each
cluster server is stopped when its module ends and checked (exit code 0, no traceback) with the
session's servers, so the module does not wait for its nine processes to exit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.processes import die_with_parent, process_tree

READY_RE = re.compile(r"serving (\S+) on http://([\d.]+):(\d+)")
STARTUP_TIMEOUT = 240.0


# Tests that time a stub server to within 15 ms: they run before the servers are launched.
QUIET_MODULES = ("tests/bench/test_bench_serve.py",)


def _idle_and_die_with_parent() -> None:
    die_with_parent()
    with contextlib.suppress(OSError):  # not allowed here: then it loads at the normal policy
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class ServerProcess:
    def __init__(self, *flags: str, background: bool = False, env: dict[str, str] | None = None):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tidal-serve-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--port", "0", "--dtype", "float32", *flags]
        env = {**(env or os.environ), "TOKENIZERS_PARALLELISM": "false"}
        env.pop("TIDAL_WEIGHT_CACHE_MB", None)  # a server as users run it (it loads the weights once anyway)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_idle_and_die_with_parent if background else die_with_parent)
        self.background = background
        self.url = ""
        self.model = ""
        self.final_output = ""
        self.terminated = False

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self) -> ServerProcess:
        if self.url:
            return self
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.background:  # workers it starts meanwhile inherit SCHED_IDLE from a thread not yet restored
                self.normal_policy()
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            m = READY_RE.search(self.output())
            if m:
                url = f"http://{m.group(2)}:{m.group(3)}"
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        self.url, self.model = url, m.group(1)
                        if self.background:
                            self.normal_policy()
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        pytest.fail(f"the server did not come up in {STARTUP_TIMEOUT:.0f} s:\n{self.output()[-3000:]}")

    def normal_policy(self) -> None:
        """SCHED_OTHER for every thread of the server and of the processes it started (its workers:
        on Linux each thread has its own policy, inherited from the thread that started it, process
        or thread): repeated until no thread is left behind."""
        for _ in range(10):
            changed = 0
            for pid in process_tree(self.proc.pid):
                try:
                    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
                except OSError:  # it has exited: wait_ready reports that of the server
                    continue
                for tid in tids:
                    with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                        if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                            changed += 1
            if not changed:
                return

    def terminate(self) -> None:
        # once: a second SIGTERM that lands while the interpreter finalizes (its handlers reset to the
        # default) kills a server that was exiting cleanly (CI saw exit code -15)
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)  # graceful: the lifespan stops the engine

    def stop(self) -> int:
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            pytest.fail("the server did not exit within 30 s of SIGTERM")
        self.final_output = self.output()
        os.unlink(self.log.name)
        return self.proc.returncode


@contextlib.contextmanager
def own_server(*flags: str):
    """A server of a test module's own, ready; on the way out it is stopped by its pid, and must
    have exited 0 with no exception in its log."""
    p = ServerProcess(*flags)
    try:
        yield p.wait_ready()
    finally:
        code = p.stop()
        assert code == 0, f"the server exited with {code}:\n{p.final_output[-3000:]}"
        assert "Traceback" not in p.final_output, p.final_output[-3000:]


_procs: dict[str, ServerProcess] = {}

# test_cluster_api.py's multi-instance servers: the flags they share, and each layout's own
CLUSTER_COMMON = ("--instances", "2", "--threads-per-instance", "1", "--kv-cache-memory", "64MiB")
CLUSTER_LAYOUTS = {
    "colocate": (),
    "disaggregate": ("--mode", "disaggregate", "--prefill-instances", "1"),
    "ray": ("--backend", "ray"),
}
CLUSTER_FOREGROUND = ("ray",)  # never launched under SCHED_IDLE (see the module docstring)
_cluster: dict[str, ServerProcess] = {}
_cluster_stopped: dict[str, ServerProcess] = {}  # terminated when their module ended, checked at the end


def _launch(background: bool = False) -> dict[str, ServerProcess]:
    if not _procs:
        _procs["main"] = ServerProcess("--max-num-seqs", "32", background=background)
        _procs["small"] = ServerProcess("--max-num-seqs", "1", "--max-queued-requests", "2",
                                        "--kv-cache-memory", "64MiB", "--num-threads", "1", background=background)
    return _procs


def cluster_layouts() -> list[str]:
    """The layouts that can run here (Ray is optional)."""
    return [n for n in CLUSTER_LAYOUTS if n != "ray" or importlib.util.find_spec("ray") is not None]


def launch_cluster(background: bool = False) -> dict[str, ServerProcess]:
    """The multi-instance servers, each launched once (in the background: all but the Ray one)."""
    for n in cluster_layouts():
        if n not in _cluster and (not background or n not in CLUSTER_FOREGROUND):
            _cluster[n] = ServerProcess(*CLUSTER_COMMON, *CLUSTER_LAYOUTS[n], background=background)
    return _cluster


def stop_cluster_later() -> None:
    """SIGTERM every multi-instance server now; ``server_procs`` waits for them and checks them."""
    for n, p in _cluster.items():
        p.terminate()
        _cluster_stopped[n] = p
    _cluster.clear()


def _can_restore_policy() -> bool:
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


class _EarlyLaunch:
    """A plugin (so that it sees every test, not only this directory's) that launches the servers in
    the background when the test ``nodeid`` starts, and the multi-instance servers when the test
    ``cluster_nodeid`` starts (None: not in this session)."""

    def __init__(self, nodeid: str, cluster_nodeid: str | None):
        self.nodeid, self.cluster_nodeid = nodeid, cluster_nodeid

    def pytest_runtest_logstart(self, nodeid, location):
        if nodeid == self.nodeid:
            _launch(background=True)
        if nodeid == self.cluster_nodeid:
            launch_cluster(background=True)


def pytest_collection_finish(session):
    items = session.items
    first = next((i for i, item in enumerate(items) if "server_procs" in getattr(item, "fixturenames", ())), None)
    if first is None or session.config.option.collectonly or not _can_restore_policy():
        return
    quiet = [i for i, item in enumerate(items[:first]) if item.nodeid.startswith(QUIET_MODULES)]
    start = items[quiet[-1] + 1 if quiet else 0]
    cluster = any("cluster_servers" in getattr(item, "fixturenames", ()) for item in items[first:])
    session.config.pluginmanager.register(_EarlyLaunch(start.nodeid, items[first].nodeid if cluster else None),
                                          "tidal-early-servers")


def pytest_sessionfinish(session):
    """Stop servers launched early but never used (the run ended before the server tests)."""
    for p in [*_procs.values(), *_cluster.values(), *_cluster_stopped.values()]:
        if os.path.exists(p.log.name):  # server_procs' teardown (stop) removes it
            p.terminate()
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(timeout=10)
            os.unlink(p.log.name)


@pytest.fixture(scope="session")
def server_procs():
    procs = _launch()
    for p in procs.values():
        p.normal_policy()
    yield procs
    for p in procs.values():
        p.terminate()
    codes = {name: p.stop() for name, p in procs.items()}
    assert codes == {"main": 0, "small": 0}, f"servers exited with {codes}"
    for name, p in procs.items():  # nothing blew up inside the servers while the tests ran
        assert "Traceback" not in p.final_output, f"{name} server logged an exception:\n{p.final_output[-3000:]}"
    # the multi-instance servers, terminated when test_cluster_api.py ended
    cluster = dict(_cluster_stopped)
    _cluster_stopped.clear()
    codes = {n: p.stop() for n, p in cluster.items()}
    assert codes == dict.fromkeys(cluster, 0), f"cluster servers exited with {codes}"
    for n, p in cluster.items():
        assert "Traceback" not in p.final_output, f"{n} server logged an exception:\n{p.final_output[-3000:]}"


@pytest.fixture(scope="session")
def server(server_procs) -> ServerProcess:
    return server_procs["main"].wait_ready()


@pytest.fixture(scope="session")
def small_server(server_procs) -> ServerProcess:
    return server_procs["small"].wait_ready()


COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Name three colors."}]
REF_MAX_TOKENS = 24


@pytest.fixture(scope="session")
def reference(server_procs, make_engine):
    """Greedy answers of the offline ``LLM`` (built while the servers load), then freed."""
    from tidal import LLM, SamplingParams

    llm = LLM.from_engine(make_engine(kv_cache_memory="64MiB"))
    params = SamplingParams(temperature=0, max_tokens=REF_MAX_TOKENS)
    comp = llm.generate([COMPLETION_PROMPT], params)[0]
    chat = llm.chat(CHAT_MESSAGES, params)[0]
    ref = {
        "completion": comp.outputs[0].text, "completion_ids": comp.outputs[0].token_ids,
        "completion_prompt_ids": comp.prompt_token_ids,
        "chat": chat.outputs[0].text, "chat_finish": chat.outputs[0].finish_reason,
        "chat_prompt_ids": chat.prompt_token_ids,
    }
    del llm
    return ref
