"""``bucket`` (BucketServe Alg. 1, Eq. 1-6): the formulas by hand, then the policy driven through
the real Scheduler with fabricated step results (no torch, no model)."""

from __future__ import annotations

import pytest

from tests.policies.bucket_reference import adjust_buckets, assign, max_safe_batch_size
from tests.policies.drive import admitted, step
from tidal.config import ConfigError, ModelArch, SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan, StepResult
from tidal.core.policy import SchedulerView
from tidal.core.request import Request, RequestClass
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.policies.bucket import (
    Bucket,
    BucketPolicy,
    ChosenBucket,
    expected_waste,
    max_safe_batch_blocks,
    memory_len,
    waste_ratio,
)
from tidal.policies.compose import CompositePolicy

ONLINE, OFFLINE = RequestClass.ONLINE, RequestClass.OFFLINE
MiB, GiB = 1 << 20, 1 << 30


def req(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0, priority: int = 0,
        cls: RequestClass = ONLINE) -> Request:
    return Request(rid, [100 + i % 50 for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, priority=priority, request_class=cls)


def make(batching: str = "bucket", num_blocks: int = 64, block_size: int = 4, budget: int = 256,
         max_seqs: int = 16, **policy_args) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, batching=batching,
                          policy_args={f"bucket.{k}": v for k, v in policy_args.items()})
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), policy=build_policy(cfg), watermark=0.0)


def run(s: Scheduler, max_steps: int = 500) -> list[StepPlan]:
    plans = []
    for i in range(max_steps):
        if not s.has_unfinished():
            return plans
        plans.append(step(s, float(i)))
    raise AssertionError("did not finish")


def chunk(rid: str, start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(rid, tuple(range(n)), start, (), True, SamplingParams())


# ============================================================================ formulas by hand
def test_waste_ratio_eq2():
    # S_max = 400, S_avg = 250: (400 - 250) / 400
    assert waste_ratio([100, 200, 300, 400]) == pytest.approx(0.375)
    assert waste_ratio([64, 64]) == 0.0
    assert waste_ratio([]) == 0.0


def test_split_at_midpoint_when_more_than_theta_below_and_more_than_n_max():
    lens = [100, 500, 1000, 3000, 4000, 5000]  # 5 of 6 below the midpoint 4096
    buckets = assign([(0, 8192)], lens, key=lambda s: s)
    assert [b.as_list() for b in buckets] == [[0, 8192, 6]]
    out = adjust_buckets(buckets, n_max=4, theta=0.5, l_max=8192, key=lambda s: s)
    assert [b.as_list() for b in out] == [[0, 4096, 5], [4096, 8192, 1]]
    assert out[0].members == [100, 500, 1000, 3000, 4000] and out[1].members == [5000]


def test_split_with_requests_keys_on_prompt_length():
    rs = [req(f"r{i}", n, max_tokens=5000) for i, n in enumerate([100, 500, 1000, 3000, 4000, 5000])]
    out = adjust_buckets(assign([(0, 8192)], rs), n_max=4, theta=0.5, l_max=8192)
    assert [[r.request_id for r in b.members] for b in out] == [["r0", "r1", "r2", "r3", "r4"], ["r5"]]


def test_no_split_when_at_most_theta_below_midpoint():
    lens = [100, 200, 300, 5000, 6000, 7000]  # exactly 3/6 = theta below: not more than theta
    out = adjust_buckets(assign([(0, 8192)], lens, key=lambda s: s), n_max=4, theta=0.5, key=lambda s: s)
    assert [b.as_list() for b in out] == [[0, 8192, 6]]


def test_no_split_when_bucket_holds_at_most_n_max():
    lens = [100, 200, 300, 400]  # all short, but 4 requests is not more than m = N_max = 4
    out = adjust_buckets(assign([(0, 8192)], lens, key=lambda s: s), n_max=4, key=lambda s: s)
    assert [b.as_list() for b in out] == [[0, 8192, 4]]


def test_only_qualifying_buckets_split_one_round():
    buckets = [Bucket(0, 4096, [10, 20, 30, 40, 50, 3000]), Bucket(4096, 8192, [5000, 7000, 7100, 7200, 7300])]
    out = adjust_buckets(buckets, n_max=4, theta=0.5, key=lambda s: s)
    assert [b.as_list() for b in out] == [[0, 2048, 5], [2048, 4096, 1], [4096, 8192, 5]]


def test_merge_into_one_bucket_when_total_below_n_max():
    buckets = [Bucket(0, 2048, [10, 20]), Bucket(2048, 4096, []), Bucket(4096, 8192, [5000])]
    out = adjust_buckets(buckets, n_max=4, theta=0.5, l_max=8192, key=lambda s: s)
    assert [b.as_list() for b in out] == [[0, 8192, 3]]
    assert sorted(out[0].members) == [10, 20, 5000]


def test_prompts_at_or_above_l_max_go_to_the_last_bucket():
    out = assign([(0, 32), (32, 64)], [5, 64, 1000], key=lambda s: s)
    assert [b.members for b in out] == [[5], [64, 1000]]


def test_expected_waste_eq3_empirical():
    # mean of (1 - S / U_b): 1 - 50/100, 1 - 75/100 and 1 - 150/200
    out = [Bucket(0, 100, [50, 75]), Bucket(100, 200, [150])]
    assert expected_waste(out, key=lambda s: s) == pytest.approx((0.5 + 0.25 + 0.25) / 3)


LLAMA2_7B = ModelArch(architecture="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, name="llama-2-7b")


def test_n_max_eq6_llama2_7b():
    assert LLAMA2_7B.kv_bytes_per_token(2) == 512 * 1024  # 2 * 32 * 32 * 128 * 2 B = 0.5 MiB
    # M_safe = 0.9 * 10 GiB = 9216 MiB; one S=1024 request holds 1024 * 0.5 MiB = 512 MiB -> 18
    assert max_safe_batch_size(LLAMA2_7B, 2, 10 * GiB, 1024) == 18
    assert max_safe_batch_size(LLAMA2_7B, 2, 10 * GiB, [1024] * 30) == 18
    # mixed lengths in admission order: 4 x 2048 MiB + 512 MiB = 8704 <= 9216; + 512 = 9216 <= 9216 (fits)
    assert max_safe_batch_size(LLAMA2_7B, 2, 10 * GiB, [4096] * 4 + [1024] * 2) == 6
    assert max_safe_batch_size(LLAMA2_7B, 2, 10 * GiB, [4096] * 4 + [1024] * 3) == 6
    assert max_safe_batch_size(LLAMA2_7B, 2, 10 * GiB, 1024, m_safe_frac=1.0) == 20


def test_n_max_eq6_cumulative_hand_worked():
    # Llama-2-13B: 2LHDB = 2 * 40 * 40 * 128 * 2 B = 819200 B per token. M_remain = 1000 tokens of KV
    # = 819.2 MB; M_safe = 0.9 * M_remain = 900 tokens (Eq. 5). S in admission order 300, 200, 250,
    # 100, 80: running sums 300, 500, 750, 850, 930 -> the first four fit (850 <= 900), N_max = 4.
    arch = ModelArch(architecture="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                     num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128)
    assert arch.kv_bytes_per_token(2) == 819200
    assert max_safe_batch_size(arch, 2, 1000 * 819200, [300, 200, 250, 100, 80]) == 4
    # a sum in order, not a mean: 500, 800, 890 fit and 910 does not, although the mean (183) would allow 4
    assert max_safe_batch_size(arch, 2, 1000 * 819200, [500, 300, 90, 20, 5]) == 3


def test_n_max_block_form_rounds_to_blocks_and_sums():
    # pool 10 blocks x 16 = 160 tokens, no second reserve (the pool already is M_safe):
    # S = 20, 10, 40, 1, 100 -> 32, 16, 48, 16, 112 tokens of whole blocks; sums 32, 48, 96, 112, 224 -> 4
    assert max_safe_batch_blocks(10, 16, [20, 10, 40, 1, 100]) == 4
    # all four fit (112): the next ones are taken at their mean (28), 48 left -> one more, N_max = 5
    assert max_safe_batch_blocks(10, 16, [20, 10, 40, 1]) == 5
    # S = 70, 70, 16 -> 80, 80, 16: 80, 160 fit, 176 does not -> 2
    assert max_safe_batch_blocks(10, 16, [70, 70, 16]) == 2
    # an explicit M_safe share: 0.5 * 160 = 80 -> only the first
    assert max_safe_batch_blocks(10, 16, [70, 70, 16], m_safe_frac=0.5) == 1
    # agrees with the byte form when S is whole blocks: 1000 blocks of 16 Llama-2-7B tokens, S = 1024 -> 15
    assert max_safe_batch_blocks(1000, 16, [1024] * 20) == 15
    assert max_safe_batch_size(LLAMA2_7B, 2, 1000 * 16 * LLAMA2_7B.kv_bytes_per_token(2), [1024] * 20,
                               m_safe_frac=1.0) == 15
    assert max_safe_batch_blocks(1000, 16, []) is None


def test_memory_len_is_prompt_plus_max_output_capped():
    assert memory_len(req("a", 10, max_tokens=6), 8192) == 16
    assert memory_len(req("a", 10, max_tokens=6000), 64) == 64


# ============================================================================ the policy
def _split_workload(s: Scheduler, longs_first: bool) -> None:
    # l_max 64, midpoint 32; longs: prompt 44 + 4 out = 48 tokens = 12 blocks; shorts: 6 + 4 = 10 = 3 blocks
    t_long, t_short = (0.0, 4.0) if longs_first else (8.0, 0.0)
    for i in range(4):
        s.add_request(req(f"L{i}", 44, arrival=t_long + i))
    for i in range(8):
        s.add_request(req(f"S{i}", 6, arrival=t_short + i))


def test_split_under_load_and_batch_from_the_earliest_bucket():
    s = make(num_blocks=64, block_size=4, l_max=64)
    _split_workload(s, longs_first=True)
    plan = step(s)
    st = s.policy.state()
    # 12 waiting in arrival order, pool 256 tokens: 4 x 48 + 5 x 12 = 252 <= 256 -> N_max = 9 (Eq. 6);
    # 8/12 below 32 and 12 > 9: split
    assert st.n_max == 9
    assert st.buckets == ((0, 32, 8), (32, 64, 4))
    assert st.num_splits == 1
    # the long bucket holds the earliest arrival; its cap: 4 x 48 = 192 fit, and the 64 left hold one
    # more of their mean (48) -> 5: the bucket goes in whole and the first short fills the step
    assert st.n_max_batch == 5 and s.last_caps.max_num_seqs == 5
    assert admitted(plan) == ["L0", "L1", "L2", "L3", "S0"]
    # next step 7 short ones wait: 7 x 12 = 84 fit, + floor(172 / 12) = 14 more: N_max = 21 > 7: merged
    plan = step(s)
    st = s.policy.state()
    assert st.buckets == ((0, 64, 7),) and st.num_merges == 1
    # cap over the running (192 + 12 tokens) + shorts of 12: 4 fit (252), the 5th not -> 9, 4 shorts join
    assert s.last_caps.max_num_seqs == 9 and admitted(plan) == ["S1", "S2", "S3", "S4"]
    run(s)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_earlier_short_bucket_goes_first():
    s = make(num_blocks=64, block_size=4, budget=48, l_max=64)
    _split_workload(s, longs_first=False)
    plan = step(s)
    assert s.policy.state().buckets == ((0, 32, 8), (32, 64, 4))
    assert admitted(plan) == [f"S{i}" for i in range(8)]  # 48 tokens: the budget ends the step


def test_admit_refuses_other_buckets_until_the_chosen_one_is_exhausted():
    pol = BucketPolicy(l_max=64)
    longs = [req(f"L{i}", 44, arrival=float(i)) for i in range(4)]
    shorts = [req(f"S{i}", 6, arrival=4.0 + i) for i in range(8)]
    waiting = tuple(longs + shorts)
    view = SchedulerView(now=0.0, running=(), waiting=waiting, num_free_blocks=64, num_total_blocks=64,
                         block_size=4, max_num_seqs=16, max_num_batched_tokens=256)
    assert pol.plan_step(view).max_num_seqs == 5  # 4 longs (192 tokens) + one more of their mean (48)
    order = pol.order_waiting(list(waiting), 0.0)
    assert order == longs + shorts
    assert pol.admit(longs[0], [])
    assert not pol.admit(shorts[0], [])  # the long bucket still waits
    assert not pol.admit(shorts[0], longs[:3])
    assert pol.admit(shorts[0], longs)  # exhausted: work-conserving, the next bucket may fill
    state = pol.state()
    assert state.chosen == ChosenBucket(low=32, up=64, request_class="online", priority=0, waiting=4)


def _admission_order(s: Scheduler) -> list[str]:
    return [rid for p in run(s) for rid in admitted(p)]


@pytest.mark.parametrize("order, expected", [
    ("sjf", ["b", "d", "a", "c"]),
    ("ljf", ["c", "a", "d", "b"]),
    ("fcfs", ["a", "b", "c", "d"]),
])
def test_offline_order_inside_a_bucket(order, expected):
    s = make(num_blocks=1024, max_seqs=1, offline_order=order)
    for i, (rid, n) in enumerate([("a", 12), ("b", 4), ("c", 20), ("d", 8)]):
        s.add_request(req(rid, n, arrival=float(i), cls=OFFLINE))
    assert _admission_order(s) == expected
    assert s.policy.state().num_buckets == 1  # low load: one bucket


def test_online_before_offline_and_priority_dominates():
    s = make(num_blocks=1024, max_seqs=1)
    s.add_request(req("off_long", 20, arrival=0.0, cls=OFFLINE))
    s.add_request(req("off_short", 4, arrival=1.0, cls=OFFLINE))
    s.add_request(req("on_late", 30, arrival=5.0))
    s.add_request(req("on_early", 30, arrival=4.0))
    s.add_request(req("off_urgent", 30, arrival=9.0, priority=-1, cls=OFFLINE))
    s.add_request(req("on_low", 2, arrival=0.0, priority=3))
    assert _admission_order(s) == ["off_urgent", "on_early", "on_late", "off_short", "off_long", "on_low"]


def test_build_policy_reads_the_parameters():
    cfg = SchedulerConfig(batching="bucket", policy_args={"bucket.theta": "0.25", "bucket.l_max": "4096",
                                                          "bucket.m_safe_frac": 0.8, "bucket.offline_order": "LJF"})
    pol = build_policy(cfg)
    assert isinstance(pol, BucketPolicy)
    assert (pol.theta, pol.l_max, pol.m_safe_frac, pol.offline_order) == (0.25, 4096, 0.8, "ljf")
    assert pol.state().buckets == ((0, 4096, 0),)
    with pytest.raises(ConfigError, match="offline_order"):
        build_policy(SchedulerConfig(batching="bucket", policy_args={"bucket.offline_order": "random"}))
    with pytest.raises(ConfigError, match="theta"):
        build_policy(SchedulerConfig(batching="bucket", policy_args={"bucket.theta": 1.5}))


def test_bucket_plus_continuous():
    s = make(batching="bucket+continuous", num_blocks=64, block_size=4, l_max=64)
    assert isinstance(s.policy, CompositePolicy) and s.policy.name == "bucket+continuous"
    _split_workload(s, longs_first=True)
    plan = step(s)
    assert admitted(plan) == ["L0", "L1", "L2", "L3", "S0"] and s.last_caps.max_num_seqs == 5
    run(s)
    st = s.policy.state()
    assert st.policy == "bucket+continuous"
    bucket, continuous = st.parts
    assert bucket.num_splits == 1 and bucket.num_merges == 1 and bucket.padding_steps > 0
    assert continuous.policy == "continuous" and st.to_dict()["bucket"]["num_splits"] == 1
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_padding_waste_of_hand_made_batches():
    pol = BucketPolicy()
    # context lengths after the step: 10, 20, 30 (prefill chunks) and 40 (a decode at 39)
    chunks = (chunk("a", 0, 10), chunk("b", 0, 20), chunk("c", 10, 20), chunk("d", 39, 1))
    plan = StepPlan(1, chunks, BatchComposition.of(chunks))
    pol.observe(plan, StepResult(1))
    assert pol.state().padding_waste_last == pytest.approx((40 - 25) / 40)
    chunks2 = (chunk("a", 10, 1), chunk("b", 20, 1))  # 11 and 21: (21 - 16) / 21
    pol.observe(StepPlan(2, chunks2, BatchComposition.of(chunks2)), StepResult(2))
    pol.observe(StepPlan(3, (), BatchComposition()), StepResult(3))  # empty steps do not count
    st = pol.state()
    assert st.padding_waste_last == pytest.approx(5 / 21)
    assert st.padding_waste_mean == pytest.approx((0.375 + 5 / 21) / 2) and st.padding_steps == 2

