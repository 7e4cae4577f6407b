"""The FastAPI app: OpenAI-compatible endpoints plus health, tokenizer, metrics and admin routes.

``build_app(async_llm, served_model_name)`` wires an :class:`AsyncLLM` (whose engine loop runs on
its own thread) into an app whose lifespan starts and stops that loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

import tidal
from tidal.core.policy import PolicyState
from tidal.server import dashboard
from tidal.server.errors import APIError, install_handlers
from tidal.server.metrics import ServerMetrics, batch_size_cap
from tidal.server.openapi import (
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
    errors,
    install_openapi,
    json_object,
    ok,
    request_body,
    text,
)
from tidal.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    parse_body,
)
from tidal.server.schema_rules import Limits
from tidal.server.serving import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOP, SEED_RANGE
from tidal.server.serving_chat import OpenAIServingChat


def engine_alive(llm: Any) -> bool:
    return bool(llm.is_running)


def _jsonable(x: Any) -> Any:
    """Plain JSON values (policy state may hold tuples, enums, inf)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return getattr(x, "value", str(x))


def build_app(async_llm: Any, served_model_name: str | None = None) -> FastAPI:
    engine = async_llm.engine
    name = served_model_name or engine.arch.name or "tidal-model"
    metrics = ServerMetrics(async_llm, name)
    serving = OpenAIServingChat(async_llm, name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        try:
            yield
        finally:
            serving.drain.begin()  # what is still streaming ends now, cleanly
            serving.close()
            await asyncio.to_thread(async_llm.shutdown)

    app = FastAPI(title="tidal", version=tidal.__version__, lifespan=lifespan)
    app.state.llm = async_llm
    app.state.serving = serving
    app.state.metrics = metrics
    # the server calls this as it stops accepting connections, before it waits for the open ones
    app.state.begin_shutdown = serving.drain.begin
    install_handlers(app)
    limits = Limits(vocab_size=serving.vocab_size, tokenizer_size=len(engine.tokenizer),
                    max_model_len=engine.max_model_len, max_n=MAX_N, max_prompts=MAX_PROMPTS, max_stop=MAX_STOP,
                    max_logprobs=MAX_LOGPROBS, seed_range=SEED_RANGE)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest], limits)
    body_errors = errors(400, 404, 413, 415)
    dashboard.install(app, metrics)  # /dashboard and /admin/latency

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses={**ok(CompletionResponse, "The completion (or its chunks, with stream)", stream=True),
                         **body_errors, **errors(503)})
    async def completions(request: Request) -> Response:
        return await serving.run(request, serving.create_completion(request))

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses={**ok(ChatCompletionResponse, "The chat completion (or its chunks, with stream)",
                              stream=True), **body_errors, **errors(503)})
    async def chat_completions(request: Request) -> Response:
        return await serving.run(request, serving.create_chat_completion(request))

    def model_card() -> ModelCard:
        return ModelCard(id=name, root=str(engine.checkpoint.path), max_model_len=engine.max_model_len)

    @app.get("/v1/models", responses=ok(ModelList, "The served model"))
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model_id:path}", responses={**ok(ModelCard, "The model"), **errors(404)})
    async def model(model_id: str) -> JSONResponse:
        serving.check_model(model_id)
        return JSONResponse(model_card().model_dump())

    @app.get("/health", response_class=PlainTextResponse,
             responses={**text("The engine is running (empty body)"), **errors(503)})
    async def health() -> Response:
        if engine_alive(async_llm):
            return PlainTextResponse("")
        reason = f"the engine loop is not running: {async_llm.dead}" if async_llm.dead else "engine not running"
        return APIError(reason, 503, code="engine_dead").response()

    @app.get("/version", responses=ok(VersionResponse, "tidal's version"))
    async def version() -> JSONResponse:
        return JSONResponse({"version": tidal.__version__})

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
              responses={**ok(TokenizeResponse, "The prompt's token ids"), **body_errors})
    async def tokenize(request: Request) -> JSONResponse:
        req: TokenizeRequest = await parse_body(request, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("send exactly one of prompt or messages", 400, param="prompt")
        if req.prompt is not None:
            tokens = await serving.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens is not False)
        else:
            tokens = (await serving.chat_prompt(req.messages or [], req.add_generation_prompt is not False)).token_ids
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
              responses={**ok(DetokenizeResponse, "The text of the token ids"), **body_errors})
    async def detokenize(request: Request) -> JSONResponse:
        req: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        serving.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < len(engine.tokenizer)), None)
        if bad is not None:
            raise APIError(f"tokens: token id {bad} is out of range [0, {len(engine.tokenizer)})", 400,
                           param="tokens")
        return JSONResponse({"prompt": await serving.decode(req.tokens)})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=text("Prometheus text exposition format (metrics named tidal:...)"))
    async def prometheus() -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/admin/state", responses=json_object("Engine, policy and cluster state"))
    async def admin_state() -> JSONResponse:
        stats = async_llm.stats
        policy = stats.pop("policy", None)  # a typed PolicyState
        cluster = stats.pop("cluster", None)  # instances and the global monitor, with several instances
        cfg = engine.config
        return JSONResponse(_jsonable({
            "model": name, "alive": engine_alive(async_llm), "max_model_len": engine.max_model_len,
            "pid": os.getpid(), "host": socket.gethostname(),  # where the server runs (a chaos soak's processes)
            "stats": stats, "policy": policy.to_dict() if isinstance(policy, PolicyState) else None,
            "batch_size_cap": batch_size_cap(stats, cfg.scheduler.max_num_seqs),
            "scheduler": dataclasses.asdict(cfg.scheduler), "cache": dataclasses.asdict(cfg.cache),
            "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
            # what attends (triton | tidal-cpu | torch) and whether decode steps replay CUDA graphs (one
            # instance; a cluster's instances say so in their "weights" lines)
            "attention": getattr(engine, "attention_backend", None), "cuda_graphs": getattr(engine, "cuda_graphs", None),
            **({"cluster": cluster} if cluster is not None else {}),
        }))

    @app.post("/reset_prefix_cache", responses={**json_object("The prefix cache was reset"), **errors(503)})
    async def reset_prefix_cache() -> JSONResponse:
        """Forget every cached prefix block (vLLM's endpoint; benchmark clients call it between runs).
        Blocks that running requests hold stay; a cluster resets every live instance."""
        if not engine_alive(async_llm):
            return APIError("the engine is not running", 503, code="engine_dead").response()
        told = await async_llm.reset_prefix_cache()
        return JSONResponse({"reset": True, "instances": told})

    @app.get("/admin/splits", responses={**json_object("The latest split decisions"), **errors(404)})
    async def admin_splits() -> JSONResponse:
        """DynaServe: the latest split decisions, one per request (pair, split point, KV moved)."""
        log = getattr(async_llm, "splits", None)
        if log is None or getattr(async_llm.layout, "mode", None) != "split":
            return APIError("this server does not split requests (serve with --instances 2 --mode split)", 404,
                            code="not_found").response()
        return JSONResponse(_jsonable({"splits": list(log)}))

    return app
