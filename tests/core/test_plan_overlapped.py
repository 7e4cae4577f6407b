"""Scheduler.plan_overlapped: the decode step after one still running, planned before its tokens are known
(--async-scheduling). Driven as the engine drives it -- plan the next step, then apply the one in flight --
the requests get the synchronous scheduler's tokens and finishes, and every block comes back."""

from __future__ import annotations

import random
import zlib

import pytest

from tests.core.test_scheduler import Driver, fake_token, make_request, make_scheduler
from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import PENDING_TOKEN, StepResult
from tidal.core.policy import SchedulingPolicy, StepCaps
from tidal.core.scheduler import Scheduler


def _overlappable(plan) -> bool:
    return bool(plan.chunks) and not plan.swap_out and not plan.swap_in and all(
        c.is_decode and c.sample for c in plan.chunks)


def run_overlapped(sched: Scheduler, reqs, token_fn, abort_at: dict[int, str] | None = None):
    """The engine's loop (EngineCore.step) with a fabricated executor; returns the outputs, the finishes
    and how many steps were planned ahead (in all, and while requests waited)."""
    outputs = {r.request_id: [] for r in reqs}
    finish = {}
    for r in reqs:
        sched.add_request(r)
    inflight, now, ahead, steps, queued = None, 0.0, 0, 0, 0
    while sched.has_unfinished() or inflight is not None:
        steps += 1
        assert steps < 5000
        if abort_at and steps in abort_at:
            sched.abort_requests([abort_at[steps]])
        if inflight is None:
            plan = sched.schedule(now)
            if not _overlappable(plan):
                inflight, nxt = plan, None
            else:
                inflight = plan
                nxt = sched.plan_overlapped(plan)
        else:
            nxt = sched.plan_overlapped(inflight)
        if nxt is not None:
            ahead += 1
            queued += bool(sched.waiting)
            before = {c.request_id: c for c in inflight.chunks}
            for c in nxt.chunks:
                assert c.token_ids == (PENDING_TOKEN,) and c.sample
                assert c.start == before[c.request_id].start + 1
                assert c.output_index == before[c.request_id].output_index + 1
                assert len(c.block_table) * sched.kv.block_size > c.start  # its slot is allocated
        sampled = {c.request_id: token_fn(c.request_id, c.output_index) for c in inflight.chunks if c.sample}
        now += 0.01
        for u in sched.update(inflight, StepResult(inflight.step_id, sampled=sampled), now):
            outputs[u.request_id].extend(u.new_token_ids)
            if u.finished:
                finish[u.request_id] = (u.finish_reason, u.stop_reason)
        sched.kv.check_invariants()
        inflight = nxt
    return outputs, finish, (ahead, queued)


def eos_sometimes(rid: str, index: int) -> int:
    return 3 if (zlib.crc32(rid.encode()) + index) % 7 == 0 else fake_token(rid, index)  # EOS (3) now and then


def _requests(rng: random.Random, n: int):
    return [make_request(f"r{i}", rng.randint(1, 12), max_tokens=rng.randint(1, 14), eos=(3,),
                         arrival=i * 0.001, **({"stop_token_ids": [fake_token(f"r{i}", 4)]} if i % 4 == 0 else {}))
            for i in range(n)]


def _compare(reqs, num_blocks: int, max_seqs: int, token_fn=None, make=make_scheduler) -> int:
    """The overlapped loop against the synchronous one on ``reqs()``'s requests; returns the steps planned
    ahead while requests waited."""
    want = Driver(make(num_blocks=num_blocks, max_seqs=max_seqs))
    for r in reqs():
        want.add(r)
    token_fn = token_fn or eos_sometimes
    want.run(token_fn=token_fn)
    sched = make(num_blocks=num_blocks, max_seqs=max_seqs)
    outputs, finish, (ahead, queued) = run_overlapped(sched, reqs(), token_fn)
    assert outputs == want.outputs and finish == want.finish
    assert ahead > 0
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.requests
    return queued


@pytest.mark.parametrize("seed", range(6))
def test_the_synchronous_schedulers_tokens_and_finishes(seed):
    blocks = random.Random(seed).choice([7, 9, 64])  # tight pools: some steps cannot be planned ahead, some preempt
    _compare(lambda: _requests(random.Random(seed), 10), blocks, 6)


@pytest.mark.parametrize("seed", range(3))
def test_steps_are_planned_ahead_while_requests_wait_for_a_seat(seed):
    """A queue longer than the seats: while every seat stays taken, waiting requests change nothing; a seat
    an EOS frees is taken a step later than the synchronous scheduler takes it, with the same tokens."""
    def reqs():
        rng = random.Random(seed)
        return [make_request(f"q{i}", rng.randint(1, 12), max_tokens=rng.randint(8, 30), eos=(3,)) for i in range(16)]

    def eos_rarely(rid: str, index: int) -> int:
        return 3 if (zlib.crc32(rid.encode()) + index) % 23 == 0 else fake_token(rid, index)

    assert _compare(reqs, 64, 4, eos_rarely) > 10


def _prefill_first(num_blocks, max_seqs):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=32, scheduling="prefill-first"),
                     kv, watermark=0.0)


def _cached_with_host_tier(num_blocks, max_seqs):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, num_host_blocks=16, enable_caching=True, host_tier=True)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=32), kv, watermark=0.0)


@pytest.mark.parametrize("make", [_prefill_first, _cached_with_host_tier])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_first_steps_and_a_prefix_cache_with_a_host_tier(make, seed):
    def reqs():  # a shared 2-block head, so the cache hits (and, in a small pool, evicts to the host tier)
        rng = random.Random(seed)
        out = []
        for i in range(12):
            r = make_request(f"s{i}", rng.randint(2, 10), max_tokens=rng.randint(3, 16), eos=(3,))
            r.prompt_token_ids[:0] = range(5000, 5008)
            out.append(r)
        return out

    _compare(reqs, 12, 4, make=make)
    sched = make(12, 4)
    run_overlapped(sched, reqs(), eos_sometimes)
    if sched.kv.enable_caching:
        assert sched.prefix_hits > 0


def test_an_abort_while_the_step_after_is_planned():
    sched = make_scheduler()
    reqs = [make_request(f"r{i}", 5, max_tokens=10) for i in range(3)]
    outputs, finish, (ahead, _) = run_overlapped(sched, reqs, fake_token, abort_at={5: "r1"})
    assert len(outputs["r1"]) < 10 and "r1" not in finish and "r1" not in sched.requests  # no token after it
    assert all(outputs[r] == [fake_token(r, i) for i in range(10)] for r in ("r0", "r2"))
    assert ahead > 0 and sched.kv.num_free_blocks == sched.kv.num_blocks


def _decoding(sched: Scheduler, n: int = 3, **kw):
    d = Driver(sched)
    for i in range(n):
        d.add(make_request(f"r{i}", 4, **kw))
    d.step()  # the prefills
    plan = sched.schedule(1.0)
    assert _overlappable(plan)
    return d, plan


def test_with_every_seat_taken_a_waiting_request_changes_nothing():
    sched = make_scheduler(max_seqs=3)
    _, plan = _decoding(sched)
    sched.add_request(make_request("late", 4))
    nxt = sched.plan_overlapped(plan)  # schedule would admit nobody either: no seat
    assert [c.request_id for c in nxt.chunks] == [c.request_id for c in plan.chunks]


def test_a_request_whose_length_ends_in_flight_sits_out():
    sched = make_scheduler()
    d = Driver(sched)
    d.add(make_request("short", 4, max_tokens=2))
    d.add(make_request("long", 4, max_tokens=9))
    d.step()
    nxt = sched.plan_overlapped(sched.schedule(1.0))  # "short" samples its 2nd and last token there
    assert [c.request_id for c in nxt.chunks] == ["long"]


def test_nothing_is_planned_ahead_when_the_schedule_must_decide():
    # a request waiting while a seat is free
    sched = make_scheduler()
    _, plan = _decoding(sched)
    sched.add_request(make_request("late", 4))
    assert sched.plan_overlapped(plan) is None
    # every seat taken, but one frees: its request's length ends in the step in flight
    sched = make_scheduler(max_seqs=3)
    d = Driver(sched)
    for i, n in enumerate((16, 16, 2)):
        d.add(make_request(f"r{i}", 4, max_tokens=n))
    d.step()
    plan = sched.schedule(1.0)
    sched.add_request(make_request("late", 4))
    assert sched.plan_overlapped(plan) is None
    # a policy that decides each step
    class Capping(SchedulingPolicy):
        def plan_step(self, view):
            return StepCaps(2, 64)

    sched = make_scheduler()
    sched.policy, sched._passive = Capping(), False
    _, plan = _decoding(sched, n=2)
    assert sched.plan_overlapped(plan) is None
    # a running request the plan left out
    sched = make_scheduler()
    _, plan = _decoding(sched)
    assert sched.plan_overlapped(plan.__class__(plan.step_id, plan.chunks[:2], plan.composition)) is None


def test_blocks_short_plan_nothing_and_allocate_nothing():
    sched = make_scheduler(num_blocks=5, block_size=4)
    d = Driver(sched)
    for i in range(3):
        d.add(make_request(f"r{i}", 3))  # a block each; the decode at position 3 fills it
    d.step()
    plan = sched.schedule(1.0)
    assert _overlappable(plan) and sched.kv.num_free_blocks == 2
    step = sched._step_id
    assert sched.plan_overlapped(plan) is None  # position 4 needs a new block each: 3 > 2
    assert sched.kv.num_free_blocks == 2 and sched._step_id == step
    sched.kv.free("r2")  # (as if it had finished) now the two left fit
    sched.running.remove(sched.requests.pop("r2"))
    nxt = sched.plan_overlapped(plan)
    assert [c.start for c in nxt.chunks] == [4, 4] and sched.kv.num_free_blocks == 1
