"""Paged KV-cache bookkeeping: per-request block tables over a device pool and a host pool, and
automatic prefix caching.

Pure: this module decides which block ids hold which request's KV; the engine's KV tensors
(or the simulator's counters) follow its decisions. The pool can grow and shrink at run time;
shrinking relocates live blocks out of the retired id range and says which copies to make.

Prefix caching (vLLM v1's automatic prefix caching; SGLang's radix cache plays the same part):
every full block a request has computed is named by a hash chained from its parent's
(:mod:`tidal.core.block_hash`); a block keeps its name after its last user frees it (a cached
block, :mod:`tidal.core.block_pool`) until an allocation needs it. At admission the scheduler asks
for the longest named prefix of a request's tokens and counts it as computed; block tables then
share blocks, which ref counts keep alive. With a host tier (``host_tier=True``), cached blocks
that the device pool evicts are copied to the host pool (an LRU there too), and a prefix found
there is loaded back before the request runs; swap preemption uses the same host pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import cdiv
from tidal.core.block_hash import BlockHash, extend_hashes, salt_key
from tidal.core.block_pool import BlockPool, CacheDelta, net
from tidal.core.request import Request

__all__ = ["BlockPool", "CacheDelta", "KVAllocation", "KVCacheManager", "PrefixHit"]

_NO_DELTA = CacheDelta()


@dataclass(slots=True)
class KVAllocation:
    """What an allocation added: opaque to the scheduler beyond 'it worked'."""

    request_id: str
    new_blocks: tuple[int, ...]


@dataclass(slots=True)
class PrefixHit:
    """The longest cached prefix of a request: named device blocks, then named host blocks that
    continue it (to be loaded back), and the tokens they cover."""

    device: list[int]
    host: list[int]
    block_size: int
    num_loaded: int = 0  # host blocks taken (loaded back), once :meth:`KVCacheManager.take_prefix` ran

    @property
    def num_tokens(self) -> int:
        return (len(self.device) + len(self.host)) * self.block_size


class KVCacheManager:
    """Block tables of every request on one instance, over a device pool and a host (swap) pool."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_caching: bool = False, host_tier: bool = False):
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        if host_tier and not enable_caching:
            raise ValueError("a host tier of cached blocks needs prefix caching on")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.enable_caching = enable_caching
        self.host_tier = host_tier and num_host_blocks > 0
        self._tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        # each request's table as a tuple, made when a plan first asks after the table changed: a
        # decode step reuses it (a new block every block_size tokens), no copy per chunk
        self._frozen: dict[str, tuple[int, ...]] = {}
        self._named: dict[str, int] = {}  # leading blocks of a request's table already named (or tried)
        # a step's copies between the tiers, made while the scheduler plans it (begin_step/end_step):
        # device -> host (stores of evicted cached blocks) and host -> device (loads of hits)
        self._stores: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._pinned: list[int] = []  # host blocks read by this step's loads or swap-ins
        self._in_step = False

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks if self.pool.num_blocks else 0.0

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def frozen_table(self, request_id: str) -> tuple[int, ...]:
        """The block table as a tuple (what a plan carries), shared until the table changes."""
        t = self._frozen.get(request_id)
        if t is None:
            t = self._frozen[request_id] = tuple(self._tables.get(request_id, ()))
        return t

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def has(self, request_id: str) -> bool:
        return request_id in self._tables or request_id in self._host_tables

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks needed so ``request_id`` can hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for_tokens(num_tokens) - len(self._tables.get(request_id, ())))

    # ------------------------------------------------------------------ allocation
    def allocate(self, request_id: str, num_tokens: int, reserve: int = 0) -> KVAllocation | None:
        """Make room for ``num_tokens`` tokens in total; ``None`` if the pool cannot (then the
        caller preempts). ``reserve`` blocks must stay free afterwards (an admission watermark)."""
        table = self._tables.get(request_id)
        if table is not None and len(table) * self.block_size >= num_tokens and reserve <= self.pool.num_free:
            return KVAllocation(request_id, ())  # the common decode step: the last block has room
        if request_id in self._host_tables:
            raise ValueError(f"request {request_id} is swapped out; swap it in before allocating")
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free - reserve:
            return None
        new = self.pool.allocate(need) if need else []
        assert new is not None
        self._tables.setdefault(request_id, []).extend(new)
        if new:
            self._frozen.pop(request_id, None)
        return KVAllocation(request_id, tuple(new))

    def blocks_for_one_more(self, held: list[tuple[str, int]]) -> int:
        """The extra blocks needed for one more token each of ``held``, (request id, tokens it has
        now) pairs: a decode step's new blocks."""
        bs, tables = self.block_size, self._tables
        total = 0
        for request_id, num_tokens in held:
            table = tables.get(request_id)
            k = -(-(num_tokens + 1) // bs) - (len(table) if table else 0)
            if k > 0:
                total += k
        return total

    def allocate_one_more(self, held: list[tuple[str, int]]) -> None:
        """``allocate(request_id, num_tokens + 1)`` for each of ``held`` in order, once
        :meth:`blocks_for_one_more` said they all fit."""
        bs, tables = self.block_size, self._tables
        for request_id, num_tokens in held:
            table = tables.get(request_id)
            if (table is None or len(table) * bs <= num_tokens) and self.allocate(request_id, num_tokens + 1) is None:
                raise ValueError(f"no room for request {request_id}: check blocks_for_one_more first")

    def free(self, request_id: str) -> int:
        """Release every block of the request (device and host). Returns blocks released. Its named
        blocks stay cached, the last one first in line to be evicted (a later request is likelier to
        share a prompt's beginning than its end)."""
        table = self._tables.pop(request_id, [])
        self._frozen.pop(request_id, None)
        self._named.pop(request_id, None)
        self.pool.free(table[::-1])
        host = self._host_tables.pop(request_id, [])
        self._free_host(host)
        return len(table) + len(host)

    def _free_host(self, blocks: list[int]) -> None:
        if self._in_step:  # a store planned later in this step must not overwrite what it reads
            self._pinned.extend(blocks)
        else:
            self.host_pool.free(blocks[::-1])

    # ------------------------------------------------------------------ prefix caching
    def hashes(self, req: Request, num_tokens: int) -> list[BlockHash]:
        """The names of the full blocks of ``req``'s first ``num_tokens`` tokens (kept on the
        request: they survive preemption, and a request may arrive with some already named)."""
        return extend_hashes(req.block_hashes, req.token_ids, num_tokens, self.block_size,
                             salt_key(req.cache_salt))

    def find_prefix(self, req: Request) -> PrefixHit:
        """The longest prefix of ``req``'s known tokens (prompt and outputs) whose blocks are named
        here: device blocks, then host blocks that continue it. Capped one token short of all of
        them, so a step still computes the token that samples (whole blocks only: a prompt of
        exactly k blocks hits k - 1), and short of an alpha part's split point."""
        hit = PrefixHit([], [], self.block_size)
        if not self.enable_caching or req.num_computed_tokens or self.has(req.request_id):
            return hit
        cap = (req.num_tokens - 1) // self.block_size
        if req.pause_at is not None:  # a DynaServe alpha part: no KV past its split point (beta gets [0, pause_at))
            cap = min(cap, (req.pause_at - 1) // self.block_size)
        if cap <= 0:
            return hit
        names = self.hashes(req, cap * self.block_size)
        for name in names[:cap]:
            b = self.pool.lookup(name)
            if b is None:
                break
            hit.device.append(b)
        if self.host_tier:
            for name in names[len(hit.device):cap]:
                h = self.host_pool.lookup(name)
                if h is None:
                    break
                hit.host.append(h)
        return hit

    def peek_prefix_tokens(self, req: Request) -> int:
        """The tokens :meth:`find_prefix` would give ``req`` now (device and host tier), changing nothing."""
        hit = self.find_prefix(req)
        return hit.num_tokens

    def take_prefix(self, req: Request, hit: PrefixHit, reserve: int = 0) -> int:
        """Make ``hit`` the start of ``req``'s block table: a reference on each device block, and a
        fresh device block for each host block, loaded from it before the step runs (only as many
        as the pool has room for, keeping ``reserve`` free). Returns the tokens now computed."""
        if not hit.device and not hit.host:
            return 0
        rid = req.request_id
        if self.has(rid):
            raise ValueError(f"request {rid} already holds blocks; a prefix is taken before any")
        for b in hit.device:
            self.pool.touch(b)
        table = list(hit.device)
        n_load = hit.num_loaded = max(0, min(len(hit.host), self.pool.num_free - reserve))
        if n_load:
            for h in hit.host[:n_load]:  # read by this step's loads: no store may take them
                self.host_pool.touch(h)
                self._pinned.append(h)
            fresh = self.pool.allocate(n_load)
            assert fresh is not None
            names = req.block_hashes
            for h, d in zip(hit.host[:n_load], fresh, strict=True):
                self._loads.append((h, d))
                self.pool.name(d, names[len(table)])
                table.append(d)
        if table:
            self._tables[rid] = table
            self._named[rid] = len(table)
            self._frozen.pop(rid, None)
        return len(table) * self.block_size

    def take_cached_kv(self, req: Request) -> int:
        """A request whose first ``num_computed_tokens`` of KV arrive from elsewhere (a hand-off, a
        migration) starts its block table with the device blocks of its cached prefix, up to a token
        short of that KV (so some of it still lands); returns the tokens they hold."""
        computed = req.num_computed_tokens
        cap = (computed - 1) // self.block_size
        if cap <= 0 or not self.enable_caching:
            return 0
        req.num_computed_tokens = 0  # find_prefix looks up a request that holds nothing yet
        try:
            hit = self.find_prefix(req)
        finally:
            req.num_computed_tokens = computed
        device = hit.device[:cap]
        return self.take_prefix(req, PrefixHit(device, [], self.block_size)) if device else 0

    def cache_blocks(self, req: Request) -> None:
        """Name the full blocks of ``req`` whose KV is complete (``num_computed_tokens``), so later
        requests can hit them; decode-filled blocks too (turn N + 1 hits turn N's answer)."""
        if not self.enable_caching:
            return
        rid = req.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        full = min(req.num_computed_tokens // self.block_size, len(table))
        k = self._named.get(rid, 0)
        if k >= full:
            return
        names = self.hashes(req, full * self.block_size)
        for i in range(k, full):
            if self.pool.name_of(table[i]) is None:
                self.pool.name(table[i], names[i])
        self._named[rid] = full

    def begin_step(self) -> None:
        """The scheduler starts planning a step: evictions from here on are stored in the host
        tier (where there is one), and host blocks freed are held until the step's copies are made."""
        self._in_step = True
        if self.host_tier:
            self.pool.evictions = []

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step is planned: the (device, host) stores of the cached blocks it evicted and the
        (host, device) loads of the prefixes it hit, for the plan's copies (stores before loads)."""
        evicted, self.pool.evictions = self.pool.evictions or [], None
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        for b, name in evicted:
            h = self.host_pool.lookup(name)
            if h is not None:  # the host has it already: only its place in the LRU moves
                self.host_pool.touch(h)
                self.host_pool.free([h])
                continue
            got = self.host_pool.allocate(1)
            if got is None:  # every host block is held (swapped requests, this step's loads)
                continue
            self.host_pool.name(got[0], name)
            self.host_pool.free(got)
            stores.append((b, got[0]))
        pinned, self._pinned = self._pinned, []
        self.host_pool.free(pinned[::-1])
        self._in_step = False
        return stores, loads

    def reset_prefix_cache(self) -> int:
        """Forget every block name on both tiers (their KV may no longer match: the layers it holds
        changed, or a user asked). Live blocks stay where they are. Returns cached blocks dropped."""
        dropped = self.pool.forget_all() + self.host_pool.forget_all()
        for rid, table in self._tables.items():
            self._named[rid] = len(table)  # blocks already there are never named again
        return dropped

    def track_names(self) -> None:
        """Log the names the pools gain and lose from now on, for :meth:`drain_delta` (a front end
        routing by where KV lives reads them from the instance's reports)."""
        if self.pool.log is None:
            self.pool.log, self.host_pool.log = [], []

    def drain_delta(self) -> CacheDelta:
        """What the pools gained and lost since the last call (empty unless :meth:`track_names`)."""
        if self.pool.log is None or not (self.pool.log or self.host_pool.log):
            return _NO_DELTA
        reset_d, stored, evicted = net(self.pool.log)
        reset_h, host_stored, host_evicted = net(self.host_pool.log or ())
        self.pool.log, self.host_pool.log = [], []
        return CacheDelta(stored, evicted, host_stored, host_evicted, reset_d or reset_h)

    @property
    def num_plain_free_blocks(self) -> int:
        """Free blocks that name nothing (taking one evicts no prefix)."""
        return self.pool.num_free - self.pool.num_cached

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks nobody holds that still name a prefix (free space that may yet be hit)."""
        return self.pool.num_cached

    # ------------------------------------------------------------------ swap
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host blocks. Returns (device, host) copies, or None if
        the host pool is too small (then the caller falls back to recompute). With a host tier, a
        block whose name the host pool holds already is shared there, not copied again."""
        if request_id in self._host_tables:
            raise ValueError(f"request {request_id} is already swapped out")
        table = self._tables.get(request_id, [])
        names = [self.pool.name_of(b) if self.enable_caching else None for b in table]
        there = [self.host_pool.lookup(n) if n is not None else None for n in names]
        need = sum(1 for h in there if h is None)
        if need > self.host_pool.num_free:
            return None
        host: list[int] = []
        copies: list[tuple[int, int]] = []
        for b, name, h in zip(table, names, there, strict=True):
            if h is not None:
                self.host_pool.touch(h)
            else:
                h = self.host_pool.allocate(1)[0]  # type: ignore[index]
                copies.append((b, h))
                if name is not None:
                    self.host_pool.name(h, name)
            host.append(h)
        self._tables.pop(request_id, None)
        self._frozen.pop(request_id, None)
        self._named.pop(request_id, None)
        self.pool.free(table[::-1])
        self._host_tables[request_id] = host
        return copies

    def swap_in(self, request_id: str, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped request back. Returns (host, device) copies, or None if no room. A block
        whose name the device pool still holds is shared, not copied back."""
        host = self._host_tables.get(request_id)
        if host is None:
            raise KeyError(f"request {request_id} is not swapped out")
        names = [self.host_pool.name_of(h) if self.enable_caching else None for h in host]
        here = [self.pool.lookup(n) if n is not None else None for n in names]
        need = sum(1 for d in here if d is None)
        revived = sum(1 for d in here if d is not None and not self.pool.ref_count(d))  # cached: counted free
        if need + revived > self.pool.num_free - reserve:
            return None
        for d in here:  # hits first: an allocation below must not evict them
            if d is not None:
                self.pool.touch(d)
        fresh = iter(self.pool.allocate(need) or [])
        dev: list[int] = []
        copies: list[tuple[int, int]] = []
        named = 0
        for h, name, d in zip(host, names, here, strict=True):
            if d is None:
                d = next(fresh)
                copies.append((h, d))
                if name is not None:
                    self.pool.name(d, name)
            if name is not None and named == len(dev):
                named += 1
            dev.append(d)
        del self._host_tables[request_id]
        self._free_host(host)
        self._tables[request_id] = dev
        self._named[request_id] = named
        self._frozen.pop(request_id, None)
        return copies

    def num_host_blocks_of(self, request_id: str) -> int:
        return len(self._host_tables.get(request_id, ()))

    # ------------------------------------------------------------------ resize
    def grow(self, n: int) -> range:
        """Add ``n`` blocks (e.g. memory freed by dropped layers, KunServe §4.1)."""
        if n < 0:
            raise ValueError("grow by a negative number of blocks")
        return self.pool.grow(n)

    def shrink(self, n: int) -> list[tuple[int, int]] | None:
        """Remove ``n`` blocks from the top of the id space. Live blocks there are moved to free
        blocks below (cached ones there are forgotten); returns the (src, dst) copies the KV
        tensors must make *before* they are truncated, or None if fewer than ``n`` blocks are free."""
        if n < 0:
            raise ValueError("shrink by a negative number of blocks")
        if n > self.pool.num_free:
            return None
        new_size = self.pool.num_blocks - n
        live_high = [b for b in range(new_size, self.pool.num_blocks) if self.pool.ref_count(b)]
        free_low = self.pool.take_free_below(new_size, len(live_high))
        moves = list(zip(live_high, free_low, strict=True))
        remap = dict(moves)
        for src, dst in moves:
            self.pool.move(src, dst)
        if remap:
            self._frozen.clear()
            for table in self._tables.values():
                for i, b in enumerate(table):
                    if b in remap:
                        table[i] = remap[b]
        self.pool.truncate(new_size)
        return moves

    # ------------------------------------------------------------------ invariants (tests)
    def check_invariants(self) -> None:
        for pool, tables in ((self.pool, self._tables), (self.host_pool, self._host_tables)):
            counts: dict[int, int] = {}
            for table in tables.values():
                for b in table:
                    counts[b] = counts.get(b, 0) + 1
            if pool is self.host_pool:
                for b in self._pinned:
                    counts[b] = counts.get(b, 0) + 1
            pool.check(counts)
        for rid, k in self._named.items():
            table = self._tables.get(rid, [])
            if k > len(table):
                raise AssertionError(f"request {rid}: {k} blocks named of a table of {len(table)}")
