"""Bad input never crashes the server: each malformed request gets a 4xx with an OpenAI-style error
body naming the problem, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LONG_PROMPT = "hello " * 9000  # > 8192 tokens

# (id, path, body: dict | bytes, headers, status, param (None: not checked))
CASES = [
    ("malformed-json", COMP, b'{"prompt": "hi",', {}, 400, None),
    ("json-array", COMP, b"[1, 2]", {}, 400, None),
    ("empty-body", COMP, b"", {}, 400, None),
    ("invalid-utf8", COMP, b'{"prompt": "\xff\xfe"}', {}, 400, None),
    ("wrong-content-type", COMP, b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, 415, None),
    ("missing-prompt", COMP, {"max_tokens": 5}, {}, 400, "prompt"),
    ("prompt-wrong-type", COMP, {"prompt": {"text": "hi"}}, {}, 400, "prompt"),
    ("prompt-mixed-list", COMP, {"prompt": [1, "a"]}, {}, 400, "prompt"),
    ("empty-prompt", COMP, {"prompt": ""}, {}, 400, "prompt"),
    ("empty-prompt-list", COMP, {"prompt": []}, {}, 400, "prompt"),
    ("token-id-out-of-range", COMP, {"prompt": [1, 10**9]}, {}, 400, "prompt"),
    ("prompt-too-long", COMP, {"prompt": LONG_PROMPT}, {}, 400, "prompt"),
    ("unknown-model", COMP, {"prompt": "hi", "model": "gpt-5"}, {}, 404, "model"),
    ("max-tokens-zero", COMP, {"prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max-tokens-negative", COMP, {"prompt": "hi", "max_tokens": -3}, {}, 400, "max_tokens"),
    ("max-tokens-beyond-context", COMP, {"prompt": "hi", "max_tokens": 10**6}, {}, 400, "max_tokens"),
    ("max-tokens-string", COMP, {"prompt": "hi", "max_tokens": "ten"}, {}, 400, "max_tokens"),
    ("temperature-high", COMP, {"prompt": "hi", "temperature": 7.5}, {}, 400, "temperature"),
    ("temperature-negative", COMP, {"prompt": "hi", "temperature": -1}, {}, 400, "temperature"),
    ("temperature-string", COMP, {"prompt": "hi", "temperature": "hot"}, {}, 400, "temperature"),
    ("top-p-zero", COMP, {"prompt": "hi", "top_p": 0}, {}, 400, "top_p"),
    ("top-p-high", COMP, {"prompt": "hi", "top_p": 1.5}, {}, 400, "top_p"),
    ("top-k-invalid", COMP, {"prompt": "hi", "top_k": -7}, {}, 400, "top_k"),
    ("min-p-high", COMP, {"prompt": "hi", "min_p": 2}, {}, 400, "min_p"),
    ("n-too-large", COMP, {"prompt": "hi", "n": 1000}, {}, 400, "n"),
    ("n-zero", COMP, {"prompt": "hi", "n": 0}, {}, 400, "n"),
    ("logprobs-too-many", COMP, {"prompt": "hi", "logprobs": 99}, {}, 400, "logprobs"),
    ("stop-wrong-type", COMP, {"prompt": "hi", "stop": 5}, {}, 400, "stop"),
    ("stop-empty-string", COMP, {"prompt": "hi", "stop": [""]}, {}, 400, "stop"),
    ("stop-token-negative", COMP, {"prompt": "hi", "stop_token_ids": [-1]}, {}, 400, "stop_token_ids"),
    ("seed-too-large", COMP, {"prompt": "hi", "seed": 2**80}, {}, 400, "seed"),
    ("seed-float", COMP, {"prompt": "hi", "seed": 1.5}, {}, 400, "seed"),
    ("stream-not-bool", COMP, {"prompt": "hi", "stream": "yes"}, {}, 400, "stream"),
    ("stream-options-without-stream", COMP, {"prompt": "hi", "stream_options": {"include_usage": True}}, {}, 400,
     "stream_options"),
    ("echo-unsupported", COMP, {"prompt": "hi", "echo": True}, {}, 400, "echo"),
    ("bad-request-class", COMP, {"prompt": "hi", "request_class": "batch"}, {}, 400, "request_class"),
    ("priority-string", COMP, {"prompt": "hi", "priority": "high"}, {}, 400, "priority"),
    ("presence-penalty", COMP, {"prompt": "hi", "presence_penalty": 0.5}, {}, 400, "presence_penalty"),
    ("chat-missing-messages", CHAT, {"max_tokens": 3}, {}, 400, "messages"),
    ("chat-empty-messages", CHAT, {"messages": []}, {}, 400, "messages"),
    ("chat-messages-string", CHAT, {"messages": "hi"}, {}, 400, "messages"),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, {}, 400, "messages.0.role"),
    ("chat-missing-role", CHAT, {"messages": [{"content": "hi"}]}, {}, 400, "messages.0.role"),
    ("chat-user-without-content", CHAT, {"messages": [{"role": "user"}]}, {}, 400, "messages.0.content"),
    ("chat-content-number", CHAT, {"messages": [{"role": "user", "content": 42}]}, {}, 400, "messages.0.content"),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     {}, 400, "messages.0.content.0.type"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": USER, "top_logprobs": 2}, {}, 400, "top_logprobs"),
    ("chat-logprobs-not-bool", CHAT, {"messages": USER, "logprobs": 5}, {}, 400, "logprobs"),
    ("chat-max-completion-tokens-zero", CHAT, {"messages": USER, "max_completion_tokens": 0}, {}, 400,
     "max_completion_tokens"),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, {}, 400, "messages"),
    ("chat-unknown-model", CHAT, {"messages": USER, "model": "nope"}, {}, 404, "model"),
    ("chat-tools", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400,
     "tools"),
    ("tokenize-nothing", "/tokenize", {}, {}, 400, None),
    ("tokenize-bad-prompt", "/tokenize", {"prompt": 12}, {}, 400, "prompt"),
    ("detokenize-out-of-range", "/detokenize", {"tokens": [10**9]}, {}, 400, "tokens"),
    ("detokenize-not-ints", "/detokenize", {"tokens": ["a"]}, {}, 400, "tokens.0"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, {}, 404, None),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path,body,headers,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(http, path, body, headers, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **headers}
    r = http.post(path, content=content, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if status == 404 and path in (COMP, CHAT):
        assert err["code"] == "model_not_found"


def test_wrong_method_and_server_survives(http):
    r = http.get(COMP)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 200
    ok = http.post(COMP, json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_at_least_25_cases():
    assert len(CASES) >= 25
