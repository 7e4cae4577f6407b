"""The rules the handlers enforce, stated in the served schema (OpenAPI 3.1, JSON Schema 2020-12).

The request models parse leniently typed JSON strictly (``protocol.py``); the handlers then refuse
what the engine cannot or will not run (``serving.py``, ``serving_chat.py``, ``app.py``), each with a
400 naming the field. :func:`state_rules` writes those same rules into the request bodies' schemas,
so a client generated from ``/openapi.json`` (or a fuzzer such as schemathesis) sees the server's
rules: a request the schema admits is not refused for its shape, and one it does not admit is.

Rules across fields are stated with ``anyOf`` (``stream_options`` only with ``stream``,
``top_logprobs`` only with ``logprobs``, exactly one of ``prompt`` and ``messages`` for
``/tokenize``). What depends on the tokenizer cannot be a schema's rule: a prompt
whose tokens alone fill the context is refused (400, ``context_length_exceeded``); ``max_tokens``
beyond what the context leaves after the prompt ends the request at the context instead
(``finish_reason`` ``length``), as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NULL = {"type": "null"}


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # token ids of a prompt are in [0, vocab_size)
    tokenizer_size: int  # token ids /detokenize takes are in [0, tokenizer_size)
    max_model_len: int
    max_n: int
    max_prompts: int
    max_stop: int
    max_logprobs: int
    seed_range: tuple[int, int]


def _nullable(s: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """``s`` or null, keeping the old property's title and default."""
    out: dict[str, Any] = {"anyOf": [s, NULL]}
    out.update({k: old[k] for k in ("title", "default", "description") if k in old})
    return out


def _int(lo: int | None = None, hi: int | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _num(lo: float, hi: float, exclusive_lo: bool = False) -> dict[str, Any]:
    return {"type": "number", "exclusiveMinimum" if exclusive_lo else "minimum": lo, "maximum": hi}


def _set(props: dict[str, Any], name: str, s: dict[str, Any], nullable: bool = True, doc: str | None = None) -> None:
    old = props[name]
    props[name] = _nullable(s, old) if nullable else {**s, **{k: old[k] for k in ("title",) if k in old}}
    if doc:
        props[name]["description"] = doc


def _sampling(props: dict[str, Any], lim: Limits) -> list[dict[str, Any]]:
    """The fields of both completion endpoints; returns their rules across fields (``allOf`` items)."""
    _set(props, "n", _int(1, lim.max_n))
    _set(props, "best_of", {"type": "integer", "const": 1}, doc="only 1 (best-of sampling is not supported)")
    _set(props, "temperature", _num(0, 2))
    _set(props, "top_p", _num(0, 1, exclusive_lo=True))
    _set(props, "top_k", _int(-1), doc="-1 or 0: off")
    _set(props, "min_p", _num(0, 1))
    _set(props, "seed", _int(*lim.seed_range))
    _set(props, "stop", {"anyOf": [{"type": "string", "minLength": 1},
                                   {"type": "array", "items": {"type": "string", "minLength": 1},
                                    "maxItems": lim.max_stop}]})
    _set(props, "stop_token_ids", {"type": "array", "items": _int(0)})
    _set(props, "min_tokens", _int(0, lim.max_model_len - 1),
         doc="EOS and stop tokens are ignored until this many tokens; beyond max_tokens, max_tokens ends the request")
    for name in ("presence_penalty", "frequency_penalty"):
        _set(props, name, {"type": "number", "minimum": 0, "maximum": 0}, doc="only 0 (not supported)")
    _set(props, "repetition_penalty", {"type": "number", "minimum": 1, "maximum": 1}, doc="only 1 (not supported)")
    _set(props, "logit_bias", {"type": "object", "maxProperties": 0, "additionalProperties": {"type": "number"}},
         doc="only empty (not supported)")
    # stream_options only with stream true (a property a branch names but the body lacks satisfies it)
    stream = {"anyOf": [{"properties": {"stream_options": NULL}},
                        {"properties": {"stream": {"const": True}}, "required": ["stream"]}]}
    return [stream]


def _max_tokens(props: dict[str, Any], name: str, lim: Limits) -> None:
    _set(props, name, _int(1, lim.max_model_len - 1),
         doc=f"at most {lim.max_model_len - 1} (the context less one prompt token); where the prompt leaves less "
             "room, the request ends at the context (finish_reason length)")


def state_rules(comps: dict[str, dict[str, Any]], lim: Limits) -> None:
    """Rewrite the request bodies' schemas in ``comps`` (the OpenAPI components) with the handlers' rules."""
    ids = {"type": "array", "items": _int(0, lim.vocab_size - 1), "minItems": 1, "maxItems": lim.max_model_len - 1}
    text = {"type": "string", "minLength": 1}

    c = comps["CompletionRequest"]
    p = c["properties"]
    cross = _sampling(p, lim)
    p["prompt"] = {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": lim.max_prompts},
                             {"type": "array", "items": ids, "minItems": 1, "maxItems": lim.max_prompts}],
                   "title": "Prompt",
                   "description": "a prompt, token ids, or a batch of either; a prompt whose tokens alone fill the "
                                  f"context ({lim.max_model_len} tokens less one for the output) is refused (400)"}
    _max_tokens(p, "max_tokens", lim)
    _set(p, "logprobs", _int(0, lim.max_logprobs))
    _set(p, "echo", {"type": "boolean", "const": False}, doc="only false (not supported)")
    _set(p, "suffix", {"type": "string", "maxLength": 0}, doc="only empty (not supported)")
    c["allOf"] = cross

    c = comps["ChatCompletionRequest"]
    p = c["properties"]
    cross = _sampling(p, lim)
    p["messages"] = {**p["messages"], "minItems": 1}
    _max_tokens(p, "max_tokens", lim)
    _max_tokens(p, "max_completion_tokens", lim)
    _set(p, "top_logprobs", _int(0, lim.max_logprobs), doc="above 0 only with logprobs true")
    _set(p, "tools", {"type": "array", "maxItems": 0}, doc="only empty (tools are not supported)")
    _set(p, "response_format", {"type": "object", "properties": {"type": {"const": "text"}}},
         doc="only type text (the default)")
    top = {"anyOf": [{"properties": {"top_logprobs": {"anyOf": [NULL, {"const": 0}]}}},
                     {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]}
    c["allOf"] = [*cross, top]

    # a message's content: text, or text parts; only an assistant's may be absent
    m = comps["ChatMessage"]
    m["anyOf"] = [{"properties": {"role": {"const": "assistant"}}},
                  {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}}]
    part = comps["ContentPart"]
    part["properties"]["type"] = {"const": "text", "title": "Type"}
    part["properties"]["text"] = {"type": "string", "title": "Text"}
    part["required"] = ["type", "text"]

    t = comps["TokenizeRequest"]  # exactly one of prompt and messages
    t["properties"]["messages"] = {**t["properties"]["messages"]}
    t["properties"]["messages"]["anyOf"] = [{**t["properties"]["messages"]["anyOf"][0], "minItems": 1}, NULL]
    t["oneOf"] = [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": NULL}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": NULL}}]

    d = comps["DetokenizeRequest"]
    d["properties"]["tokens"] = {**d["properties"]["tokens"], "items": _int(0, lim.tokenizer_size - 1)}


__all__ = ["Limits", "state_rules"]
