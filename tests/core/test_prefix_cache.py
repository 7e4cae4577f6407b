"""Automatic prefix caching in the pure core: block names, shared block tables, the LRU of cached
blocks, the host tier, and every scheduler path with sharing.

The executor is test_scheduler's ``Driver``: it keeps a simulated paged KV store (block -> token
per slot), applies each plan's copies (device -> host first, then host -> device) and checks before
every chunk that the blocks its table names hold exactly the request's earlier tokens. A shared
block freed early and reused, or written by a second request, shows up there as a wrong token.
"""

from __future__ import annotations

import random

import pytest

from tests.core.test_scheduler import PROMPT_BASE, Driver, fake_token
from tidal.config import SchedulerConfig
from tidal.core.block_hash import block_hashes, hash_block
from tidal.core.block_pool import BlockPool
from tidal.core.kv_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler


def sched(num_blocks=64, block_size=4, budget=32, max_seqs=8, mode="recompute", host_blocks=0, host_tier=False,
          caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, host_blocks, enable_caching=caching, host_tier=host_tier)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, preemption_mode=mode)
    return Scheduler(cfg, kv, watermark=0.0)


def req(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_salt=salt))


def tokens(n: int, seed: int = 0) -> list[int]:
    return [PROMPT_BASE + (seed * 7919 + i * 31) % 1000 for i in range(n)]


# ============================================================================ names


def test_block_names_chain_and_salt():
    a = tokens(12)
    h = block_hashes(a, 4)
    assert len(h) == 3 and len(set(h)) == 3
    assert block_hashes(a + [1, 2], 4) == h  # a partial block has no name
    b = list(a)
    b[1] += 1  # a token of the first block changes every later name (the chain)
    assert all(x != y for x, y in zip(block_hashes(b, 4), h, strict=True))
    c = list(a)
    c[9] += 1
    assert block_hashes(c, 4)[:2] == h[:2] and block_hashes(c, 4)[2] != h[2]
    assert all(x != y for x, y in zip(block_hashes(a, 4, "tenant-1"), h, strict=True))
    assert block_hashes(a, 4, "tenant-1") == block_hashes(a, 4, "tenant-1")
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


def test_pool_hands_out_free_blocks_before_cached_ones_and_evicts_least_recent_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:3]):
        assert pool.name(b, bytes([i]))
    pool.free([blocks[1], blocks[0], blocks[2], blocks[3]])  # blocks[3] has no name: free
    assert (pool.num_free, pool.num_cached) == (4, 3)
    pool.evictions = []
    got = pool.allocate(2)
    assert got == [blocks[3], blocks[1]]  # the free one, then the least recently freed cached one
    assert pool.evictions == [(blocks[1], bytes([1]))] and pool.lookup(bytes([1])) is None
    assert pool.lookup(bytes([0])) == blocks[0]
    pool.touch(blocks[0])  # a hit makes a cached block live
    assert pool.ref_count(blocks[0]) == 1 and pool.num_cached == 1
    pool.check({blocks[0]: 1, blocks[1]: 1, blocks[3]: 1})
    with pytest.raises(ValueError):
        BlockPool(2).touch(0)  # a free block names nothing: there is nothing to hit


# ============================================================================ the scheduler with sharing


def test_a_second_request_hits_the_first_ones_prompt_and_computes_only_the_rest():
    d = Driver(sched(budget=64))
    shared = tokens(32)
    d.add(req("a", shared + tokens(8, 1)))
    d.run()
    d.add(req("b", shared + tokens(6, 2)))
    plan, _ = d.step()
    (c,) = plan.chunks
    assert (c.start, c.num_tokens) == (32, 6)  # 8 blocks of 4 hit
    b = d.sched.requests["b"]
    assert b.num_cached_tokens == 32
    assert (d.sched.prefix_queries, d.sched.prefix_hits) == (40 + 38, 32)
    d.run()
    assert d.outputs["b"] == [fake_token("b", i) for i in range(4)]


def test_a_whole_prompt_hit_still_computes_its_last_block():
    d = Driver(sched(budget=64))
    p = tokens(16)
    d.add(req("a", p))
    d.run()
    d.add(req("b", p))
    plan, _ = d.step()
    assert [(c.start, c.num_tokens, c.sample) for c in plan.chunks] == [(12, 4, True)]  # 3 of 4 blocks


def test_an_alpha_part_hits_no_kv_past_its_split_point():
    """DynaServe's alpha computes KV up to ``pause_at`` and hands [0, pause_at) to beta: a cached
    prefix longer than that would put KV past the split into alpha's chunks (beta refuses them)."""
    d = Driver(sched(budget=64))
    p = tokens(32)
    d.add(req("a", p))
    d.run()
    b = req("b", p)
    b.pause_at = 13
    d.add(b)
    plan, _ = d.step()
    (c,) = plan.chunks
    assert (c.start, c.start + c.num_tokens) == (12, 13)  # 3 blocks hit, not 7: KV ends at the split
    assert d.sched.requests["b"].num_computed_tokens == 13


def test_live_requests_share_blocks_and_the_last_user_frees_them():
    d = Driver(sched(budget=64))
    p = tokens(20)
    d.add(req("a", p, max_tokens=8))
    d.step()
    d.add(req("b", p + tokens(3, 3), max_tokens=2))
    d.step()
    kv = d.sched.kv
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert ta[:5] == tb[:5] and all(kv.pool.ref_count(x) == 2 for x in ta[:5])
    d.run()
    assert kv.pool.num_used == 0 and kv.num_cached_blocks >= 5
    kv.check_invariants()


def test_decode_filled_blocks_are_named_so_the_next_turn_hits_the_answer():
    d = Driver(sched(budget=64))
    d.add(req("turn1", tokens(6), max_tokens=12))
    d.run()
    history = d.seq("turn1")  # 18 tokens: 4 full blocks, the answer's included
    d.add(req("turn2", history + tokens(5, 9)))
    plan, _ = d.step()
    assert plan.chunks[0].start == 16


def test_different_salts_share_nothing_and_equal_salts_share():
    d = Driver(sched(budget=64))
    p = tokens(24)
    d.add(req("a", p, salt="tenant-a"))
    d.run()
    d.add(req("b", p, salt="tenant-b"))
    assert d.step()[0].chunks[0].start == 0
    d.run()
    d.add(req("c", p, salt="tenant-a"))
    assert d.step()[0].chunks[0].start == 20


def test_caching_off_never_shares():
    d = Driver(sched(budget=64, caching=False))
    p = tokens(24)
    d.add(req("a", p))
    d.run()
    d.add(req("b", p))
    assert d.step()[0].chunks[0].start == 0
    assert d.sched.prefix_queries == 0 and d.sched.kv.num_cached_blocks == 0


def test_recompute_preemption_re_hits_its_own_blocks_and_is_no_query():
    # 10 blocks of 4: two requests of 16 + up to 12 outputs cannot both finish without a preemption
    d = Driver(sched(num_blocks=10, budget=64))
    d.add(req("a", tokens(16, 1), max_tokens=12))
    d.add(req("b", tokens(16, 2), max_tokens=12))
    d.run()
    assert d.sched.num_preemptions >= 1
    assert d.outputs["a"] == [fake_token("a", i) for i in range(12)]
    assert d.outputs["b"] == [fake_token("b", i) for i in range(12)]
    assert d.sched.prefix_queries == 32  # the first admissions only
    victim = next(p for plan in d.plans for p in plan.preempted)
    resumed = [c for plan in d.plans for c in plan.chunks if c.request_id == victim and not c.is_decode]
    assert resumed[-1].start > 0  # its recompute started past what stayed cached


def test_swap_preemption_with_caching_keeps_outputs_and_blocks_exact():
    d = Driver(sched(num_blocks=10, budget=64, mode="swap", host_blocks=16))
    d.add(req("a", tokens(16, 1), max_tokens=12))
    d.add(req("b", tokens(16, 2), max_tokens=12))
    d.run()
    assert d.sched.num_preemptions >= 1 and any(p.swap_out for p in d.plans) and any(p.swap_in for p in d.plans)
    assert d.outputs["b"] == [fake_token("b", i) for i in range(12)]
    d.sched.kv.check_invariants()
    assert d.sched.kv.host_pool.num_used == 0


def test_host_tier_stores_evicted_prefixes_and_loads_them_back():
    # the device pool holds 8 blocks: a's 6 named blocks are evicted by b, stored on the host, and c
    # (a's prompt again) loads them back instead of computing them
    d = Driver(sched(num_blocks=8, budget=64, host_blocks=32, host_tier=True))
    pa = tokens(24, 1)
    d.add(req("a", pa, max_tokens=1))
    d.run()
    d.add(req("b", tokens(28, 2), max_tokens=1))
    d.run()
    stores = [s for p in d.plans for s in p.swap_out]
    assert len(stores) >= 5
    d.add(req("c", pa, max_tokens=2))
    plan, _ = d.step()
    assert plan.swap_in and plan.chunks[0].start == 20  # 5 blocks back from the host, the last one computed
    assert d.sched.prefix_hits == 20 == d.sched.requests["c"].num_cached_tokens
    assert d.sched.prefix_host_hits >= 16  # what b left on the device is hit there
    d.run()
    assert d.outputs["c"] == [fake_token("c", 0), fake_token("c", 1)]
    d.sched.kv.check_invariants()


def test_reset_forgets_every_name():
    d = Driver(sched(budget=64, host_blocks=8, host_tier=True))
    p = tokens(16)
    d.add(req("a", p))
    d.run()
    kv = d.sched.kv
    assert kv.num_cached_blocks == 4 and kv.reset_prefix_cache() == 4
    d.add(req("b", p))
    assert d.step()[0].chunks[0].start == 0
    kv.check_invariants()


def test_shrink_forgets_cached_blocks_above_and_moves_live_names():
    kv = KVCacheManager(8, 4, enable_caching=True)
    r = req("a", tokens(16))
    r.num_computed_tokens = 0
    kv.allocate("a", 16)
    r.num_computed_tokens = 16
    kv.cache_blocks(r)
    names = list(r.block_hashes)
    kv.free("a")
    kv.allocate("x", 16)  # takes the 4 free blocks (4..7); a's four (0..3) stay cached
    assert kv.num_cached_blocks == 4
    moves = kv.shrink(4)  # x's blocks move into cached ids, which forget their names
    assert len(moves) == 4 and all(kv.pool.lookup(n) is None for n in names)
    kv.check_invariants()


@pytest.mark.parametrize("mode,host_tier", [("recompute", False), ("swap", False), ("recompute", True),
                                             ("swap", True)])
def test_random_traffic_with_shared_prefixes_keeps_every_block_exact(mode, host_tier):
    rng = random.Random(17 + 2 * (mode == "swap") + host_tier)
    host = 24 if (mode == "swap" or host_tier) else 0
    d = Driver(sched(num_blocks=14, block_size=4, budget=24, max_seqs=6, mode=mode, host_blocks=host,
                     host_tier=host_tier))
    systems = [tokens(rng.randrange(4, 20), s) for s in range(3)]
    n = 0
    for _ in range(300):
        if rng.random() < 0.35:
            prompt = rng.choice(systems) + tokens(rng.randrange(1, 14), 100 + n)
            d.add(req(f"r{n}", prompt, max_tokens=rng.randrange(1, 16)))
            n += 1
        if rng.random() < 0.05 and d.sched.requests:
            victim = rng.choice(sorted(d.sched.requests))
            d.sched.abort_requests([victim], d.now)
            d.aborted.add(victim)
        if d.sched.has_unfinished():
            d.step()
    d.run()
    assert d.sched.prefix_hits > 0 and d.sched.num_preemptions > 0  # sharing under pressure, not beside it
    if host_tier:
        assert d.sched.prefix_host_hits > 0
    for rid, out in d.outputs.items():
        if rid not in d.aborted:
            assert out == [fake_token(rid, i) for i in range(len(out))]
    kv = d.sched.kv
    assert kv.pool.num_used == 0 and kv.host_pool.num_used == 0
    kv.check_invariants()
