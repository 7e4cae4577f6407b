"""Request handling shared by the endpoints, and /v1/completions.

A handler validates the body (protocol.py), refuses a prompt too long to fit by its size in
characters (before any tokenizing), tokenizes on a pool thread with a tokenizer of its own (so a
long prompt never blocks the event loop, and the engine thread's tokenizer is never shared),
translates the OpenAI fields to
:class:`SamplingParams`, submits one engine request per prompt and pulls each one's first output
before answering, so a full queue (503) or a rejected prompt (400) is an ordinary error response
and never a broken stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from tidal.core.plan import TokenLogprobs
from tidal.core.sampling import SamplingParams, SamplingParamsError
from tidal.server.errors import APIError, from_exception
from tidal.server.metrics import ServerMetrics
from tidal.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingRequest,
    UsageInfo,
    cached_tokens,
    parse_body,
)
from tidal.server.streaming import (
    ClientDisconnected,
    Drain,
    EngineStreams,
    EventStreamResponse,
    PromptInput,
    run_watched,
)

MAX_N = 16
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_LOGPROBS = 20
# a prompt longer than max_model_len x this many characters cannot fit (no real tokenizer packs 32
# characters into each of thousands of tokens): refused by its size, before it is tokenized
MAX_CHARS_PER_TOKEN = 32
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM any number): more is a 400 naming the limit
MIN_LOGPROB = -9999.0
SEED_RANGE = (-(2**63), 2**63 - 1 - MAX_N)  # torch generators take 64-bit seeds; n > 1 uses seed + i
_NO_IDS: dict = {"choices": {"__all__": {"token_ids"}}}  # a completion's JSON without return_token_ids


def clean_logprob(x: float) -> float:
    """JSON has no -inf or NaN: clamp (as vLLM does)."""
    return x if x == x and x > MIN_LOGPROB else MIN_LOGPROB


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _own_copy(tokenizer: Any) -> Any:
    clone = getattr(tokenizer, "clone", None)
    return clone() if callable(clone) else tokenizer


class OpenAIServing:
    def __init__(self, llm: Any, model_name: str, metrics: ServerMetrics):
        self.llm = llm
        self.engine = llm.engine
        # tokenizers of the server's own, never the engine thread's: one for short calls on the event
        # loop (token strings of logprobs), one for the encoder pool (prompts, chat templates, /detokenize)
        self.tokenizer = _own_copy(llm.engine.tokenizer)
        self.encoder = _own_copy(llm.engine.tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-tokenize")
        self.model_name = model_name
        self.metrics = metrics
        self.max_model_len: int = llm.engine.max_model_len
        self.max_prompt_chars = self.max_model_len * MAX_CHARS_PER_TOKEN
        self.vocab_size: int = llm.engine.arch.vocab_size
        self._token_strs: dict[int, str] = {}
        self.drain = Drain()

    def close(self) -> None:
        """Stop the encoder pool (the app's shutdown)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the encoder pool thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------ validation helpers
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           404, param="model", code="model_not_found")

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.token_str(token_id)
        return s

    def check_text_size(self, n_chars: int, param: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise APIError(f"{param}: the prompt has {n_chars} characters; this server takes at most "
                           f"{self.max_prompt_chars} (its maximum context length, {self.max_model_len} tokens, "
                           f"x {MAX_CHARS_PER_TOKEN} characters per token)", 400, param=param,
                           code="context_length_exceeded")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_text_size(len(text), param)
        try:
            return await self.off_loop(self.encoder.encode, text, add_special_tokens=add_special_tokens)
        except Exception as e:  # e.g. lone surrogates the Rust tokenizer cannot take
            raise APIError(f"{param}: cannot tokenize the text ({type(e).__name__}: {e})", 400, param=param) from e

    async def decode(self, ids: list[int]) -> str:
        return await self.off_loop(self.encoder.decode, ids)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})", 400, param=param)

    def fit_length(self, prompt: PromptInput, params: SamplingParams, param: str) -> PromptInput:
        """The prompt must leave the context room for one output token (else 400). ``max_tokens``
        is an upper bound: where the prompt leaves less room, the request ends at the context
        (``finish_reason`` length), as the engine ends any request there; the prompt gets its own
        parameters then (a batch's prompts differ in length)."""
        ids = prompt.token_ids
        if not ids:
            raise APIError(f"{param}: the prompt is empty", 400, param=param)
        n = len(ids)
        if n >= self.max_model_len:
            raise APIError(f"this model's maximum context length is {self.max_model_len} tokens, but the "
                           f"prompt has {n} tokens (at least one output token must fit)", 400, param=param,
                           code="context_length_exceeded")
        room = self.max_model_len - n
        if params.max_tokens is None or params.max_tokens <= room:
            return prompt
        fitted = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return dataclasses.replace(prompt, params=fitted)

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None, max_param: str,
                        logprobs: int | None) -> SamplingParams:
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {n}", 400, param="n")
        if req.best_of is not None and req.best_of != 1:  # (vLLM V1 refuses best_of > 1 likewise)
            raise APIError(f"best_of must be 1 (best-of sampling is not supported), got {req.best_of}", 400,
                           param="best_of")
        top = self.max_model_len - 1  # the most any prompt of one token leaves room for
        if max_tokens is not None and not 1 <= max_tokens <= top:
            raise APIError(f"{max_param} must be in [1, {top}] (this model's context less one prompt token), got "
                           f"{max_tokens}", 400, param=max_param)
        min_tokens = req.min_tokens or 0
        if not 0 <= min_tokens <= top:
            raise APIError(f"min_tokens must be in [0, {top}], got {min_tokens}", 400, param="min_tokens")
        if max_tokens is not None:
            min_tokens = min(min_tokens, max_tokens)  # beyond max_tokens it changes nothing: max_tokens ends it
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if v is not None and v != 0:
                raise APIError(f"{name} is not supported by this server (only 0)", 400, param=name)
        if req.repetition_penalty is not None and req.repetition_penalty != 1:
            raise APIError("repetition_penalty is not supported (only 1)", 400, param="repetition_penalty")
        if req.logit_bias:
            raise APIError("logit_bias is not supported", 400, param="logit_bias")
        if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
            raise APIError("seed must be a 64-bit signed integer", 400, param="seed")
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true", 400, param="stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP:
            raise APIError(f"stop: at most {MAX_STOP} stop strings per request, got {len(stop)}", 400,
                           param="stop", code="invalid_value")
        try:
            return SamplingParams(
                n=n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens, min_tokens=min_tokens,
                stop=stop, stop_token_ids=list(req.stop_token_ids or []), ignore_eos=bool(req.ignore_eos),
                include_stop_str_in_output=bool(req.include_stop_str_in_output), logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens is not False, cache_salt=req.cache_salt)
        except SamplingParamsError as e:
            raise APIError(str(e), 400, param=e.param, code="invalid_value") from e

    # ------------------------------------------------------------------ running
    async def start_streams(self, request: Request, prompts: list[PromptInput], params: SamplingParams,
                            req: SamplingRequest, base_id: str, start: float, prompt_param: str) -> EngineStreams:
        streams = EngineStreams(self.llm, self.metrics, start, self.drain)
        try:
            await run_watched(request, streams.start(prompts, params, base_id, req.priority or 0,
                                                     req.request_class or "online"))
        except ClientDisconnected:
            raise
        except Exception as e:
            err = from_exception(e, prompt_param)
            self.metrics.rejected.labels(self.model_name, str(err.status)).inc()
            raise err from e
        return streams

    async def run(self, request: Request, handler: Any) -> Response:
        """Run an endpoint body; a client that went away gets nothing (the work is cancelled)."""
        try:
            return await handler
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # engine errors after submission: a lost instance 503, a dead engine 500, same shape
            return from_exception(e).response()

    # ------------------------------------------------------------------ /v1/completions
    def completion_logprobs(self, entries: list[TokenLogprobs], offset: int) -> tuple[CompletionLogprobs, int]:
        lp = CompletionLogprobs()
        for e in entries:
            s = self.token_str(e.token_id)
            lp.tokens.append(s)
            lp.token_logprobs.append(clean_logprob(e.logprob))
            top = {self.token_str(t): clean_logprob(v) for t, v in e.top}
            top.setdefault(s, clean_logprob(e.logprob))
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(s)
        return lp, offset

    async def completion_prompts(self, req: CompletionRequest) -> list[PromptInput]:
        p = req.prompt
        items: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if len(items) > MAX_PROMPTS:
            raise APIError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}", 400,
                           param="prompt")
        params = ["prompt" if len(items) == 1 else f"prompt.{i}" for i in range(len(items))]
        for item, param in zip(items, params, strict=True):  # every size before any tokenizing
            if isinstance(item, str):
                self.check_text_size(len(item), param)
        out = []
        for item, param in zip(items, params, strict=True):
            if isinstance(item, str):
                if not item:
                    raise APIError(f"{param}: the prompt is empty", 400, param=param)
                out.append(PromptInput(item, await self.encode(item, param)))
            else:
                self.check_token_ids(item, param)
                out.append(PromptInput(None, list(item)))
        return out

    async def create_completion(self, request: Request) -> Response:
        start = time.monotonic()
        req: CompletionRequest = await parse_body(request, CompletionRequest)
        self.check_model(req.model)
        if req.echo:
            raise APIError("echo is not supported", 400, param="echo")
        if req.suffix:
            raise APIError("suffix is not supported", 400, param="suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", 400, param="logprobs")
        params = self.sampling_params(req, req.max_tokens, "max_tokens", req.logprobs)
        prompts = await self.completion_prompts(req)
        prompts = [self.fit_length(p, params, "prompt" if len(prompts) == 1 else f"prompt.{i}")
                   for i, p in enumerate(prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.start_streams(request, prompts, params, req, rid, start, "prompt")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(self._completion_events(streams, rid, params.n, include_usage,
                                                               req.logprobs is not None, bool(req.return_token_ids)),
                                       on_close=streams.aclose)
        try:
            finals = await run_watched(request, self._collect(streams))
        finally:
            await streams.aclose()
        choices, completion_tokens = [], 0
        for pidx, out in enumerate(finals):
            for c in out.outputs:
                lp = self.completion_logprobs(c.logprobs or [], 0)[0] if req.logprobs is not None else None
                choices.append(CompletionChoice(index=pidx * params.n + c.index, text=c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                token_ids=list(c.token_ids) if req.return_token_ids else None))
                completion_tokens += len(c.token_ids)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens(streams.firsts))
        resp = CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump(exclude=None if req.return_token_ids else _NO_IDS))

    async def _collect(self, streams: EngineStreams) -> list[Any]:
        finals: list[Any] = list(streams.firsts)
        async for pidx, out in streams.iterate():
            finals[pidx] = out
        return finals

    async def _completion_events(self, streams: EngineStreams, rid: str, n: int, include_usage: bool,
                                 want_logprobs: bool, want_ids: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        done: set[int] = set()
        offsets: dict[int, int] = {}
        ntoks: dict[int, int] = {}
        try:
            async for pidx, out in streams.iterate():
                for c in out.outputs:
                    idx = pidx * n + c.index
                    if idx in done or not (c.delta_text or c.delta_token_ids or c.finish_reason):
                        continue
                    lp = None
                    if want_logprobs:
                        lp, offsets[idx] = self.completion_logprobs(c.delta_logprobs, offsets.get(idx, 0))
                    ntoks[idx] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(idx)
                    choice = CompletionChoice(index=idx, text=c.delta_text, logprobs=lp,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                              token_ids=list(c.delta_token_ids) if want_ids else None)
                    chunk = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice])
                    yield sse(chunk.model_dump_json(exclude={"usage": True, **({} if want_ids else _NO_IDS)}))
            if include_usage:
                pt = sum(len(o.prompt_token_ids) for o in streams.firsts)
                ct = sum(ntoks.values())
                usage = UsageInfo.of(pt, ct, cached_tokens(streams.firsts))
                chunk = CompletionResponse(id=rid, created=created, model=self.model_name, choices=[], usage=usage)
                yield sse(chunk.model_dump_json())
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            yield sse(json.dumps(from_exception(e).body()))
        finally:
            await streams.aclose()
        yield sse("[DONE]")
