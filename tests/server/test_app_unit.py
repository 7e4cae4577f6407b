"""The app in-process on a fake AsyncLLM: engine failures (dead engine, full queue, death mid-stream)
map to the right status codes and error bodies, without loading a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from tidal.config import EngineConfig
from tidal.core.plan import TokenLogprobs
from tidal.core.policy import PolicyState
from tidal.engine.async_engine import EngineDeadError, QueueFullError
from tidal.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tidal.server.app import build_app


class FakeTokenizer:
    """One token per character (ids = code points), enough for the handlers."""

    has_chat_template = True

    def __len__(self) -> int:
        return 256

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) % 256 for ch in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def token_str(self, i):
        return chr(i)

    def render_chat(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


class FakeAsyncLLM:
    def __init__(self, mode: str):
        self.mode = mode
        cfg = EngineConfig()
        self.engine = SimpleNamespace(
            tokenizer=FakeTokenizer(), arch=SimpleNamespace(name="fake-model", vocab_size=256), max_model_len=64,
            config=cfg, scheduler=SimpleNamespace(config=cfg.scheduler), checkpoint=SimpleNamespace(path="/fake"),
            device="cpu", dtype="float32")
        self.stats = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                      "num_kv_blocks": 10, "num_free_kv_blocks": 10, "num_preemptions": 0,
                      "batch_size_cap": 7, "policy": PolicyState("fake")}
        self.dead = None
        self._thread = None
        self.aborted = 0

    def start(self):
        self._thread = SimpleNamespace(is_alive=lambda: self.mode != "dead")

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def shutdown(self):
        pass

    async def generate(self, prompt, params, request_id=None, *, prompt_token_ids=None, priority=0,
                       request_class="online"):
        if self.mode == "dead":
            raise EngineDeadError("the engine loop has stopped: boom")
        if self.mode == "full":
            raise QueueFullError("the server's waiting queue is full (2 requests); retry later")
        finished = False
        try:
            want = params.logprobs is not None
            lp1 = [TokenLogprobs(104, -0.5, ((104, -0.5),))] if want else []
            lp2 = [TokenLogprobs(105, -0.25, ((105, -0.25),))] if want else []
            out = CompletionOutput(0, "h", [104], logprobs=lp1 if want else None, delta_text="h",
                                   delta_token_ids=[104], delta_logprobs=lp1)
            yield RequestOutput(request_id, prompt, prompt_token_ids, [out], metrics=RequestMetrics(0.0, 0.1))
            if self.mode == "die-midway":
                raise EngineDeadError("engine step failed: boom")
            out = CompletionOutput(0, "hi", [104, 105], logprobs=lp1 + lp2 if want else None, finish_reason="length",
                                   delta_text="i", delta_token_ids=[105], delta_logprobs=lp2)
            finished = True
            yield RequestOutput(request_id, prompt, prompt_token_ids, [out], finished=True,
                                metrics=RequestMetrics(0.0, 0.1))
        finally:
            if not finished:
                self.aborted += 1


def client_for(mode: str) -> TestClient:
    return TestClient(build_app(FakeAsyncLLM(mode), "served-name"), raise_server_exceptions=False)


BODY = {"prompt": "hey", "max_tokens": 2}


def test_ok_path_and_served_name():
    with client_for("ok") as c:
        r = c.post("/v1/completions", json={**BODY, "model": "served-name", "logprobs": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
        assert r.json()["choices"][0]["logprobs"]["tokens"] == ["h", "i"]
        assert c.get("/v1/models").json()["data"][0]["id"] == "served-name"
        assert c.get("/health").status_code == 200
        assert 'tidal:batch_size_cap{model_name="served-name"} 7.0' in c.get("/metrics").text
        assert c.get("/admin/state").json()["batch_size_cap"] == 7


@pytest.mark.parametrize("stream", [False, True])
def test_dead_engine_is_500_and_unhealthy(stream):
    with client_for("dead") as c:
        r = c.post("/v1/completions", json={**BODY, "stream": stream})
        assert r.status_code == 500
        assert r.json()["error"]["code"] == "engine_dead" and r.json()["error"]["type"] == "server_error"
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": stream})
        assert chat.status_code == 500
        assert c.get("/health").status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_503_before_streaming(stream):
    with client_for("full") as c:
        r = c.post("/v1/completions", json={**BODY, "stream": stream})
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "queue_full"


def test_engine_death_mid_stream_is_reported_in_band():
    app_llm = FakeAsyncLLM("die-midway")
    with TestClient(build_app(app_llm)) as c:
        r = c.post("/v1/completions", json={**BODY, "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] == "h"
        assert json.loads(events[1])["error"]["code"] == "engine_dead"
        assert events[-1] == "[DONE]"
        r = c.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
    assert app_llm.aborted == 2
