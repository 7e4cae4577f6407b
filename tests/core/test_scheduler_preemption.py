"""The Scheduler under KV pressure, driven by hand (test_scheduler's ``Driver``: no torch, no model):
recompute and swap preemption, the victim's priority, the host pool, requests that outgrow the pool."""

from __future__ import annotations

import pytest

from tests.core.test_scheduler import Driver, chunks_of, fake_token, make_request, make_scheduler
from tidal.core.request import FinishReason, RequestStatus
from tidal.core.scheduler import RequestRejected


def _two_request_pressure(mode: str, host_blocks: int = 8, budget: int = 64, prio_a=0, prio_b=0):
    """6 blocks of 4 tokens; a (arrival 0) and b (arrival 1) each start with 2 blocks and grow
    one block every 4 decodes, so the pool runs dry while both run."""
    s = make_scheduler(num_blocks=6, block_size=4, budget=budget, mode=mode, host_blocks=host_blocks)
    d = Driver(s)
    a = d.add(make_request("a", 8, max_tokens=8, arrival=0.0, priority=prio_a))
    b = d.add(make_request("b", 8, max_tokens=14, arrival=1.0, priority=prio_b))
    return s, d, a, b


def _step_until_preempted(d: Driver):
    for _ in range(50):
        plan, _ = d.step()
        if plan.preempted:
            return plan
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize("budget", [64, 5])
def test_recompute_preemption_victim_requeues_and_resumes_with_outputs(budget):
    s, d, a, b = _two_request_pressure("recompute", budget=budget)
    plan = _step_until_preempted(d)
    assert plan.preempted == ("b",)  # the latest arrival loses its blocks
    assert plan.swap_out == ()
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert s.waiting[0] is b and not s.kv.has("b")
    kept = list(b.output_token_ids)
    assert kept and kept == [fake_token("b", i) for i in range(len(kept))]
    # run until b samples again: its chunks redo prompt + outputs from 0, sampling only at the end
    b_chunks = []
    for _ in range(100):
        plan, _ = d.step()
        b_chunks += chunks_of(plan, "b")
        if b_chunks and b_chunks[-1].sample:
            break
    assert b_chunks[0].start == 0
    assert [c.sample for c in b_chunks] == [False] * (len(b_chunks) - 1) + [True]
    pos = 0
    for c in b_chunks:
        assert c.start == pos
        pos += c.num_tokens
    assert pos == 8 + len(kept)
    assert b_chunks[-1].output_index == len(kept)
    assert d.outputs["b"][:len(kept)] == kept
    d.run()
    assert d.outputs["a"] == [fake_token("a", i) for i in range(8)]
    assert d.outputs["b"] == [fake_token("b", i) for i in range(14)]
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_preemption_victim_is_the_lowest_priority_not_the_latest():
    # a has the larger priority value (runs later), so a is the victim although b arrived later
    s, d, a, b = _two_request_pressure("recompute", prio_a=1, prio_b=0)
    plan = _step_until_preempted(d)
    assert plan.preempted == ("a",)
    assert a.status is RequestStatus.WAITING and b.status is RequestStatus.RUNNING
    d.run()
    assert d.outputs["a"] == [fake_token("a", i) for i in range(8)]


def test_swap_preemption_swaps_out_then_in_and_keeps_computed_tokens():
    s, d, a, b = _two_request_pressure("swap", host_blocks=8)
    plan = _step_until_preempted(d)
    assert plan.preempted == ("b",)
    assert b.status is RequestStatus.SWAPPED and s.swapped == [b]
    computed = b.num_computed_tokens
    assert computed > 8
    # the head of the queue is the swapped request: it needs its host blocks back (the one
    # definition the runtime's status and the simulator's monitor both report)
    assert s.hol_block_demand() == s.kv.num_host_blocks_of("b") == -(-computed // 4)
    assert s.queued_block_demand() == 0  # nothing waits
    nblocks = s.kv.blocks_for_tokens(computed)
    assert len(plan.swap_out) == nblocks
    assert s.kv.num_host_blocks_of("b") == nblocks
    assert sorted(h for _, h in plan.swap_out) == list(range(nblocks))
    n_out = len(d.outputs["b"])
    swap_in_plan = None
    for _ in range(50):
        plan, _ = d.step()
        if plan.swap_in:
            swap_in_plan = plan
            break
        assert not chunks_of(plan, "b")
        assert b.num_computed_tokens == computed
    assert swap_in_plan is not None
    assert [h for h, _ in swap_in_plan.swap_in] == [h for _, h in _swap_out_pairs(d, "b")]
    assert b.status is RequestStatus.RUNNING
    (c,) = chunks_of(swap_in_plan, "b")
    assert (c.start, c.num_tokens, c.sample, c.output_index) == (computed, 1, True, n_out)
    assert s.kv.host_pool.num_free == s.kv.host_pool.num_blocks
    d.run()
    assert d.outputs["b"] == [fake_token("b", i) for i in range(14)]
    assert b.num_preemptions == 1


def _swap_out_pairs(d: Driver, rid: str):
    for plan in d.plans:
        if rid in plan.preempted and plan.swap_out:
            return plan.swap_out
    return ()


def test_swap_falls_back_to_recompute_when_host_pool_is_too_small():
    s, d, a, b = _two_request_pressure("swap", host_blocks=1)
    plan = _step_until_preempted(d)
    assert plan.preempted == ("b",) and plan.swap_out == ()
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    d.run()
    assert d.outputs["b"] == [fake_token("b", i) for i in range(14)]


def test_swapped_requests_resume_before_waiting_ones_are_admitted():
    s, d, a, b = _two_request_pressure("swap", host_blocks=8)
    _step_until_preempted(d)
    d.add(make_request("c", 2, max_tokens=1, arrival=-1.0))  # would be first in the waiting order
    first_c = first_b = None
    for i in range(200):
        plan, _ = d.step()
        if first_b is None and chunks_of(plan, "b"):
            first_b = i
        if first_c is None and chunks_of(plan, "c"):
            first_c = i
        if not s.has_unfinished():
            break
    assert first_b is not None and first_c is not None and first_b <= first_c


# ============================================================================ admission


def test_too_long_requests_are_rejected_at_add_time():
    s = make_scheduler(num_blocks=6, block_size=4, max_model_len=16)
    with pytest.raises(RequestRejected) as e:
        s.add_request(make_request("a", 16))
    assert e.value.param == "prompt"
    s.add_request(make_request("b", 15))
    with pytest.raises(RequestRejected):
        s.add_request(make_request("b", 3))  # duplicate id
    s2 = make_scheduler(num_blocks=6, block_size=4)  # 24 tokens in the whole pool
    with pytest.raises(RequestRejected) as e:
        s2.add_request(make_request("big", 24))
    assert e.value.param == "prompt"
    s2.add_request(make_request("fits", 23))
    assert set(s.requests) == {"b"} and set(s2.requests) == {"fits"}
    assert not s2.kv.has("big")


def test_request_outgrowing_the_whole_pool_finishes_with_length():
    s = make_scheduler(num_blocks=4, block_size=4, budget=32)  # 16 tokens in all
    d = Driver(s)
    r = d.add(make_request("a", 8, max_tokens=100))
    d.run(max_steps=100)
    assert r.finish_reason is FinishReason.LENGTH and r.status is RequestStatus.FINISHED
    # the cache holds 16 tokens: prompt 8 + 8 outputs cached, and the 9th sampled from them
    assert len(d.outputs["a"]) == 9
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert d.plans[-1].finished == ("a",) and d.plans[-1].is_empty  # ended inside schedule()


def test_pool_length_finish_is_reported_through_update():
    """A finish decided inside schedule() must reach the output side like any other: the engine
    only learns of finishes from RequestUpdates (LLMEngine._process), so without one it keeps the
    request forever and LLM.generate never returns."""
    s = make_scheduler(num_blocks=4, block_size=4, budget=32)
    d = Driver(s)
    d.add(make_request("a", 8, max_tokens=100))
    d.run(max_steps=100)
    d.step()  # one more round trip in case the report is deferred to the next update
    assert d.finish.get("a") == ("length", None)


def test_lone_request_growing_past_pool_with_others_waiting():
    s = make_scheduler(num_blocks=4, block_size=4, budget=32, max_seqs=1)
    d = Driver(s)
    d.add(make_request("a", 8, max_tokens=100))
    d.add(make_request("b", 4, max_tokens=3, arrival=1.0))
    d.run(max_steps=200)
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert len(d.outputs["b"]) == 3


def test_recompute_victim_is_readmitted_despite_the_watermark():
    """r (low priority) grows to most of the pool; s arrives, and when the pool runs dry r is the
    victim. Back in the queue, r's prompt+outputs need more blocks than ``num_blocks - reserve``,
    so the watermarked admission can never take it, even with the pool empty: a livelock."""
    s = make_scheduler(num_blocks=10, block_size=4, budget=64, watermark=0.2)  # reserve = 2 blocks
    d = Driver(s)
    r = d.add(make_request("r", 4, max_tokens=36, arrival=0.0, priority=1))  # 39 tokens fit 40 alone
    for _ in range(21):
        d.step()
    d.add(make_request("s", 1, max_tokens=16, arrival=1.0, priority=0))
    d.run(max_steps=300)
    assert r.num_preemptions >= 1
    assert d.outputs["r"] == [fake_token("r", i) for i in range(36)]


