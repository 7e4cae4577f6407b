"""Request and response models of the OpenAI-compatible API (pydantic 2).

Requests are validated strictly (``"max_tokens": "10"`` is an error, not 10) from the raw JSON
body, so every problem becomes a 400 naming the field. Unknown fields are ignored, as OpenAI
clients send many we have no use for; the few we cannot honour are rejected by the handlers.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator

from tidal.server.errors import APIError, from_validation_errors

MAX_BODY_BYTES = 16 * 1024 * 1024
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class _Req(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Req):
    include_usage: bool | None = False


class SamplingRequest(_Req):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: int | None = 0
    request_class: Literal["online", "offline"] | None = "online"
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # prefix caching's tenant key (vLLM's field): requests with different salts never share cached KV
    cache_salt: str | None = Field(default=None, min_length=1)


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


class CompletionRequest(SamplingRequest):
    # str | list[int] | list[str] | list[list[int]]: checked below for a clear message
    prompt: Annotated[Any, WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1}, "minItems": 1}],
        "description": "a prompt, token ids, or a batch of either"})]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    return_token_ids: bool | None = False  # vLLM's field: each choice lists its tokens' ids (streamed: the new ones)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        bad = ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")
        if isinstance(v, str) or (_is_token_list(v) and v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or
                                          all(_is_token_list(p) for p in v)):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        raise bad


class ContentPart(_Req):
    type: str
    text: str | None = None


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True


class TokenizeRequest(_Req):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int]


def _whole_numbers(x: Any) -> tuple[Any, bool]:
    """``x`` with every float that is a whole number as an int (JSON's data model: ``3.0`` and
    ``3`` are one number, an integer), and whether any changed. A float field takes an int."""
    if isinstance(x, float):
        return (int(x), True) if x.is_integer() else (x, False)
    if isinstance(x, list):
        items = [_whole_numbers(v) for v in x]
        return ([v for v, _ in items], True) if any(c for _, c in items) else (x, False)
    if isinstance(x, dict):
        pairs = {k: _whole_numbers(v) for k, v in x.items()}
        return ({k: v for k, (v, _) in pairs.items()}, True) if any(c for _, c in pairs.values()) else (x, False)
    return x, False


async def parse_body(request: Request, model: type[_Req]) -> Any:
    """Read and validate a JSON body; every failure is an :class:`APIError` (400/413/415)."""
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(f"unsupported content type {media!r}; send application/json", 415,
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413, code="body_too_large")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", 413, code="body_too_large")
    if not raw.strip():
        raise APIError("the request body is empty; send a JSON object", 400, code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (byte {e.start})", 400, code="invalid_encoding") from e
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400, code="invalid_json") from e
    if not isinstance(obj, dict):
        raise APIError(f"the request body must be a JSON object, not {type(obj).__name__}", 400,
                       code="invalid_json")
    whole, changed = _whole_numbers(obj)
    if changed:  # JSON has one number type: 3.0 is the integer 3 (as the schema's "integer" says)
        text = json.dumps(whole)
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise from_validation_errors(list(e.errors())) from e
    except RecursionError as e:
        raise APIError("the request body is nested too deeply", 400, code="invalid_json") from e


# ---------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache already had


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def cached_tokens(outputs: list[Any]) -> int:
    """Prompt tokens the prefix cache had over a response's prompts (each one's first output)."""
    return sum(getattr(o, "num_cached_tokens", None) or 0 for o in outputs)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (left out of the JSON otherwise)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tidal"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
