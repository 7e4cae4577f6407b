"""``scheduling="prefill-first"`` (vLLM v0's default step): all prefills, each whole, or all decodes.

Driven by hand with ``tests.core.test_scheduler``'s ``Driver``, which checks every chunk against a
simulated paged KV store, so a prefill that skipped tokens or a lost token shows up there.
"""

from __future__ import annotations

import random

import pytest

from tests.core.test_scheduler import Driver, fake_token, make_request
from tidal.config import ConfigError, SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import StepResult
from tidal.core.scheduler import Scheduler


def make_pf(num_blocks=64, block_size=4, budget=32, max_seqs=8, mode="recompute", host_blocks=0,
            scheduling="prefill-first") -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, num_host_blocks=host_blocks)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, preemption_mode=mode,
                          scheduling=scheduling)
    return Scheduler(cfg, kv, watermark=0.0)


def kinds(plan) -> set[str]:
    return {"decode" if c.is_decode else "prefill" for c in plan.chunks}


def check_prefill_first(d: Driver) -> int:
    """Every plan is all prefills or all decodes, and every prefill is whole (from token 0 to the
    end of the known tokens, sampling the next); returns how many prefill steps ran."""
    n = 0
    for plan in d.plans:
        assert len(kinds(plan)) <= 1, f"step {plan.step_id} mixes prefill and decode: {plan.describe()}"
        if kinds(plan) == {"prefill"}:
            n += 1
            for c in plan.chunks:
                assert c.start == 0 and c.sample, (plan.step_id, c.request_id, c.start, c.num_tokens)
    return n


@pytest.mark.parametrize("mode,host", [("recompute", 0), ("swap", 64)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_never_mixes_prefill_and_decode(mode, host, seed):
    rng = random.Random(seed)
    # 24 blocks of 4 tokens = 96 tokens for requests of up to 24 + 20: the pool preempts
    d = Driver(make_pf(num_blocks=24, budget=32, max_seqs=6, mode=mode, host_blocks=host))
    for i in range(14):
        d.add(make_request(f"r{i}", rng.randint(1, 24), max_tokens=rng.randint(1, 20), arrival=i * 1e-3))
        if rng.random() < 0.5:
            d.step()
    d.run()
    assert d.sched.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert check_prefill_first(d) > 1
    for rid, req in d.added.items():  # every request ran to its max_tokens, token for token
        assert d.outputs[rid] == [fake_token(rid, i) for i in range(req.sampling_params.max_tokens)]


def test_prefills_go_first_and_stall_the_decodes():
    d = Driver(make_pf())
    d.add(make_request("a", 8, max_tokens=10))
    d.step()  # a's prefill
    d.step()  # a decodes
    d.add(make_request("b", 12, max_tokens=10))
    plan, _ = d.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("b", 12)]  # a waits a step
    plan, _ = d.step()
    assert sorted(c.request_id for c in plan.chunks) == ["a", "b"] and kinds(plan) == {"decode"}


def test_chunked_default_mixes_them():
    """The same arrivals under the default scheduling: b's prefill shares a step with a's decode."""
    d = Driver(make_pf(scheduling="chunked"))
    d.add(make_request("a", 8, max_tokens=10))
    d.step()
    d.step()
    d.add(make_request("b", 12, max_tokens=10))
    plan, _ = d.step()
    assert kinds(plan) == {"decode", "prefill"}


def test_a_recompute_runs_as_a_prefill_only_step():
    # 14 blocks of 4 tokens = 56 for three requests that grow to 20, 32 and 24 tokens: the pool preempts
    d = Driver(make_pf(num_blocks=14, budget=64))
    for i, (rid, n) in enumerate(zip("abc", (12, 24, 16), strict=True)):
        d.add(make_request(rid, 8, max_tokens=n, arrival=float(i)))
    d.run()
    pre = [i for i, p in enumerate(d.plans) if p.preempted]
    assert pre, "nothing was preempted"
    i = pre[0]
    victim = d.plans[i].preempted[0]
    assert victim == "c"  # the latest arrival
    assert kinds(d.plans[i]) == {"decode"}  # the preemption happens in a decode step
    # c comes back as one whole prefill of its prompt and every output it had, in a step of its own,
    # while b is still decoding (the chunked default runs b's decode in that step too)
    j = next(j for j in range(i + 1, len(d.plans)) if any(c.request_id == "c" for c in d.plans[j].chunks))
    (chunk,) = d.plans[j].chunks
    assert chunk.request_id == "c" and chunk.start == 0
    assert chunk.num_tokens == 8 + chunk.output_index > 8
    assert any(c.request_id == "b" and c.is_decode for p in d.plans[j + 1:] for c in p.chunks)
    assert d.outputs["c"] == [fake_token("c", k) for k in range(16)]
    check_prefill_first(d)


def test_a_prefill_longer_than_the_budget_runs_whole_and_alone():
    # driven by hand: the Driver asserts that a plan stays within the token budget
    sched = make_pf(num_blocks=64, budget=16)
    sched.add_request(make_request("small", 4, max_tokens=2))
    sched.add_request(make_request("long", 40, max_tokens=2, arrival=1.0))
    sched.add_request(make_request("late", 4, max_tokens=2, arrival=2.0))
    p1 = sched.schedule(0.0)
    assert [(c.request_id, c.num_tokens) for c in p1.chunks] == [("small", 4)]  # long does not fit beside it
    sched.update(p1, StepResult(p1.step_id, sampled={"small": 11}, step_time_s=0.0), 0.1)
    p2 = sched.schedule(0.1)
    assert [(c.request_id, c.num_tokens) for c in p2.chunks] == [("long", 40)]  # whole, over the budget, alone


def test_prefills_wait_while_a_request_is_swapped_out():
    sched = make_pf(num_blocks=64, mode="swap", host_blocks=16)
    d = Driver(sched)
    d.add(make_request("a", 8, max_tokens=30))
    d.step()
    d.step()
    # swap a out by hand, as a decode step's preemption would
    sched._preempt(sched.running[0], [])
    assert sched.swapped
    d.add(make_request("b", 8, max_tokens=4))
    plan = sched.schedule(d.now)
    assert [c.request_id for c in plan.chunks] == ["a"] and kinds(plan) == {"decode"}


def test_config_checks():
    with pytest.raises(ConfigError, match="scheduling must be one of"):
        SchedulerConfig(scheduling="fcfs")
    with pytest.raises(ConfigError, match="prefill-first"):
        SchedulerConfig(scheduling="prefill-first", long_prefill_token_threshold=64)
