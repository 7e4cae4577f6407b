"""Real servers in subprocesses (``python -m tidal.cli serve --port 0``), started once per session.

Both servers are launched as soon as the first one is needed so that their model loads overlap
with each other and with the in-process reference engine; each fixture then waits for its
server's "serving <name> on http://host:port" line and a 200 from /health.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from tests.processes import POPEN_KW

READY_RE = re.compile(r"serving (\S+) on http://([\d.]+):(\d+)")
STARTUP_TIMEOUT = 240.0


class ServerProcess:
    def __init__(self, *flags: str):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tidal-serve-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--port", "0", "--dtype", "float32", *flags]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        env.pop("TIDAL_WEIGHT_CACHE_MB", None)  # a server as users run it (it loads the weights once anyway)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, **POPEN_KW)
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


@pytest.fixture(scope="session")
def server_procs():
    procs = {
        "main": ServerProcess("--max-num-seqs", "32"),
        "small": ServerProcess("--max-num-seqs", "1", "--max-queued-requests", "2",
                               "--kv-cache-memory", "64MiB", "--num-threads", "1"),
    }
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
