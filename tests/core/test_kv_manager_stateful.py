"""Stateful property tests for the paged KV block bookkeeping (hypothesis; pure, no torch): random
sequences of allocate, free, swap, grow and shrink against a model of what each table holds."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tidal.core.kv_manager import KVCacheManager

# ============================================================================ stateful model

BLOCK_SIZE = 4
MIN_POOL = 3
GARBAGE = ("garbage",)


class KVMachine(RuleBasedStateMachine):
    """Random allocate/free/abort/swap/grow/shrink against a simple model.

    The model: ``tokens[r]`` (tokens request r holds), ``where[r]`` ("dev" or "host") and
    ``labels[r]`` (per table slot, which logical content it must hold). A simulated content
    store (block id -> label) follows every copy the manager asks for (swap and shrink moves),
    so a wrong relocation or a table pointing at someone else's block shows up.
    """

    def __init__(self):
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.tokens: dict[str, int] = {}
        self.where: dict[str, str] = {}
        self.labels: dict[str, list[tuple[str, int, int]]] = {}
        self.dev: dict[int, tuple] = {}
        self.host: dict[int, tuple] = {}
        self.next_id = 0
        self.gen = 0  # content generation: labels are unique even if a request id is reused

    @initialize(num_blocks=st.integers(4, 16), num_host=st.integers(0, 8), data=st.data())
    def setup(self, num_blocks, num_host, data):
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, num_host_blocks=num_host)
        # Start from a fragmented pool (live blocks above free ones) so that the
        # rules below, shrink above all, meet interesting states early.
        self._fragment(data, fill=data.draw(st.booleans()))

    def _fragment(self, data, fill: bool):
        """Allocate requests (until the pool is full if ``fill``), then drop some."""
        for _ in range(100 if fill else data.draw(st.integers(0, 6))):
            if not self._try_new(data.draw(st.integers(1, 2 * BLOCK_SIZE)), reserve=0):
                break
        for rid in sorted(self.where):
            if data.draw(st.booleans()):
                self._drop(rid)

    # ------------------------------------------------------------------ helpers
    def _on(self, where):
        return sorted(r for r, w in self.where.items() if w == where)

    def _garbage_freed(self, table, pool, store):
        for b in table:
            if pool.ref_count(b) == 0:
                store[b] = GARBAGE

    def _drop(self, rid):
        dev_table = list(self.kv.block_table(rid))
        host_table = list(self.kv._host_tables.get(rid, []))
        expected = len(dev_table) + len(host_table)
        assert self.kv.free(rid) == expected
        assert not self.kv.has(rid)
        self._garbage_freed(dev_table, self.kv.pool, self.dev)
        self._garbage_freed(host_table, self.kv.host_pool, self.host)
        del self.tokens[rid], self.where[rid], self.labels[rid]

    # ------------------------------------------------------------------ rules
    @rule(tokens=st.integers(1, 2 * BLOCK_SIZE), reserve=st.integers(0, 2))
    def new_request(self, tokens, reserve):
        self._try_new(tokens, reserve)

    def _try_new(self, tokens, reserve):
        rid = f"r{self.next_id}"
        self.next_id += 1
        need = self.kv.blocks_for_tokens(tokens)
        free_before = self.kv.num_free_blocks
        alloc = self.kv.allocate(rid, tokens, reserve=reserve)
        if need > free_before - reserve:
            assert alloc is None
            assert not self.kv.has(rid)
            assert self.kv.num_free_blocks == free_before
            return False
        assert alloc is not None and len(alloc.new_blocks) == need
        assert list(alloc.new_blocks) == sorted(self.kv.pool._free + list(alloc.new_blocks))[:need]
        self._record_new(rid, alloc.new_blocks, start_index=0)
        self.tokens[rid] = tokens
        self.where[rid] = "dev"
        return True

    def _record_new(self, rid, blocks, start_index):
        self.gen += 1
        labels = self.labels.setdefault(rid, [])
        for i, b in enumerate(blocks):
            lab = (rid, self.gen, start_index + i)
            self.dev[b] = lab
            labels.append(lab)

    @precondition(lambda self: any(w == "dev" for w in self.where.values()))
    @rule(data=st.data(), extra=st.integers(0, 2 * BLOCK_SIZE), reserve=st.integers(0, 1))
    def grow_request(self, data, extra, reserve):
        rid = data.draw(st.sampled_from(self._on("dev")))
        total = self.tokens[rid] + extra
        need = self.kv.blocks_for_tokens(total) - len(self.labels[rid])
        free_before = self.kv.num_free_blocks
        alloc = self.kv.allocate(rid, total, reserve=reserve)
        if need > free_before - reserve:
            assert alloc is None
            assert self.kv.num_free_blocks == free_before
            return
        assert alloc is not None and len(alloc.new_blocks) == need
        self._record_new(rid, alloc.new_blocks, start_index=len(self.labels[rid]))
        self.tokens[rid] = total

    @precondition(lambda self: bool(self.where))
    @rule(data=st.data())
    def free(self, data):
        self._drop(data.draw(st.sampled_from(sorted(self.where))))

    @precondition(lambda self: any(w == "host" for w in self.where.values()))
    @rule(data=st.data())
    def abort_swapped(self, data):
        """Abort a request whose KV lives on the host."""
        self._drop(data.draw(st.sampled_from(self._on("host"))))

    @rule()
    def free_unknown_is_noop(self):
        free, host_free = self.kv.num_free_blocks, self.kv.host_pool.num_free
        assert self.kv.free("nobody") == 0
        assert (self.kv.num_free_blocks, self.kv.host_pool.num_free) == (free, host_free)

    @precondition(lambda self: any(w == "dev" for w in self.where.values()))
    @rule(data=st.data())
    def swap_out(self, data):
        rid = data.draw(st.sampled_from(self._on("dev")))
        table = list(self.kv.block_table(rid))
        host_free = self.kv.host_pool.num_free
        moves = self.kv.swap_out(rid)
        if len(table) > host_free:
            assert moves is None
            assert self.kv.block_table(rid) == table
            return
        assert moves is not None
        assert [d for d, _ in moves] == table
        for d, h in moves:  # the executor copies before anything reuses the device block
            self.host[h] = self.dev[d]
        self._garbage_freed(table, self.kv.pool, self.dev)
        assert self.kv.host_pool.num_free == host_free - len(table)
        assert self.kv.num_host_blocks_of(rid) == len(table)
        self.where[rid] = "host"

    @precondition(lambda self: any(w == "host" for w in self.where.values()))
    @rule(data=st.data(), reserve=st.integers(0, 1))
    def swap_in(self, data, reserve):
        rid = data.draw(st.sampled_from(self._on("host")))
        host_table = list(self.kv._host_tables[rid])
        free = self.kv.num_free_blocks
        moves = self.kv.swap_in(rid, reserve=reserve)
        if len(host_table) > free - reserve:
            assert moves is None
            assert self.kv.num_host_blocks_of(rid) == len(host_table)
            return
        assert moves is not None
        assert [h for h, _ in moves] == host_table
        for h, d in moves:
            self.dev[d] = self.host[h]
        for h in host_table:
            self.host[h] = GARBAGE
        self.where[rid] = "dev"

    @rule(n=st.integers(0, 4))
    def grow_pool(self, n):
        old = self.kv.num_blocks
        free = self.kv.num_free_blocks
        assert self.kv.grow(n) == range(old, old + n)
        assert self.kv.num_free_blocks == free + n
        for b in range(old, old + n):
            self.dev[b] = GARBAGE

    @precondition(lambda self: self.kv is not None and self.kv.num_blocks > MIN_POOL and self.kv._tables)
    @rule(data=st.data())
    def shrink_pool(self, data):
        free = self.kv.num_free_blocks
        # Feasible sizes, as large as possible often (that relocates the most), but keeping
        # MIN_POOL blocks so the pool does not collapse; sometimes one more than is free.
        top = min(free, self.kv.num_blocks - MIN_POOL)
        n = data.draw(st.one_of(st.just(top), st.integers(0, top), st.just(free + 1)))
        self._shrink(n)

    def _shrink(self, n):
        old = self.kv.num_blocks
        free = self.kv.num_free_blocks
        before = {r: list(self.kv.block_table(r)) for r in self._on("dev")}
        moves = self.kv.shrink(n)
        if n > free:
            assert moves is None
            assert self.kv.num_blocks == old
            assert {r: list(self.kv.block_table(r)) for r in before} == before
            return
        assert moves is not None
        new_size = old - n
        live_high = {b for t in before.values() for b in t if b >= new_size}
        srcs = [s for s, _ in moves]
        dsts = [d for _, d in moves]
        # exactly the live blocks above the new size move, each to a distinct block below it
        assert sorted(srcs) == sorted(live_high) and len(srcs) == len(set(srcs))
        assert all(d < new_size for d in dsts) and len(dsts) == len(set(dsts))
        # no destination held anything live before
        live_before = {b for t in before.values() for b in t}
        assert not (set(dsts) & live_before)
        # apply the copies to the simulated store (all copies read the old state)
        snapshot = dict(self.dev)
        for s, d in moves:
            self.dev[d] = snapshot[s]
        for b in range(new_size, old):
            self.dev.pop(b, None)
        remap = dict(moves)
        for r, t in before.items():
            assert self.kv.block_table(r) == [remap.get(b, b) for b in t]
        assert self.kv.num_blocks == new_size
        assert self.kv.num_free_blocks == free - n

    # ------------------------------------------------------------------ invariants
    @invariant()
    def manager_invariants(self):
        if self.kv is None:
            return
        self.kv.check_invariants()

    @invariant()
    def tables_match_model(self):
        if self.kv is None:
            return
        kv = self.kv
        for rid, where in self.where.items():
            need = kv.blocks_for_tokens(self.tokens[rid])
            if where == "dev":
                assert kv.num_blocks_of(rid) == need, rid
                assert kv.num_host_blocks_of(rid) == 0
            else:
                assert kv.num_host_blocks_of(rid) == need, rid
                assert kv.num_blocks_of(rid) == 0
            assert len(self.labels[rid]) == need

    @invariant()
    def sharing_only_where_ref_counts_say(self):
        if self.kv is None:
            return
        for pool, tables in ((self.kv.pool, self.kv._tables), (self.kv.host_pool, self.kv._host_tables)):
            uses: dict[int, int] = {}
            for t in tables.values():
                assert len(t) == len(set(t)), "a block appears twice in one table"
                for b in t:
                    assert 0 <= b < pool.num_blocks
                    uses[b] = uses.get(b, 0) + 1
            for b, n in uses.items():
                assert pool.ref_count(b) == n
                if n > 1:
                    assert pool.ref_count(b) > 1
            assert pool.num_free + pool.num_used == pool.num_blocks
            assert pool.num_used == len(uses)

    @invariant()
    def every_table_points_to_its_own_content(self):
        if self.kv is None:
            return
        for rid, where in self.where.items():
            if where == "dev":
                got = [self.dev.get(b, GARBAGE) for b in self.kv.block_table(rid)]
            else:
                got = [self.host.get(b, GARBAGE) for b in self.kv._host_tables[rid]]
            assert got == self.labels[rid], rid

    def teardown(self):
        if self.kv is None:
            return
        for rid in sorted(self.where):
            self._drop(rid)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.host_pool.num_free == self.kv.host_pool.num_blocks
        assert not self.kv._tables and not self.kv._host_tables


KVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVMachine = KVMachine.TestCase


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_shrink_after_fragmentation_keeps_every_table_on_its_own_content(data):
    """Focused on relocation: fill the pool, drop some requests (leaving holes below
    live blocks), maybe swap one out, then shrink; the moves, applied to the simulated content
    store, must leave every table on its own data."""
    m = KVMachine()
    m.kv = KVCacheManager(num_blocks=data.draw(st.integers(4, 14)), block_size=BLOCK_SIZE, num_host_blocks=4)
    m._fragment(data, fill=True)
    if m._on("dev") and data.draw(st.booleans()):
        m.swap_out(data)
    free = m.kv.num_free_blocks
    m._shrink(data.draw(st.one_of(st.just(free), st.integers(0, free))))
    m.manager_invariants()
    m.tables_match_model()
    m.sharing_only_where_ref_counts_say()
    m.every_table_points_to_its_own_content()
    if m._on("host") and data.draw(st.booleans()):
        m.swap_in(data, reserve=0)
        m.every_table_points_to_its_own_content()
    m.teardown()


