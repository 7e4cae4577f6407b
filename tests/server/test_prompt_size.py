"""A long prompt neither blocks the event loop nor gets tokenized when it cannot fit: prompts
beyond max_model_len x MAX_CHARS_PER_TOKEN characters are refused by their size, the others are
encoded on a pool thread while /health and other requests keep being answered."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi.testclient import TestClient

from tests.server.test_app_unit import FakeAsyncLLM, FakeTokenizer
from tests.server.test_hardening import live_server
from tidal.server.app import build_app
from tidal.server.serving import MAX_CHARS_PER_TOKEN


class CountingTokenizer(FakeTokenizer):
    def __init__(self):
        self.encoded = 0

    def encode(self, text, add_special_tokens=True):
        self.encoded += 1
        return super().encode(text, add_special_tokens)


def test_oversized_prompt_is_refused_before_tokenizing():
    llm = FakeAsyncLLM("ok")  # max_model_len 64
    tok = llm.engine.tokenizer = CountingTokenizer()
    limit = 64 * MAX_CHARS_PER_TOKEN
    big = "x" * (limit + 1)
    cases = [("/v1/completions", {"prompt": big}, "prompt"),
             ("/v1/completions", {"prompt": ["hi", big]}, "prompt.1"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages"),
             ("/tokenize", {"prompt": big}, "prompt")]
    with TestClient(build_app(llm)) as c:
        for path, body, param in cases:
            before = tok.encoded
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "context_length_exceeded"
            assert str(limit) in err["message"] and err["type"] == "invalid_request_error"
            assert tok.encoded == before, f"{path} tokenized a prompt it had to refuse by its size"
        ok = c.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 2})
        assert ok.status_code == 200 and tok.encoded == 1


class GatedTokenizer:
    """The real tokenizer, whose encode waits (after it started) until the test lets it go on."""

    def __init__(self, real):
        self.real = real
        self.started = threading.Event()
        self.release = threading.Event()
        self.has_chat_template = real.has_chat_template

    def __len__(self) -> int:
        return len(self.real)

    def clone(self):
        return self  # every role sees the gate

    def encode(self, text, add_special_tokens=True):
        self.started.set()
        self.release.wait(30)
        return self.real.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        return self.real.decode(ids, skip_special_tokens)

    def token_str(self, i):
        return self.real.token_str(i)


def test_health_answers_while_a_multi_mb_prompt_is_encoded(smol_tokenizer):
    llm = FakeAsyncLLM("ok")
    gate = llm.engine.tokenizer = GatedTokenizer(smol_tokenizer)
    llm.engine.max_model_len = 10**6  # the 3 MB prompt is allowed: it has to be tokenized
    prompt = "The quick brown fox jumps over the lazy dog. " * 70000
    assert len(prompt) > 3_000_000
    with live_server(build_app(llm)) as url, ThreadPoolExecutor(1) as ex:
        try:
            fut = ex.submit(httpx.post, f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                            timeout=120)
            assert gate.started.wait(60), "the server never started encoding the prompt"
            health = httpx.get(f"{url}/health", timeout=10)  # the prompt is being encoded right now
            assert health.status_code == 200
            models = httpx.get(f"{url}/v1/models", timeout=10)
            assert models.status_code == 200
            assert not fut.done()  # both answered while the long prompt was still being encoded
        finally:
            gate.release.set()
        r = fut.result(120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(smol_tokenizer.encode(prompt))
