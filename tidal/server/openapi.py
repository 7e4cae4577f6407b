"""The served OpenAPI schema: request bodies, response bodies and error responses of every route.

The handlers read their JSON bodies themselves (``protocol.parse_body``: strict, every problem a
400 naming the field), so FastAPI sees no body parameter to document. This module declares them:
``request_body(Model)`` for a route's ``openapi_extra``, ``ok(Model)``/``errors(...)`` for its
``responses``, and :func:`install_openapi` puts the request models into the components and drops
the 422 FastAPI would document for path parameters (a bad request is a 400 here, never a 422).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tidal.server.schema_rules import Limits, state_rules

JSON = "application/json"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every failure's body, as OpenAI answers it."""

    error: ErrorInfo


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


_ERRORS = {
    400: "Invalid request: malformed JSON, a bad field (named in error.param), a prompt too long",
    404: "Unknown model or route",
    413: "Request body too large",
    415: "Content type is not application/json",
    503: "Waiting queue full, no instance alive to serve it (one restarts), engine not running, or server "
         "shutting down (see Retry-After)",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Error responses for ``responses=``: the OpenAI error body (JSON, whatever the route's own
    response class; :func:`install_openapi` adds the model to the components)."""
    out: dict[int | str, dict[str, Any]] = {}
    for c in codes:
        out[c] = {"description": _ERRORS[c], "content": {JSON: {"schema": _ref(ErrorResponse)}}}
        if c == 503:
            out[c]["headers"] = _RETRY_AFTER
    return out


def ok(model: type[BaseModel], description: str, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The 200 response; ``stream``: also ``text/event-stream`` (``"stream": true``)."""
    resp: dict[str, Any] = {"model": model, "description": description}
    if stream:
        # before OpenAPI 3.2 (no itemSchema) an event stream's schema describes one event
        event = {"type": "object", "required": ["data"],
                 "properties": {"data": {"type": "string", "description": "a chunk's JSON, an error body's JSON, "
                                                                          "or [DONE] (the last event)"}},
                 "description": "one server-sent event: `data: <chunk JSON>` ... `data: [DONE]`"}
        resp["content"] = {"text/event-stream": {"schema": event}}
    return {200: resp}


def text(description: str) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}}


def json_object(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 whose JSON object has no fixed shape (admin views)."""
    return {200: {"description": description, "content": {JSON: {"schema": {"type": "object"}}}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as the route's JSON body."""
    return {"requestBody": {"required": True, "content": {JSON: {"schema": _ref(model)}}}}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]], limits: Limits | None = None) -> None:
    """Serve the schema with ``request_models`` (and the error body) in its components, no 422;
    with ``limits``, the request bodies state the handlers' rules (:mod:`tidal.server.schema_rules`)."""
    models = [*request_models, ErrorResponse]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description="OpenAI-compatible API of the tidal LLM server")
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for m in models:
            js = m.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
            comps.update(js.pop("$defs", {}))
            comps[m.__name__] = js
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        if limits is not None:
            state_rules(comps, limits)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["DetokenizeResponse", "ErrorInfo", "ErrorResponse", "TokenizeResponse", "VersionResponse",
           "errors", "install_openapi", "json_object", "ok", "request_body", "text"]
