"""Issue 16's hardening findings, in-process on a fake AsyncLLM (no model): headers the error
handler must keep, the stop-list limit, aborts of requests abandoned before their first output."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from tests.server.test_app_unit import BODY, FakeAsyncLLM, client_for
from tidal.server.app import build_app
from tidal.server.serving import MAX_STOP


def test_405_keeps_the_allow_header():
    with client_for("ok") as c:
        r = c.get("/v1/completions")
        assert r.status_code == 405
        assert r.headers.get("allow") == "POST"
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = c.post("/health")
        assert r.status_code == 405 and r.headers.get("allow") == "GET"


def test_503_carries_retry_after():
    with client_for("full") as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={**BODY, "stream": stream})
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) >= 1
    with client_for("dead") as c:
        r = c.get("/health")
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1


def test_stop_list_limit():
    llm = FakeAsyncLLM("ok")
    with TestClient(build_app(llm)) as c:
        ok = c.post("/v1/completions", json={**BODY, "stop": [f"s{i}" for i in range(MAX_STOP)]})
        assert ok.status_code == 200
        for path, body in (("/v1/completions", BODY),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = c.post(path, json={**body, "stop": [f"s{i}" for i in range(MAX_STOP + 1)]})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "stop" and str(MAX_STOP) in err["message"]
        assert c.post("/v1/completions", json=BODY).status_code == 200  # still serving


class HangingLLM(FakeAsyncLLM):
    """Accepts every request and never produces its first output (a long prefill, a busy engine)."""

    def __init__(self):
        super().__init__("ok")
        self.started = 0

    async def generate(self, prompt, params, request_id=None, *, prompt_token_ids=None, priority=0,
                       request_class="online"):
        self.started += 1
        try:
            await asyncio.Event().wait()
            yield  # never reached
        finally:
            self.aborted += 1


@contextlib.contextmanager
def live_server(app):
    """The app under uvicorn on a thread, on a real socket (so that clients can hang up)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        while not server.started:
            assert t.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(30)
        assert not t.is_alive()


def _aborts(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r'tidal:request_success_total\{finished_reason="abort",model_name="[^"]*"\} (\S+)', text)
    assert m, text
    return float(m.group(1))


@pytest.mark.parametrize("stream", [False, True])
def test_clients_gone_before_first_output_are_counted_as_aborts(stream):
    llm = HangingLLM()
    n = 6

    async def impatient(url: str, i: int) -> None:
        body = {"prompt": f"hi {i}", "max_tokens": 4, "stream": stream, "n": 1 + i % 2}
        async with httpx.AsyncClient(base_url=url) as c:
            await c.post("/v1/completions", json=body, timeout=60)
            pytest.fail("the request should not have been answered")

    async def main(url: str) -> None:
        # the clients hang up once every request reached the engine (not after a fixed time, which
        # a loaded machine can spend before the server even reads the request)
        tasks = [asyncio.create_task(impatient(url, i)) for i in range(n)]
        deadline = time.monotonic() + 30
        while llm.started < n and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(d, asyncio.CancelledError) for d in done), done

    with live_server(build_app(llm)) as url:
        before = _aborts(url)
        asyncio.run(main(url))
        deadline = time.monotonic() + 10
        while llm.aborted < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llm.started == n and llm.aborted == n  # every engine request was aborted
        # one abort per choice that was asked for (n = 1 or 2)
        assert _aborts(url) - before == sum(1 + i % 2 for i in range(n))
        assert httpx.get(f"{url}/health").status_code == 200


def test_a_stream_whose_body_never_started_still_closes_its_engine_streams():
    """The client leaves before the first byte is sent: the body generator never ran (so its
    ``finally`` cannot close the engine streams); the response closes them itself."""
    from tidal.server.streaming import EventStreamResponse

    closed: list[str] = []

    async def body():
        try:
            yield "data: x\n\n"
        finally:
            closed.append("body")

    async def close_streams():
        closed.append("engine streams")

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):  # the peer is gone: the first send never completes
        await asyncio.sleep(30)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST",
             "path": "/v1/completions", "headers": []}
    resp = EventStreamResponse(body(), on_close=close_streams)
    asyncio.run(asyncio.wait_for(resp(scope, receive, send), 10))
    assert closed == ["engine streams"]
