"""Unit and stateful property tests for the paged KV block bookkeeping (pure, no torch)."""

from __future__ import annotations

import contextlib

import pytest

from tidal.core.kv_manager import BlockPool, KVAllocation, KVCacheManager

# ============================================================================ BlockPool


def test_pool_allocates_lowest_ids_first():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1])
    assert pool.allocate(2) == [1, 3]
    assert pool.num_used == 4 and pool.num_free == 4


def test_pool_allocate_none_when_short_and_takes_nothing():
    pool = BlockPool(4)
    assert pool.allocate(5) is None
    assert pool.num_free == 4
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(-1)


def test_pool_double_free_raises():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError):
        pool.free([b])


def test_pool_truncate_refuses_live_blocks():
    pool = BlockPool(4)
    pool.allocate(4)
    pool.free([0, 1, 2])
    with pytest.raises(ValueError):
        pool.truncate(2)
    pool.free([3])
    pool.truncate(2)
    assert pool.num_blocks == 2 and pool.num_free == 2
    assert pool.allocate(2) == [0, 1]


# ============================================================================ KVCacheManager


def test_allocate_lowest_first_and_grows_table_incrementally():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = kv.allocate("a", 5)
    assert isinstance(a, KVAllocation)
    assert a.new_blocks == (0, 1)
    assert kv.block_table("a") == [0, 1]
    b = kv.allocate("b", 4)
    assert b.new_blocks == (2,)
    # same block count: nothing new
    assert kv.allocate("a", 8).new_blocks == ()
    assert kv.allocate("a", 9).new_blocks == (3,)
    assert kv.block_table("a") == [0, 1, 3]
    assert kv.num_blocks_of("a") == 3
    assert kv.num_free_blocks == 6
    assert kv.usage == pytest.approx(0.4)
    kv.check_invariants()


def test_allocate_none_when_short_leaves_state_untouched():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate("a", 12) is not None
    assert kv.allocate("b", 8) is None
    assert not kv.has("b")
    assert kv.block_table("b") == []
    assert kv.allocate("a", 20) is None
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_allocate_reserve_keeps_watermark():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    assert kv.allocate("a", 8, reserve=2) is not None  # 4 blocks, 2 left = reserve: ok
    assert kv.num_free_blocks == 2
    assert kv.allocate("b", 1, reserve=2) is None  # would leave 1 < 2
    assert kv.allocate("b", 1, reserve=1) is not None
    assert kv.blocks_needed("a", 9) == 1
    assert kv.blocks_needed("a", 3) == 0


def test_free_restores_free_count_and_returns_released():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    kv.allocate("a", 9)
    kv.allocate("b", 4)
    assert kv.num_free_blocks == 4
    assert kv.free("a") == 3
    assert kv.num_free_blocks == 7
    assert not kv.has("a")
    assert kv.free("a") == 0  # unknown / already freed: a no-op
    assert kv.free("b") == 1
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_double_free_of_block_raises():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate("a", 4)
    table = list(kv.block_table("a"))
    kv.free("a")
    with pytest.raises(ValueError):
        kv.pool.free(table)


def test_swap_out_and_in_move_blocks_and_account_host_pool():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    kv.allocate("x", 4)
    kv.allocate("a", 12)  # blocks 1,2,3
    moves = kv.swap_out("a")
    assert moves == [(1, 0), (2, 1), (3, 2)]
    assert kv.block_table("a") == []
    assert kv.num_host_blocks_of("a") == 3
    assert kv.has("a")
    assert kv.num_free_blocks == 7
    assert kv.host_pool.num_free == 1
    kv.check_invariants()
    with pytest.raises(KeyError):
        kv.swap_in("x")  # not swapped out
    # refill so swap-in cannot fit
    kv.allocate("y", 24)  # 6 blocks: 1 free
    assert kv.swap_in("a") is None
    assert kv.num_host_blocks_of("a") == 3
    kv.free("y")
    assert kv.swap_in("a", reserve=5) is None  # 7 free - 5 reserve < 3
    back = kv.swap_in("a")
    assert back == [(0, 1), (1, 2), (2, 3)]
    assert kv.block_table("a") == [1, 2, 3]
    assert kv.num_host_blocks_of("a") == 0
    assert kv.host_pool.num_free == 4
    kv.check_invariants()


def test_swap_out_none_when_host_pool_too_small():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=2)
    kv.allocate("a", 12)
    assert kv.swap_out("a") is None
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.host_pool.num_free == 2
    kv.check_invariants()


def test_free_releases_host_blocks_of_swapped_request():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    kv.allocate("a", 8)
    kv.swap_out("a")
    assert kv.free("a") == 2
    assert kv.host_pool.num_free == 4 and kv.num_free_blocks == 8
    assert not kv.has("a")
    kv.check_invariants()


def test_grow_adds_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate("a", 16)
    assert kv.allocate("b", 1) is None
    added = kv.grow(3)
    assert added == range(4, 7)
    assert kv.num_blocks == 7 and kv.num_free_blocks == 3
    assert kv.allocate("b", 5).new_blocks == (4, 5)
    with pytest.raises(ValueError):
        kv.grow(-1)
    kv.check_invariants()


def test_shrink_relocates_live_high_blocks_to_free_low_ones():
    kv = KVCacheManager(num_blocks=10, block_size=1)
    kv.allocate("a", 3)  # 0,1,2
    kv.allocate("b", 4)  # 3,4,5,6
    kv.allocate("c", 3)  # 7,8,9
    kv.free("a")  # 0,1,2 free
    kv.free("b")  # 3..6 free
    kv.allocate("e", 2)  # 0,1
    # live: e=[0,1], c=[7,8,9]; free: 2..6
    moves = kv.shrink(4)  # new size 6: 7,8,9 must move down to 2,3,4
    assert moves == [(7, 2), (8, 3), (9, 4)]
    assert kv.num_blocks == 6
    assert kv.block_table("c") == [2, 3, 4]
    assert kv.block_table("e") == [0, 1]
    assert [kv.pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_shrink_moves_nothing_when_top_is_free_and_none_when_short():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate("a", 12)  # 0,1,2
    assert kv.shrink(3) == []
    assert kv.num_blocks == 5
    assert kv.shrink(3) is None  # only 2 free
    assert kv.num_blocks == 5 and kv.block_table("a") == [0, 1, 2]
    with pytest.raises(ValueError):
        kv.shrink(-1)
    assert kv.shrink(0) == []
    kv.check_invariants()


def test_shrink_does_not_touch_host_tables():
    kv = KVCacheManager(num_blocks=6, block_size=1, num_host_blocks=4)
    kv.allocate("a", 2)  # 0,1
    kv.allocate("b", 2)  # 2,3
    kv.allocate("c", 2)  # 4,5
    kv.swap_out("a")  # host 0,1 ; device 0,1 free
    moves = kv.shrink(2)
    assert moves == [(4, 0), (5, 1)]
    assert kv.block_table("c") == [0, 1]
    assert kv.num_host_blocks_of("a") == 2
    assert kv.swap_in("a") is None  # no free device blocks left
    kv.check_invariants()


def test_invalid_block_size():
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=4, block_size=0)


# ============================================================================ misuse must not leak
# The scheduler never does these, but the manager silently corrupts its accounting if anyone does;
# either refusing (an exception) or handling them without a leak is acceptable.


def test_swap_out_twice_does_not_leak_host_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    kv.allocate("a", 8)
    assert kv.swap_out("a") is not None
    with contextlib.suppress(KeyError, ValueError):
        kv.swap_out("a")
    kv.check_invariants()  # fails today: the second call replaces the host table with []
    kv.free("a")
    assert kv.host_pool.num_free == 4


def test_allocate_while_swapped_out_does_not_leak_on_swap_in():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    kv.allocate("a", 8)
    kv.swap_out("a")
    with contextlib.suppress(KeyError, ValueError):
        kv.allocate("a", 4)
        kv.swap_in("a")
    kv.check_invariants()  # fails today: swap_in overwrites the device table allocated meanwhile
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.host_pool.num_free == 4
