"""Real servers in subprocesses (``python -m tidal.cli serve --port 0``), started once per session.

Loading a server takes ~10 s of CPU each (imports, the GGUF, the tokenizer, the weights), mostly on
one core. When the session will use them, both servers are launched right after collection at the
lowest CPU priority (nice 19), so that they load on whatever CPU the tests before them leave idle
and take next to nothing from those tests (some of which measure time). The first server test
restores their normal priority (every thread of theirs), and each fixture then waits for its
server's "serving <name> on http://host:port" line and a 200 from /health. Where the priority
cannot be raised back (not root, RLIMIT_NICE too low) they are launched when first needed, at
normal priority, as before; their loads then overlap with the in-process reference engine.
"""

from __future__ import annotations

import contextlib
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

READY_RE = re.compile(r"serving (\S+) on http://([\d.]+):(\d+)")
STARTUP_TIMEOUT = 240.0


LOW_PRIORITY = 19  # nice value while the servers load in the background


class ServerProcess:
    def __init__(self, *flags: str, nice: int = 0):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tidal-serve-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--port", "0", "--dtype", "float32", *flags]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("TIDAL_WEIGHT_CACHE_MB", None)  # a server as users run it (it loads the weights once anyway)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
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
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            m = READY_RE.search(self.output())
            if m:
                url = f"http://{m.group(2)}:{m.group(3)}"
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        self.url, self.model = url, m.group(1)
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        pytest.fail(f"the server did not come up in {STARTUP_TIMEOUT:.0f} s:\n{self.output()[-3000:]}")

    def normal_priority(self) -> None:
        """Nice 0 for every thread of the server (on Linux each thread has its own, inherited from the
        thread that started it): repeated until no thread is left behind."""
        for _ in range(10):
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{self.proc.pid}/task")]
            except OSError:  # it has exited: wait_ready reports that
                return
            lowered = 0
            for tid in tids:
                with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                    if os.getpriority(os.PRIO_PROCESS, tid) != 0:
                        os.setpriority(os.PRIO_PROCESS, tid, 0)
                        lowered += 1
            if not lowered:
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


_procs: dict[str, ServerProcess] = {}


def _launch(nice: int = 0) -> dict[str, ServerProcess]:
    if not _procs:
        _procs["main"] = ServerProcess("--max-num-seqs", "32", nice=nice)
        _procs["small"] = ServerProcess("--max-num-seqs", "1", "--max-queued-requests", "2",
                                        "--kv-cache-memory", "64MiB", "--num-threads", "1", nice=nice)
    return _procs


def _can_restore_priority() -> bool:
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def pytest_collection_finish(session):
    if session.config.option.collectonly or not _can_restore_priority():
        return
    if any("server_procs" in getattr(item, "fixturenames", ()) for item in session.items):
        _launch(nice=LOW_PRIORITY)


def pytest_sessionfinish(session):
    """Stop servers launched early but never used (the run ended before the server tests)."""
    for p in _procs.values():
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
        p.normal_priority()
    yield procs
    for p in procs.values():
        p.terminate()
    codes = {name: p.stop() for name, p in procs.items()}
    assert codes == {"main": 0, "small": 0}, f"servers exited with {codes}"
    for name, p in procs.items():  # nothing blew up inside the servers while the tests ran
        assert "Traceback" not in p.final_output, f"{name} server logged an exception:\n{p.final_output[-3000:]}"


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
