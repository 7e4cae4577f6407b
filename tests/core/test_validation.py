"""tidal.core.validation: the one place a request is refused, its checks and their order."""

from __future__ import annotations

import pytest

from tidal.core.kv_manager import KVCacheManager
from tidal.core.scheduler import RequestRejected as SchedulerRequestRejected
from tidal.core.validation import (
    RequestRejected,
    check_context,
    check_kv_room,
    check_prompt_tokens,
    check_request_id,
    validate_request,
)


def _msg(fn, *args, **kwargs) -> tuple[str, str | None]:
    with pytest.raises(RequestRejected) as e:
        fn(*args, **kwargs)
    return str(e.value), e.value.param


def test_each_check_refuses_with_its_message_and_param():
    assert _msg(check_prompt_tokens, [], 10) == ("the prompt is empty", "prompt")
    assert _msg(check_prompt_tokens, [3, 10], 10) == ("prompt token ids must be in [0, 10)", "prompt")
    assert _msg(check_prompt_tokens, [-1], 10)[1] == "prompt"
    check_prompt_tokens([0, 9], 10)
    assert _msg(check_request_id, "a", {"a"}) == ("request id 'a' is already in use", None)
    check_request_id("b", {"a"})
    assert _msg(check_context, 10, 7, 16) == (
        "this model's maximum context length is 16 tokens; the prompt has 10 tokens and max_tokens is 7", "max_tokens")
    check_context(10, 6, 16)  # exactly the context
    assert _msg(check_context, 16, None, 16)[1] == "prompt"
    assert "must also hold at least one output token" in _msg(check_context, 16, None, 16)[0]
    check_context(15, None, 16)
    check_context(10**6, 10**6, None)  # no context limit
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 24 tokens
    assert _msg(check_kv_room, 24, kv) == ("the prompt has 24 tokens but the KV cache holds only 24 tokens", "prompt")
    check_kv_room(23, kv)


def test_validate_request_checks_id_then_context_then_kv():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    # all three wrong: the id is named first, then the context, then the pool
    assert "already in use" in _msg(validate_request, "a", 40, in_use={"a"}, max_model_len=16, kv=kv)[0]
    assert "context length is 16" in _msg(validate_request, "b", 40, in_use={"a"}, max_model_len=16, kv=kv)[0]
    assert "KV cache holds only 8" in _msg(validate_request, "b", 12, in_use={"a"}, max_model_len=16, kv=kv)[0]
    validate_request("b", 7, in_use={"a"}, max_model_len=16, kv=kv)


def test_the_scheduler_raises_the_same_class():
    assert SchedulerRequestRejected is RequestRejected and issubclass(RequestRejected, ValueError)
