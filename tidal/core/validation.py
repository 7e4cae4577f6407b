"""Request validation, in one place: what makes a request one that can never run here.

Pure functions of the request's numbers and the instance's limits. The engine (the client's
request: :func:`check_prompt_tokens`, :func:`check_context`), the simulator (before it dispatches:
:func:`check_context`) and the scheduler (every request it admits, new, imported or moved:
:func:`validate_request`) call these, so one bad request is refused with the same message by each.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Protocol


class RequestRejected(ValueError):
    """The request can never run on this instance (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class KVPool(Protocol):
    """What the KV check reads of a block pool (``tidal.core.kv_manager.KVCacheManager``)."""

    num_blocks: int
    block_size: int

    def blocks_for_tokens(self, num_tokens: int) -> int: ...


def check_prompt_tokens(prompt_token_ids: Sequence[int], vocab_size: int | None = None) -> None:
    """A prompt has at least one token, each a token id of the model's vocabulary."""
    if not prompt_token_ids:
        raise RequestRejected("the prompt is empty", param="prompt")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})", param="prompt")


def check_request_id(request_id: str, in_use: Container[str]) -> None:
    if request_id in in_use:
        raise RequestRejected(f"request id {request_id!r} is already in use")


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int | None) -> None:
    """The prompt and ``max_tokens`` fit the model's context; without ``max_tokens`` the context
    must still hold one output token."""
    if max_model_len is None:
        return
    n = num_prompt_tokens
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise RequestRejected(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{n} tokens and max_tokens is {max_tokens}", param="max_tokens")
    if n >= max_model_len:
        raise RequestRejected(
            f"the prompt has {n} tokens; this model's context length is {max_model_len}, "
            f"which must also hold at least one output token", param="prompt")


def check_kv_room(num_prompt_tokens: int, kv: KVPool) -> None:
    """The whole KV pool can hold the prompt and one output token."""
    if kv.blocks_for_tokens(num_prompt_tokens + 1) > kv.num_blocks:
        raise RequestRejected(
            f"the prompt has {num_prompt_tokens} tokens but the KV cache holds only "
            f"{kv.num_blocks * kv.block_size} tokens", param="prompt")


def validate_request(request_id: str, num_prompt_tokens: int, *, in_use: Container[str] = (),
                     max_model_len: int | None = None, kv: KVPool | None = None) -> None:
    """What an instance's scheduler checks of every request it admits (new, imported or moved),
    in this order: its id is free, its prompt leaves room in the context for one output token, its
    prompt fits the KV pool. ``max_tokens`` is the front doors' check (:func:`check_context`, in
    the engine and the simulator): the scheduler ends a request at the context (``length``).
    Raises :class:`RequestRejected`."""
    check_request_id(request_id, in_use)
    check_context(num_prompt_tokens, None, max_model_len)
    if kv is not None:
        check_kv_room(num_prompt_tokens, kv)
