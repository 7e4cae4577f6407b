"""OpenAI-style errors: every failure answers ``{"error": {"message", "type", "param", "code"}}``.

:class:`APIError` is what the handlers raise; :func:`from_exception` maps engine exceptions
(queue full, no live instance, rejected prompt, bad sampling parameter, dead engine) onto it, and
:func:`install_handlers` makes FastAPI answer validation errors, unknown routes and unexpected
exceptions in the same shape, so a bad request never takes the server down.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.core.sampling import SamplingParamsError
from tidal.core.scheduler import RequestRejected
from tidal.engine.async_engine import EngineDeadError, InstanceUnavailableError, QueueFullError

log = logging.getLogger("tidal.server")

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "server_error"}
RETRY_AFTER_S = 1  # what a 503 (queue full, engine down) or a 429 tells the client to wait, in seconds


class ServerShuttingDown(Exception):
    """The server is stopping: a live stream ends with an error event and ``[DONE]``, a request
    waiting for its answer gets 503."""


class APIError(Exception):
    """An error answered to the client; ``param`` names the offending request field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = dict(headers or {})
        if status in (429, 503):  # a refusal that will pass: say when to come back
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def from_exception(e: BaseException, prompt_param: str = "prompt") -> APIError:
    """The API error for an exception raised while submitting or running a request."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(str(e), 503, code="queue_full")
    if isinstance(e, InstanceUnavailableError):  # an instance died and restarts: a fault a retry gets past
        return APIError(str(e), 503, code="instance_unavailable")
    if isinstance(e, ServerShuttingDown):
        return APIError(str(e), 503, code="server_shutdown")
    if isinstance(e, RequestRejected):
        param = prompt_param if e.param == "prompt" else e.param
        return APIError(str(e), 400, param=param, code="context_length_exceeded" if "context" in str(e) else None)
    if isinstance(e, SamplingParamsError):
        return APIError(str(e), 400, param=e.param, code="invalid_value")
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 500, code="engine_dead")
    log.exception("unexpected error while serving a request", exc_info=e)
    return APIError(f"internal error: {type(e).__name__}: {e}", 500, code="internal_error")


# pydantic puts the union member it tried into the error location ("stop", "list[str]", 0): drop it
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|tuple|literal|function-\w+|[A-Z]\w*)(\[.*\])?$")


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or _UNION_TAG.match(p)))]
    if parts and parts[0] == "body":  # FastAPI's own request validation prefixes the location
        parts = parts[1:]
    return ".".join(parts) or None


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """One 400 error naming the first bad field (and every problem pydantic found with it)."""
    if not errors:
        return APIError("invalid request", 400)
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first.get('msg')}", 400, code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msgs: list[str] = []
    for err in errors:
        if _loc_to_param(tuple(err.get("loc", ()))) == param:
            msg = str(err.get("msg", "invalid value"))
            msg = msg.removeprefix("Value error, ")
            if err.get("type") == "missing":
                msg = "this field is required"
            if msg not in msgs:
                msgs.append(msg)
    if param is None:
        return APIError(f"invalid request body: {'; '.join(msgs)}", 400, code="invalid_value")
    return APIError(f"{param}: {'; '.join(msgs)}", 400, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_errors(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route for {request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # keep what the exception carries: a 405's Allow header lists the methods the route takes
        return APIError(msg, exc.status_code, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
