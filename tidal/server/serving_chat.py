"""/v1/chat/completions: messages through the model's chat template, then the shared machinery."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from tidal.core.plan import TokenLogprobs
from tidal.server.errors import APIError, from_exception
from tidal.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobEntry,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    cached_tokens,
    parse_body,
)
from tidal.server.serving import MAX_LOGPROBS, OpenAIServing, clean_logprob, sse
from tidal.server.streaming import EngineStreams, EventStreamResponse, PromptInput, run_watched


class OpenAIServingChat(OpenAIServing):
    def conversation(self, messages: list[ChatMessage], param: str = "messages") -> list[dict[str, str]]:
        """Messages as the chat template takes them: role and plain-text content."""
        if not messages:
            raise APIError(f"{param}: at least one message is required", 400, param=param)
        conv = []
        for i, m in enumerate(messages):
            if m.content is None:
                if m.role != "assistant":
                    raise APIError(f"{param}.{i}.content: a {m.role} message needs content", 400,
                                   param=f"{param}.{i}.content")
                text = ""
            elif isinstance(m.content, str):
                text = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        p = f"{param}.{i}.content.{j}"
                        raise APIError(f"{p}: only text content parts are supported (got type {part.type!r})",
                                       400, param=f"{p}.type")
                    texts.append(part.text)
                text = "".join(texts)
            role = "system" if m.role == "developer" else m.role
            conv.append({"role": role, "content": text})
        return conv

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          param: str = "messages") -> PromptInput:
        conv = self.conversation(messages, param)
        self.check_text_size(sum(len(m["content"]) for m in conv), param)  # before the template runs
        try:
            text = await self.off_loop(self.encoder.render_chat, conv, add_generation_prompt=add_generation_prompt)
        except ValueError as e:  # no chat template, or the template refused the conversation
            raise APIError(str(e), 400, param=param) from e
        return PromptInput(text, await self.encode(text, param, add_special_tokens=False))

    def chat_logprobs(self, entries: list[TokenLogprobs], top_n: int) -> ChatChoiceLogprobs:
        content = []
        for e in entries:
            s = self.token_str(e.token_id)
            tops = [ChatLogprob(token=(t := self.token_str(tid)), logprob=clean_logprob(v),
                                bytes=list(t.encode("utf-8", "replace"))) for tid, v in e.top[:top_n]]
            content.append(ChatLogprobEntry(token=s, logprob=clean_logprob(e.logprob),
                                            bytes=list(s.encode("utf-8", "replace")), top_logprobs=tops))
        return ChatChoiceLogprobs(content=content)

    async def create_chat_completion(self, request: Request) -> Response:
        start = time.monotonic()
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.check_model(req.model)
        if req.tools:
            raise APIError("tools are not supported by this server", 400, param="tools")
        fmt = (req.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(f"response_format {fmt!r} is not supported (only 'text')", 400, param="response_format")
        top_n = req.top_logprobs
        if top_n is not None and not 0 <= top_n <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_n}", 400, param="top_logprobs")
        if top_n and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", 400, param="top_logprobs")
        want_lp = bool(req.logprobs)
        if req.max_completion_tokens is not None:
            if req.max_tokens is not None:  # the one that counts is max_completion_tokens: both must be valid
                self.sampling_params(req, req.max_tokens, "max_tokens", None)
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        params = self.sampling_params(req, max_tokens, max_param, (top_n or 0) if want_lp else None)
        prompt = self.fit_length(await self.chat_prompt(req.messages, req.add_generation_prompt is not False), params,
                                 "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.start_streams(request, [prompt], params, req, rid, start, "messages")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(self._chat_events(streams, rid, params.n, include_usage, want_lp, top_n or 0),
                                       on_close=streams.aclose)
        try:
            finals = await run_watched(request, self._collect(streams))
        finally:
            await streams.aclose()
        out = finals[0]
        choices, completion_tokens = [], 0
        for c in out.outputs:
            lp = self.chat_logprobs(c.logprobs or [], top_n or 0) if want_lp else None
            choices.append(ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), logprobs=lp,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            completion_tokens += len(c.token_ids)
        pt = len(prompt.token_ids)
        usage = UsageInfo.of(pt, completion_tokens, cached_tokens(streams.firsts))
        return JSONResponse(ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                                   usage=usage).model_dump())

    async def _chat_events(self, streams: EngineStreams, rid: str, n: int, include_usage: bool, want_lp: bool,
                           top_n: int) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)
            return sse(c.model_dump_json(exclude=None if include_usage else {"usage"}))

        done: set[int] = set()
        ntoks: dict[int, int] = {}
        try:
            for i in range(n):  # the role comes first, as OpenAI sends it
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in streams.iterate():
                for c in out.outputs:
                    if c.index in done or not (c.delta_text or c.delta_token_ids or c.finish_reason):
                        continue
                    ntoks[c.index] = len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    lp = self.chat_logprobs(c.delta_logprobs, top_n) if want_lp else None
                    yield chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.delta_text),
                                                  logprobs=lp, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason)])
            if include_usage:
                pt = len(streams.firsts[0].prompt_token_ids)
                ct = sum(ntoks.values())
                yield chunk([], UsageInfo.of(pt, ct, cached_tokens(streams.firsts)))
        except Exception as e:  # the engine died mid-stream: tell the client in-band
            yield sse(json.dumps(from_exception(e).body()))
        finally:
            await streams.aclose()
        yield sse("[DONE]")
