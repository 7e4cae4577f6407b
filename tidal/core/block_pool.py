"""A pool of KV block ids with reference counts, and the prefix cache's bookkeeping over it.

Pure: ids and counts only; the engine's tensors (or the simulator's counters) follow. A block is
in one of three states:

- **live**: held by one or more requests (ref count > 0), possibly named by a block hash;
- **free**: ref count 0, no name; free ids come out lowest first (a heap), so live blocks gather at
  the bottom of the id space and a later shrink has little to relocate;
- **cached**: ref count 0 but still named (its KV is a prefix some later request may hit); kept in
  least-recently-freed order and handed out only when no free block is left, least recent first,
  forgetting its name (vLLM v1's free-block queue, SGLang's radix-cache LRU).

Cached blocks count as free space (``num_free``): any allocation may take them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tidal.core.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class CacheDelta:
    """What an instance's pools gained and lost since its last report, net: names stored and
    evicted on the device pool and in the host tier; ``reset``: everything before was forgotten
    (apply the rest after clearing)."""

    stored: tuple[BlockHash, ...] = ()
    evicted: tuple[BlockHash, ...] = ()
    host_stored: tuple[BlockHash, ...] = ()
    host_evicted: tuple[BlockHash, ...] = ()
    reset: bool = False

    @property
    def empty(self) -> bool:
        return not (self.stored or self.evicted or self.host_stored or self.host_evicted or self.reset)


def net(log: Iterable[tuple[bool, BlockHash | None]]) -> tuple[bool, tuple[BlockHash, ...], tuple[BlockHash, ...]]:
    """A pool's log (``(gained?, name)`` in order; ``(False, None)``: all forgotten) as (reset,
    stored, evicted): each name's last word, after the last reset."""
    last: dict[BlockHash, bool] = {}
    reset = False
    for gained, name in log:
        if name is None:
            reset, last = True, {}
        else:
            last[name] = gained
    return reset, tuple(n for n, g in last.items() if g), tuple(n for n, g in last.items() if not g)


class BlockPool:
    """Block ids ``0..num_blocks-1`` with reference counts and (optionally) names."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        self._ref: list[int] = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks))  # a valid heap already
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently freed first
        self._name: dict[int, BlockHash] = {}  # every named block, live or cached
        self._by_name: dict[BlockHash, int] = {}
        # where evicted (block, name) pairs go while someone listens (the host tier's stores); None: nobody
        self.evictions: list[tuple[int, BlockHash]] | None = None
        # names gained (True) and lost (False) in order, while someone listens (a front end's view of
        # where KV lives); None: nobody. A ``(False, None)`` entry: every name was forgotten
        self.log: list[tuple[bool, BlockHash | None]] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self._ref)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones and cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return len(self._ref) - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds that still name a prefix."""
        return len(self._lru)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def name_of(self, block: int) -> BlockHash | None:
        return self._name.get(block)

    def lookup(self, name: BlockHash) -> int | None:
        """The block named ``name`` (live or cached), or None."""
        return self._by_name.get(name)

    def cached_names(self) -> list[BlockHash]:
        """The names of every named block (live or cached)."""
        return list(self._by_name)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (ref count 1): free ones first, then the least recently freed cached
        ones, whose names are forgotten (and reported to :attr:`evictions`); ``None`` if fewer than
        ``n`` can be taken."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free) + len(self._lru):
            return None
        k = min(n, len(self._free))
        out = [heapq.heappop(self._free) for _ in range(k)]
        for _ in range(n - k):
            b, _ = self._lru.popitem(last=False)
            name = self._name.pop(b)
            del self._by_name[name]
            if self.evictions is not None:
                self.evictions.append((b, name))
            if self.log is not None:
                self.log.append((False, name))
            out.append(b)
        for b in out:
            self._ref[b] = 1
        return out

    def touch(self, block: int) -> None:
        """Take one more reference on a named block (a prefix hit): a cached block becomes live."""
        if self._ref[block] == 0:
            if block not in self._lru:
                raise ValueError(f"block {block} is free, not cached: nothing to hit")
            del self._lru[block]
        self._ref[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block, in order: a named block whose last reference goes
        becomes cached (the later in ``blocks``, the more recently freed), any other free."""
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._name:
                    self._lru[b] = None
                else:
                    heapq.heappush(self._free, b)

    # ------------------------------------------------------------------ names
    def name(self, block: int, name: BlockHash) -> bool:
        """Name a live block whose KV is complete; False (and no name) if another block already
        has this name (two requests computed the same prefix) or this block has one."""
        if self._ref[block] <= 0:
            raise ValueError(f"only a live block can be named; block {block} is not held")
        if name in self._by_name or block in self._name:
            return False
        self._name[block] = name
        self._by_name[name] = block
        if self.log is not None:
            self.log.append((True, name))
        return True

    def forget(self, block: int) -> None:
        """Drop a block's name (its KV no longer matches it); a cached block becomes free."""
        name = self._name.pop(block, None)
        if name is None:
            return
        del self._by_name[name]
        if self.log is not None:
            self.log.append((False, name))
        if block in self._lru:
            del self._lru[block]
            heapq.heappush(self._free, block)

    def forget_all(self) -> int:
        """Forget every name (``POST /reset_prefix_cache``, a change of the layers the KV holds);
        cached blocks become free. Returns how many cached blocks were dropped."""
        dropped = len(self._lru)
        for b in self._lru:
            heapq.heappush(self._free, b)
        self._lru.clear()
        self._name.clear()
        self._by_name.clear()
        if self.log is not None:
            self.log.append((False, None))
        return dropped

    # ------------------------------------------------------------------ resize
    def grow(self, n: int) -> range:
        start = len(self._ref)
        self._ref.extend([0] * n)
        for b in range(start, start + n):
            heapq.heappush(self._free, b)
        return range(start, start + n)

    def truncate(self, new_size: int) -> None:
        """Drop ids ``>= new_size``; none of them may be live (cached ones are forgotten)."""
        if any(self._ref[b] for b in range(new_size, len(self._ref))):
            raise ValueError("cannot truncate the pool over live blocks")
        for b in [b for b in self._lru if b >= new_size]:
            self.forget(b)
        del self._ref[new_size:]
        self._free = [b for b in self._free if b < new_size]
        heapq.heapify(self._free)

    def take_free_below(self, limit: int, n: int) -> list[int]:
        """``n`` blocks with ids below ``limit`` that nobody holds, free ones lowest first, then
        cached ones (forgotten), for a shrink's relocations; they stay unreferenced."""
        out = sorted(b for b in self._free if b < limit)[:n]
        if len(out) < n:
            out += [b for b in self._lru if b < limit][: n - len(out)]
        for b in out:
            self.forget(b)
        return out

    def move(self, src: int, dst: int) -> None:
        """Give the live block ``src``'s references and name to the free block ``dst`` (a shrink)."""
        if self._ref[dst] != 0 or self._ref[src] == 0 or dst in self._name:
            raise ValueError(f"bad move {src}->{dst}")
        self._free.remove(dst)
        heapq.heapify(self._free)
        self._ref[dst], self._ref[src] = self._ref[src], 0
        name = self._name.pop(src, None)
        if name is not None:
            self._name[dst] = name
            self._by_name[name] = dst
        heapq.heappush(self._free, src)

    # ------------------------------------------------------------------ invariants (tests)
    def check(self, uses: dict[int, int]) -> None:
        """Raise unless each block's ref count equals ``uses`` (block -> holders) and the free,
        cached and live sets partition the pool."""
        for b in range(len(self._ref)):
            if self._ref[b] != uses.get(b, 0):
                raise AssertionError(f"block {b}: ref {self._ref[b]} != uses {uses.get(b, 0)}")
        free, cached = set(self._free), set(self._lru)
        if len(free) != len(self._free):
            raise AssertionError("a block is on the free list twice")
        if free & cached:
            raise AssertionError("a block is both free and cached")
        if any(self._ref[b] for b in free | cached):
            raise AssertionError("a live block is on the free list or cached")
        if any(b not in self._name for b in cached):
            raise AssertionError("a cached block has no name")
        if any(b in self._name for b in free):
            raise AssertionError("a free block still has a name")
        if {self._by_name[n]: n for n in self._by_name} != self._name:
            raise AssertionError("block names and their index disagree")
        if len(free) + len(cached) + sum(1 for r in self._ref if r) != len(self._ref):
            raise AssertionError("blocks leaked")
