"""A request whose KV arrives from another instance (a P/D hand-off, a migration) shares the blocks of
its prefix that this pool holds cached: only the rest is allocated and written (issue 52)."""

from __future__ import annotations

from tests.core.test_scheduler import Driver
from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler

BS = 4


def cached_scheduler(num_blocks: int = 32) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_caching=True)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)


def arriving(rid: str, prompt: list[int], computed: int) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=4))
    req.num_computed_tokens = computed
    return req


def test_an_import_shares_the_cached_prefix_and_allocates_only_the_rest():
    sched = cached_scheduler()
    history = list(range(100, 120))  # 20 tokens: 5 full blocks once computed
    d = Driver(sched)
    d.add(Request("turn1", history, SamplingParams(max_tokens=1)))
    d.run()
    assert sched.kv.num_cached_blocks == 5
    free, plain = sched.kv.num_free_blocks, sched.kv.num_plain_free_blocks
    cached_ids = [sched.kv.pool.lookup(h) for h in sched.kv.hashes(arriving("x", history, 0), 20)]
    # turn 2 arrives with its 26 tokens of KV computed elsewhere: turn 1's five blocks are here
    turn2 = arriving("turn2", history + list(range(500, 506)), 26)
    assert sched.add_imported(turn2, reuse_cached=True) == 20
    table = sched.kv.block_table("turn2")
    assert table[:5] == cached_ids and len(table) == 7  # ceil(26 / 4): two fresh blocks
    # the five cached blocks now hold turn 2's prefix too: only two blocks left the plain free list
    assert sched.kv.num_plain_free_blocks == plain - 2 and sched.kv.num_free_blocks == free - 7
    assert sched.kv_reused_tokens == 20
    sched.kv.check_invariants()
    sched.abort_requests(["turn2"])
    assert sched.kv.num_free_blocks == free  # its own blocks back, the shared ones cached again
    sched.kv.check_invariants()


def test_without_reuse_or_caching_an_import_takes_all_its_blocks():
    sched = cached_scheduler()
    prompt = list(range(100, 120))
    d = Driver(sched)
    d.add(Request("a", prompt, SamplingParams(max_tokens=1)))
    d.run()
    plain = sched.kv.num_plain_free_blocks
    assert sched.add_imported(arriving("b", prompt + [7, 8], 22)) == 0  # reuse off: the default
    assert sched.kv.num_plain_free_blocks == plain - 6  # a second copy beside the cached one
    off = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(32, BS))
    assert off.add_imported(arriving("c", prompt, 20), reuse_cached=True) == 0


def test_a_hit_stops_short_of_the_last_computed_token_and_no_room_gives_back_the_shared_blocks():
    sched = cached_scheduler(num_blocks=8)
    prompt = list(range(100, 116))  # exactly 4 blocks
    d = Driver(sched)
    d.add(Request("a", prompt, SamplingParams(max_tokens=1)))
    d.run()
    # the same 16 tokens of KV arrive: at most 3 blocks are shared, so one chunk still lands
    assert sched.add_imported(arriving("b", prompt, 16), reuse_cached=True) == 12
    sched.abort_requests(["b"])
    cached = sched.kv.num_cached_blocks
    assert sched.add_imported(arriving("x", list(range(900, 916)), 16)) == 0  # the other four blocks
    later = arriving("c", prompt + list(range(12)), 28)  # its 4 cached blocks and 3 more: none free now
    assert sched.add_imported(later, reuse_cached=True) is None
    assert "c" not in sched.requests and not sched.kv.has("c") and sched.kv.num_cached_blocks == cached
    sched.kv.check_invariants()
