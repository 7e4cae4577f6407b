"""One bad request, refused with the same message by the engine, its scheduler and the simulator
(each calls tidal.core.validation)."""

from __future__ import annotations

import pytest

from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.core.validation import RequestRejected

L = 64  # the context of every shell here


@pytest.fixture(scope="module")
def engine(make_tiny_engine):
    return make_tiny_engine(max_model_len=L, num_blocks_override=8, block_size=4)  # 32 tokens of KV


def _engine_msg(engine, prompt_len: int, max_tokens: int | None) -> str:
    with pytest.raises(RequestRejected) as e:
        engine.add_request("x", None, SamplingParams(max_tokens=max_tokens), prompt_token_ids=[5] * prompt_len)
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return str(e.value)


def _scheduler_msg(prompt_len: int, max_tokens: int | None) -> str:
    s = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=8, block_size=4), max_model_len=L)
    with pytest.raises(RequestRejected) as e:
        s.add_request(Request("x", [5] * prompt_len, SamplingParams(max_tokens=max_tokens)))
    return str(e.value)


def _sim_msg(monkeypatch, prompt_len: int, max_tokens: int) -> str:
    from tests.sim.test_disaggregated import Constant
    from tidal.cluster.router import build_router
    from tidal.sim.instance import SimInstance
    from tidal.sim.simulator import ClusterSimulator
    from tidal.workload import RequestSpec

    said = []
    refuse = ClusterSimulator._refuse
    monkeypatch.setattr(ClusterSimulator, "_refuse", lambda self, rec, now, error: (said.append(error),
                                                                                   refuse(self, rec, now, error))[1])
    inst = SimInstance(0, SchedulerConfig(), 8, 4, Constant(), L)
    res = ClusterSimulator([inst], build_router("round-robin"), [RequestSpec(0.0, prompt_len, max_tokens)],
                           max_model_len=L).run()
    assert not res.records[0].success and res.records[0].status == 400
    (error,) = said
    kind, _, message = error.partition(": ")
    assert res.records[0].error == kind
    return message


def test_max_tokens_past_the_context(engine, monkeypatch):
    msg = "this model's maximum context length is 64 tokens; the prompt has 10 tokens and max_tokens is 60"
    assert _engine_msg(engine, 10, 60) == msg
    assert _sim_msg(monkeypatch, 10, 60) == msg


def test_a_prompt_that_fills_the_context(engine):
    msg = _scheduler_msg(L, None)
    assert "the prompt has 64 tokens; this model's context length is 64" in msg
    assert _engine_msg(engine, L, None) == msg


def test_a_prompt_larger_than_the_kv_pool(engine, monkeypatch):
    msg = "the prompt has 40 tokens but the KV cache holds only 32 tokens"
    assert _scheduler_msg(40, None) == msg
    assert _engine_msg(engine, 40, 4) == msg
    assert _sim_msg(monkeypatch, 40, 4) == msg


def test_a_duplicate_id(engine):
    engine.add_request("dup", None, SamplingParams(max_tokens=2), prompt_token_ids=[5] * 4)
    try:
        with pytest.raises(RequestRejected, match="request id 'dup' is already in use"):
            engine.add_request("dup", None, SamplingParams(max_tokens=2), prompt_token_ids=[5] * 4)
    finally:
        engine.abort_request("dup")
    s = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks=8, block_size=4), max_model_len=L)
    s.add_request(Request("dup", [5] * 4, SamplingParams(max_tokens=2)))
    with pytest.raises(RequestRejected, match="request id 'dup' is already in use"):
        s.add_request(Request("dup", [5] * 4, SamplingParams(max_tokens=2)))
