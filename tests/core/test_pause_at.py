"""``Request.pause_at``: DynaServe's alpha micro-request stops once its split point has KV.

The scheduler never computes KV past ``pause_at`` (a prefill chunk is cut there and samples
nothing when the split is inside the prompt), pauses the request holding its blocks, and lists it
once in ``drain_reached_pause``; resumed, the request continues as if it had never stopped.
"""

from __future__ import annotations

import pytest

from tests.core.test_scheduler import Driver, make_request, make_scheduler
from tidal.core.plan import StepResult


def _run_until_paused(d: Driver, rid: str, limit: int = 200) -> list[str]:
    for _ in range(limit):
        d.step()
        got = d.sched.drain_reached_pause()
        if got:
            return got
    raise AssertionError(f"{rid} never paused")


@pytest.mark.parametrize("split", [1, 7, 12, 13, 14, 20])
def test_pause_at_stops_at_the_split_and_resumes_to_the_same_tokens(split):
    prompt_len, max_tokens = 13, 12
    ref = Driver(make_scheduler(budget=5))
    ref.add(make_request("r", prompt_len, max_tokens))
    while ref.sched.has_unfinished():
        ref.step()

    d = Driver(make_scheduler(budget=5))
    req = d.add(make_request("r", prompt_len, max_tokens))
    req.pause_at = split
    assert _run_until_paused(d, "r") == ["r"]
    assert req.num_computed_tokens == split  # never past the split point
    # inside the prompt nothing was sampled; at or past its end, split - P + 1 tokens were
    assert len(d.outputs["r"]) == max(0, split - prompt_len + 1)
    assert max(c.start + c.num_tokens for p in d.plans for c in p.chunks) == split
    assert "r" in d.sched.paused and not d.sched.has_runnable()
    assert d.sched.kv.num_blocks_of("r") == d.sched.kv.blocks_for_tokens(split)  # it holds its KV
    # a paused request is never scheduled
    plan = d.sched.schedule(d.now)
    assert not plan.chunks
    d.sched.update(plan, StepResult(plan.step_id), d.now)
    d.sched.resume("r")
    while d.sched.has_unfinished():
        d.step()
    assert d.outputs["r"] == ref.outputs["r"]
    assert d.sched.drain_reached_pause() == []  # once only
    assert d.sched.kv.num_free_blocks == d.sched.kv.num_blocks


def test_a_request_that_finishes_before_its_split_never_pauses():
    d = Driver(make_scheduler(budget=8))
    req = d.add(make_request("r", 6, max_tokens=3))
    req.pause_at = 50  # beyond prompt + max_tokens
    while d.sched.has_unfinished():
        d.step()
    assert d.sched.drain_reached_pause() == []
    assert len(d.outputs["r"]) == 3


def test_pause_at_cuts_only_its_own_request_and_other_requests_keep_running():
    d = Driver(make_scheduler(budget=16))
    a = d.add(make_request("a", 10, 4))
    a.pause_at = 4
    d.add(make_request("b", 10, 4))
    d.step()
    first = {c.request_id: c.num_tokens for c in d.plans[0].chunks}
    assert first == {"a": 4, "b": 10}
    assert d.sched.drain_reached_pause() == ["a"]
    while d.sched.has_runnable():
        d.step()
    assert len(d.outputs["b"]) == 4 and d.outputs["a"] == []
    d.sched.abort_requests(["a"])  # a paused request can be aborted and frees its blocks
    assert d.sched.kv.num_free_blocks == d.sched.kv.num_blocks


def test_a_resumed_decode_goes_ahead_of_a_running_chunked_prefill():
    # "long" is chunked over many steps by an 8-token budget; "h" lands (resumes) meanwhile with
    # only its decode left: it must get its token in the very next step, not after the prefill
    d = Driver(make_scheduler(num_blocks=128, budget=8))
    h = d.add(make_request("h", 4, 6))
    h.pause_at = 4
    _run_until_paused(d, "h")
    d.add(make_request("long", 60, 2))
    d.step()
    assert [c.request_id for c in d.plans[-1].chunks] == ["long"] and d.plans[-1].chunks[0].num_tokens == 8
    d.sched.resume("h")
    assert [r.request_id for r in d.sched.running] == ["h", "long"]
    d.step()
    assert {c.request_id: c.num_tokens for c in d.plans[-1].chunks} == {"h": 1, "long": 7}
    # a resumed request with a prompt left (beta continuing a prefill) goes last, as a new one would
    d2 = Driver(make_scheduler(num_blocks=128, budget=8))
    a = d2.add(make_request("a", 20, 2))
    a.pause_at = 5
    _run_until_paused(d2, "a")
    d2.add(make_request("b", 4, 8))
    d2.step()
    d2.sched.resume("a")
    assert [r.request_id for r in d2.sched.running] == ["b", "a"]


def test_every_sampled_token_stamps_last_token_time():
    d = Driver(make_scheduler(budget=16))
    r = d.add(make_request("r", 5, 3))
    times = []
    while d.sched.has_unfinished():
        d.now += 0.5
        d.step()
        times.append(d.now)
    assert r.first_token_time == times[0] and r.last_token_time == times[-1] != times[0]
