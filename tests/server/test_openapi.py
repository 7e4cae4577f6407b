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
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
            body[key] = 4
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2
    for key in ("prompt", "messages"):
        if isinstance(body.get(key), list) and body[key] and not isinstance(body[key][0], int):
            body[key] = body[key][:2]


def test_fuzzed_requests_never_get_a_5xx(server):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    spec = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance,
              response_headers_conformance]
    statuses: Counter = Counter()
    server_errors: list[str] = []
    operations = [r.ok() for r in spec.get_all_operations()]
    assert {op.path for op in operations} >= set(BODIES)
    with httpx.Client(base_url=server.url) as c:
        c.get("/health")

    def fuzz(op, examples: int):
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=op.as_strategy())
        def run(case) -> None:
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
    assert server_errors == [], server_errors[:5]
    assert sum(statuses.values()) >= 100 and statuses[200] > 0 and statuses[400] > 0, statuses
    assert httpx.get(f"{server.url}/health").status_code == 200
