"""Paged KV-cache bookkeeping: block pools with ref counts and per-request block tables.

Pure: this module decides which block ids hold which request's KV; the engine's KV tensors
(or the simulator's counters) follow its decisions. The pool can grow and shrink at run time;
shrinking relocates live blocks out of the retired id range and says which copies to make.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from tidal.config import cdiv


class BlockPool:
    """Fixed-size block ids ``0..num_blocks-1`` with reference counts.

    Free ids come out lowest first (a heap), so live blocks gather at the bottom of the id
    space and a later shrink has little to relocate.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self._ref: list[int] = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks))  # a valid heap already

    @property
    def num_blocks(self) -> int:
        return len(self._ref)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._ref) - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (ref count 1), or ``None`` if fewer are free."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            return None
        out = [heapq.heappop(self._free) for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                heapq.heappush(self._free, b)

    def grow(self, n: int) -> range:
        start = len(self._ref)
        self._ref.extend([0] * n)
        for b in range(start, start + n):
            heapq.heappush(self._free, b)
        return range(start, start + n)

    def truncate(self, new_size: int) -> None:
        """Drop ids ``>= new_size``; all of them must be free."""
        if any(self._ref[b] for b in range(new_size, len(self._ref))):
            raise ValueError("cannot truncate the pool over live blocks")
        del self._ref[new_size:]
        self._free = [b for b in self._free if b < new_size]
        heapq.heapify(self._free)

    def move(self, src: int, dst: int) -> None:
        """Give ``src``'s references to the free block ``dst`` (used when shrinking)."""
        if self._ref[dst] != 0 or self._ref[src] == 0:
            raise ValueError(f"bad move {src}->{dst}")
        self._free.remove(dst)
        heapq.heapify(self._free)
        self._ref[dst], self._ref[src] = self._ref[src], 0
        heapq.heappush(self._free, src)


@dataclass(slots=True)
class KVAllocation:
    """What an allocation added: opaque to the scheduler beyond 'it worked'."""

    request_id: str
    new_blocks: tuple[int, ...]


class KVCacheManager:
    """Block tables of every request on one instance, over a device pool and a host (swap) pool."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        if block_size <= 0:
            raise ValueError("block_size must be > 0")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self._tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        # each request's table as a tuple, made when a plan first asks after the table changed: a
        # decode step reuses it (a new block every block_size tokens), no copy per chunk
        self._frozen: dict[str, tuple[int, ...]] = {}

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
        """Release every block of the request (device and host). Returns blocks released."""
        table = self._tables.pop(request_id, [])
        self._frozen.pop(request_id, None)
        self.pool.free(table)
        host = self._host_tables.pop(request_id, [])
        self.host_pool.free(host)
        return len(table) + len(host)

    # ------------------------------------------------------------------ swap
    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host blocks. Returns (device, host) copies, or None if
        the host pool is too small (then the caller falls back to recompute)."""
        if request_id in self._host_tables:
            raise ValueError(f"request {request_id} is already swapped out")
        table = self._tables.get(request_id, [])
        host = self.host_pool.allocate(len(table))
        if host is None:
            return None
        self._tables.pop(request_id, None)
        self._frozen.pop(request_id, None)
        self.pool.free(table)
        self._host_tables[request_id] = host
        return list(zip(table, host, strict=True))

    def swap_in(self, request_id: str, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Bring a swapped request back. Returns (host, device) copies, or None if no room."""
        host = self._host_tables.get(request_id)
        if host is None:
            raise KeyError(f"request {request_id} is not swapped out")
        if len(host) > self.pool.num_free - reserve:
            return None
        dev = self.pool.allocate(len(host))
        assert dev is not None
        del self._host_tables[request_id]
        self.host_pool.free(host)
        self._tables[request_id] = dev
        self._frozen.pop(request_id, None)
        return list(zip(host, dev, strict=True))

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
        blocks below; returns the (src, dst) copies the KV tensors must make *before* they are
        truncated, or None if fewer than ``n`` blocks are free."""
        if n < 0:
            raise ValueError("shrink by a negative number of blocks")
        if n > self.pool.num_free:
            return None
        new_size = self.pool.num_blocks - n
        live_high = [b for b in range(new_size, self.pool.num_blocks) if self.pool.ref_count(b)]
        free_low = sorted(b for b in self.pool._free if b < new_size)[: len(live_high)]
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
            for b in range(pool.num_blocks):
                if pool.ref_count(b) != counts.get(b, 0):
                    raise AssertionError(f"block {b}: ref {pool.ref_count(b)} != uses {counts.get(b, 0)}")
            free = pool._free
            if len(free) != len(set(free)):
                raise AssertionError("a block is on the free list twice")
            if any(pool.ref_count(b) for b in free):
                raise AssertionError("a live block is on the free list")
            if len(free) + sum(1 for b in range(pool.num_blocks) if pool.ref_count(b)) != pool.num_blocks:
                raise AssertionError("blocks leaked")
