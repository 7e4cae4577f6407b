"""The served OpenAPI schema documents what the server does, and the server keeps to it: the
request and response models, the error responses, no phantom 422, text for /health and /metrics;
then schemathesis fuzzes the real server from its own /openapi.json (bounded) and no request may
get a 5xx or an answer outside the schema."""

from __future__ import annotations

from collections import Counter

import httpx

from tests.server.test_app_unit import FakeAsyncLLM
from tidal.server.app import build_app

BODIES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def test_schema_declares_bodies_responses_and_errors():
    spec = build_app(FakeAsyncLLM("ok")).openapi()
    comps = spec["components"]["schemas"]
    for path, model in BODIES.items():
        op = spec["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert comps[model]["properties"], model
        for code in ("400", "404", "413", "415"):
            assert op["responses"][code]["content"]["application/json"]["schema"] == ERROR_REF, (path, code)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert responses["503"]["content"]["application/json"]["schema"] == ERROR_REF
        assert "Retry-After" in responses["503"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(comps["ErrorResponse"]["properties"]) == {"error"}
    assert set(comps["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert comps["CompletionRequest"]["required"] == ["prompt"]
    assert "anyOf" in comps["CompletionRequest"]["properties"]["prompt"]
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert "422" not in op["responses"], (method, path)
            for code, resp in op["responses"].items():
                for media, content in resp.get("content", {}).items():
                    assert content.get("schema"), (method, path, code, media)  # never {}
    for path in ("/health", "/metrics"):
        assert set(spec["paths"][path]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in comps


def _bound(body: object) -> None:
    """Keep each fuzzed generation short: a few tokens, few choices, few prompts or messages."""
    if not isinstance(body, dict):
        return
    def number(v: object) -> bool:  # (3.0 is the integer 3 to the server)
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    for key in ("max_tokens", "max_completion_tokens"):
        if number(body.get(key)) and body[key] > 4:
            body[key] = 4
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if number(body.get("n")) and body["n"] > 2:
        body["n"] = 2
    for key in ("prompt", "messages"):
        if isinstance(body.get(key), list) and body[key] and not isinstance(body[key][0], int):
            body[key] = body[key][:2]


def test_fuzzed_requests_never_get_a_5xx(server):
    """Positive cases (bodies the schema admits, kept short by ``_bound``, which keeps them admitted)
    must be served, negative ones (a rule of the schema broken) refused with a 4xx: the server keeps
    to the rules its schema states (``tidal.server.schema_rules``)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        positive_data_acceptance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    spec = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance,
              response_headers_conformance, positive_data_acceptance, negative_data_rejection]
    statuses: Counter = Counter()
    server_errors: list[str] = []
    operations = [r.ok() for r in spec.get_all_operations()]
    assert {op.path for op in operations} >= set(BODIES)
    with httpx.Client(base_url=server.url) as c:
        c.get("/health")

    def fuzz(op, examples: int, mode: GenerationMode = GenerationMode.POSITIVE):
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:
            if mode is GenerationMode.POSITIVE:
                _bound(case.body)
            resp = case.call(base_url=server.url, timeout=120)
            statuses[resp.status_code] += 1
            if resp.status_code >= 500:
                server_errors.append(f"{op.method.upper()} {op.path} {case.body!r} -> {resp.status_code} "
                                     f"{resp.content[:300]!r}")
                return
            case.validate_response(resp, checks=checks)

        return run

    for op in operations:
        fuzz(op, 50 if op.path in BODIES else 3)()
        if op.path in BODIES:
            fuzz(op, 20, GenerationMode.NEGATIVE)()
    assert server_errors == [], server_errors[:5]
    assert sum(statuses.values()) >= 100 and statuses[200] > 0 and statuses[400] > 0, statuses
    assert httpx.get(f"{server.url}/health").status_code == 200


# (body, whether the schema admits it) for each endpoint: the server must answer 200 exactly for
# the admitted ones (a fake engine: vocabulary 256, context 64) and 400 for the others
COMP_CASES = [
    ({"prompt": "hi"}, True), ({"prompt": ""}, False), ({"prompt": []}, False), ({"prompt": [[]]}, False),
    ({"prompt": ["a", ""]}, False), ({"prompt": [1, 255]}, True), ({"prompt": [1, 256]}, False),
    ({"prompt": [-1]}, False), ({"prompt": [3.0, 4]}, True), ({"prompt": [[1], [2, 3]]}, True),
    ({"prompt": [1] * 63}, True), ({"prompt": [1] * 64}, False),
    ({"prompt": "hi", "max_tokens": 63}, True), ({"prompt": "hi", "max_tokens": 64}, False),
    ({"prompt": "hi", "max_tokens": 0}, False), ({"prompt": "hi", "min_tokens": 63, "max_tokens": 2}, True),
    ({"prompt": "hi", "min_tokens": 64}, False), ({"prompt": "hi", "n": 16}, True), ({"prompt": "hi", "n": 17}, False),
    ({"prompt": "hi", "best_of": 1, "n": 2}, True), ({"prompt": "hi", "best_of": 2, "n": 2}, False),
    ({"prompt": "hi", "temperature": 2}, True), ({"prompt": "hi", "temperature": 2.01}, False),
    ({"prompt": "hi", "top_p": 0}, False), ({"prompt": "hi", "top_p": 1}, True), ({"prompt": "hi", "top_k": -1}, True),
    ({"prompt": "hi", "top_k": -2}, False), ({"prompt": "hi", "min_p": 1.5}, False),
    ({"prompt": "hi", "seed": 2**63 - 17}, True), ({"prompt": "hi", "seed": 2**63 - 16}, False),
    ({"prompt": "hi", "stop": ""}, False), ({"prompt": "hi", "stop": ["a"] * 16}, True),
    ({"prompt": "hi", "stop": ["a"] * 17}, False), ({"prompt": "hi", "stop_token_ids": [0, 7]}, True),
    ({"prompt": "hi", "stop_token_ids": [-1]}, False), ({"prompt": "hi", "logprobs": 20}, True),
    ({"prompt": "hi", "logprobs": 21}, False), ({"prompt": "hi", "presence_penalty": 0.0}, True),
    ({"prompt": "hi", "frequency_penalty": 0.1}, False), ({"prompt": "hi", "repetition_penalty": 1}, True),
    ({"prompt": "hi", "repetition_penalty": 1.1}, False), ({"prompt": "hi", "logit_bias": {}}, True),
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, False), ({"prompt": "hi", "echo": False}, True),
    ({"prompt": "hi", "echo": True}, False), ({"prompt": "hi", "suffix": ""}, True), ({"prompt": "hi", "suffix": "x"}, False),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}, True),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, False),
    ({"prompt": "hi", "stream": False, "stream_options": None}, True),
]
CHAT = [{"role": "user", "content": "hi"}]
CHAT_CASES = [
    ({"messages": CHAT}, True), ({"messages": []}, False), ({"messages": [{"role": "user"}]}, False),
    ({"messages": [{"role": "user", "content": None}]}, False), ({"messages": [*CHAT, {"role": "assistant"}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}, True),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, False),
    ({"messages": CHAT, "max_completion_tokens": 63, "max_tokens": 1}, True),
    ({"messages": CHAT, "max_completion_tokens": 3, "max_tokens": 0}, False),
    ({"messages": CHAT, "top_logprobs": 2}, False), ({"messages": CHAT, "top_logprobs": 0}, True),
    ({"messages": CHAT, "top_logprobs": 2, "logprobs": True}, True), ({"messages": CHAT, "tools": []}, True),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, False), ({"messages": CHAT, "response_format": {}}, True),
    ({"messages": CHAT, "response_format": {"type": "json_object"}}, False),
]
OTHER_CASES = [
    ("/tokenize", {"prompt": ""}, True), ("/tokenize", {"messages": CHAT}, True), ("/tokenize", {}, False),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, False), ("/tokenize", {"prompt": None, "messages": CHAT}, True),
    ("/tokenize", {"messages": []}, False), ("/detokenize", {"tokens": [0, 255]}, True),
    ("/detokenize", {"tokens": [256]}, False), ("/detokenize", {"tokens": [-1]}, False),
]


def test_the_schema_admits_exactly_what_the_server_serves():
    """The request bodies' schemas state the handlers' rules (ranges, non-empty prompts and messages,
    token ids in the vocabulary, the rules across fields): each body of the table is schema-valid
    exactly when the server answers it with 200 (else 400), and 3.0 is the integer 3 to both."""
    from fastapi.testclient import TestClient
    from jsonschema import Draft202012Validator

    app = build_app(FakeAsyncLLM("ok"))
    spec = app.openapi()
    comps = spec["components"]["schemas"]

    def inline(x):  # the components hold no cycle
        if isinstance(x, dict):
            return inline(comps[x["$ref"].rsplit("/", 1)[1]]) if "$ref" in x else {k: inline(v) for k, v in x.items()}
        return [inline(v) for v in x] if isinstance(x, list) else x

    def admits(path: str, body: dict) -> bool:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return Draft202012Validator(inline(schema)).is_valid(body)

    cases = ([("/v1/completions", b, ok) for b, ok in COMP_CASES] + [("/v1/chat/completions", b, ok) for b, ok in CHAT_CASES]
             + OTHER_CASES)
    wrong = []
    with TestClient(app) as c:
        for path, body, ok in cases:
            r = c.post(path, json=body)
            got = (admits(path, body), r.status_code)
            if got != (ok, 200 if ok else 400):
                wrong.append((path, body, got, r.text[:160]))
    assert not wrong, wrong
