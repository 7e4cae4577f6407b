"""SIGTERM while streams are live: every stream ends cleanly (an error event naming the shutdown,
then ``data: [DONE]``), a request waiting for its whole answer gets 503, and the server exits 0
without a traceback (no CancelledError from cut streams)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx

from tests.server.conftest import ServerProcess

PROMPT = "Write a very long story about the sea."


def _running(url: str) -> float:
    m = re.search(r"^tidal:num_requests_running\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_sigterm_ends_live_streams_cleanly():
    srv = ServerProcess("--max-num-seqs", "4", "--kv-cache-memory", "64MiB", "--num-threads", "1")
    results: dict[str, object] = {}
    streaming = [threading.Event() for _ in range(3)]
    try:
        url = srv.wait_ready().url
        common = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}

        def stream(k: int) -> None:
            path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}) if k == 2
                          else ("/v1/completions", {"prompt": PROMPT}))
            events: list[str] = []
            with httpx.stream("POST", url + path, json={**body, **common, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) >= 3:
                            streaming[k].set()
            results[f"stream{k}"] = events

        def whole() -> None:
            r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, **common}, timeout=120)
            results["whole"] = (r.status_code, r.headers.get("retry-after"), r.json())

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(3)]
        threads.append(threading.Thread(target=whole))
        for t in threads:
            t.start()
        for ev in streaming:
            assert ev.wait(120), "a stream never started"
        deadline = time.monotonic() + 60
        while _running(url) < 4 and time.monotonic() < deadline:  # the non-streaming one runs too
            time.sleep(0.1)
        assert _running(url) == 4
        srv.terminate()  # SIGTERM
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a request was left hanging after SIGTERM"
    finally:
        code = srv.stop()
    for k in range(3):
        events = results[f"stream{k}"]
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "server_shutdown" and "shutting down" in err["message"]
        chunks = [json.loads(e) for e in events[:-2]]
        assert all(c["choices"][0].get("finish_reason") is None for c in chunks if c["choices"])  # cut mid-way
    status, retry_after, body = results["whole"]
    assert status == 503 and body["error"]["code"] == "server_shutdown" and retry_after is not None
    assert code == 0
    assert "Traceback" not in srv.final_output and "CancelledError" not in srv.final_output, srv.final_output[-3000:]
