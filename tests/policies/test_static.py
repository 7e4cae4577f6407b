"""``static``: run-to-completion batches, driven through the real Scheduler with fabricated step
results (no torch, no model), and the padding a real static batch would have (BucketServe Eq. 2)."""

from __future__ import annotations

import random

import pytest

from tests.policies.drive import admitted, step
from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.policies.static import StaticPolicy, static_padding


def req(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0, priority: int = 0) -> Request:
    return Request(rid, [100 + i % 50 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, priority=priority)


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 256, max_seqs: int = 2,
         mode: str = "recompute", pad: bool = False) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, batching="static",
                          preemption_mode=mode, policy_args={"static.pad": pad} if pad else {})
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), policy=build_policy(cfg), watermark=0.0)


def test_static_padding_eq2_by_hand():
    # prompts 4 and 8, outputs 2 and 6: rows padded to 8 + 6 = 14; used 6 + 14 = 20 of 28
    waste, padded = static_padding([4, 8], [2, 6])
    assert waste == pytest.approx(8 / 28) and padded == 8
    # the same as Eq. 2 with S_max = the padded length: (14 - 10) / 14
    assert waste == pytest.approx((14 - 10) / 14)
    assert static_padding([5, 5], [3, 3]) == (0.0, 0)
    assert static_padding([], []) == (0.0, 0)


def test_no_request_joins_a_running_batch_and_the_next_forms_after_all_finished():
    s = make(max_seqs=2)
    assert isinstance(s.policy, StaticPolicy)
    s.add_request(req("a", 4, max_tokens=2, arrival=0.0))
    s.add_request(req("b", 8, max_tokens=6, arrival=1.0))
    s.add_request(req("c", 4, max_tokens=2, arrival=2.0))
    s.add_request(req("d", 4, max_tokens=2, arrival=3.0))
    plans = []
    for i in range(40):
        if not s.has_unfinished():
            break
        plans.append(step(s, float(i)))
    adm = [admitted(p) for p in plans]
    assert adm[0] == ["a", "b"]
    # a finishes after 2 steps and frees a slot, yet c waits until b (6 tokens) is done too
    b_last = max(i for i, p in enumerate(plans) if any(c.request_id == "b" for c in p.chunks))
    assert b_last == 5 and all(a == [] for a in adm[1:b_last + 1])
    assert adm[b_last + 1] == ["c", "d"]
    st = s.policy.state()
    assert st.num_batches == 2 and st.completed_batches == 2 and not st.batch_active
    # batch 1: prompts (4, 8), outputs (2, 6) -> 8/28; batch 2: (4, 4), (2, 2) -> 0
    assert st.padding_waste == 0.0
    assert st.padding_waste_mean == pytest.approx((8 / 28 + 0.0) / 2)


def test_padded_mode_puts_the_rectangle_in_the_plan():
    s = make(max_seqs=2, pad=True)
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 8, max_tokens=6))
    plans = []
    while s.has_unfinished():
        plans.append(step(s))
    pads = [p.composition.num_padded_tokens for p in plans]
    # prefill: 2 rows x 8 = 16 tokens for 4 + 8 real; then a decode each (2 x 1, no padding); once a
    # finished (after its 2nd token), b decodes on with a's dead row: 1 padded token per step
    assert pads[0] == 4 and pads[1] == 0
    assert pads[2:] == [1] * (len(plans) - 2) and len(plans) == 6
    # off (the default): nothing is padded
    s = make(max_seqs=2)
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 8, max_tokens=6))
    assert step(s).composition.num_padded_tokens == 0


def test_padding_of_the_running_batch_is_reported():
    s = make(max_seqs=2)
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 8, max_tokens=6))
    step(s)  # both prefilled, one output token each: S_pad = 8 + 1, used 5 + 9 of 18
    st = s.policy.state()
    assert st.batch_active and st.batch_size == 2 and st.batch_unfinished == 2
    assert st.padding_waste == pytest.approx(4 / 18) and st.padded_tokens == 4
    assert st.completed_batches == 0 and st.padding_waste_mean == 0.0


def test_a_batch_cut_by_the_token_budget_keeps_forming_but_admits_no_outsider():
    s = make(max_seqs=3, budget=8)
    for i in range(3):
        s.add_request(req(f"m{i}", 6, max_tokens=3, arrival=float(i)))
    p1 = step(s)
    assert admitted(p1) == ["m0", "m1"]  # m0 whole, m1's first 2-token chunk: the budget is spent
    s.add_request(req("x", 2, max_tokens=1, arrival=10.0, priority=-5))  # urgent, but not a member
    p2 = step(s, 1.0)
    assert admitted(p2) == ["m2"]  # the last member still joins while the batch forms
    seen_x = None
    for i in range(2, 40):
        plan = step(s, float(i))
        if "x" in admitted(plan):
            seen_x = i
            break
        assert s.policy.state().batch_active or not s.running
    assert seen_x is not None
    assert all(s.requests.get(f"m{i}") is None for i in range(3))  # every member had finished


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_only_batch_members_ever_run_together_under_preemption(seed, mode):
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, batching="static", preemption_mode=mode)
    kv = KVCacheManager(num_blocks=12, block_size=4, num_host_blocks=32)
    s = Scheduler(cfg, kv, policy=build_policy(cfg), watermark=0.0)
    pending = [(rng.randint(0, 30), req(f"q{i}", rng.randint(1, 16), max_tokens=rng.randint(1, 20),
                                        arrival=float(i))) for i in range(14)]
    pending.sort(key=lambda x: x[0])
    pol = s.policy
    t = 0
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= t:
            s.add_request(pending.pop(0)[1])
        step(s, float(t))
        members = {r.request_id for r in pol.members}
        assert {r.request_id for r in s.running} <= members
        t += 1
        assert t < 2000, "livelock"
    assert pol.state().completed_batches == pol.state().num_batches >= 1
    assert kv.num_free_blocks == kv.num_blocks
    assert s.num_preemptions > 0  # the tight pool did preempt members


def test_length_grouping_takes_the_oldest_and_its_nearest_lengths():
    """``static.group=length`` (UELLM's length-grouped batches): the oldest waiting request anchors
    the batch, the others are the closest to it in prompt + max_tokens; FCFS takes the first ones."""
    lengths = [(40, 10), (400, 100), (45, 12), (390, 120), (38, 9), (200, 50)]
    for group, expected in (("fcfs", {"r0", "r1", "r2"}), ("length", {"r0", "r2", "r4"})):
        cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=4096, batching="static",
                              policy_args={"static.group": group})
        s = Scheduler(cfg, KVCacheManager(1024, 4), policy=build_policy(cfg), watermark=0.0)
        for i, (p, o) in enumerate(lengths):
            s.add_request(req(f"r{i}", p, o, arrival=i * 0.01))
        plan = s.schedule(1.0)
        assert {c.request_id for c in plan.chunks} == expected, group
    with pytest.raises(ValueError):
        build_policy(SchedulerConfig(batching="static", policy_args={"static.group": "random"}))
