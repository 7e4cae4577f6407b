"""Issue 16's hardening findings, in-process on a fake AsyncLLM (no model): headers the error
handler must keep, the stop-list limit, aborts of requests abandoned before their first output."""

from __future__ import annotations

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
