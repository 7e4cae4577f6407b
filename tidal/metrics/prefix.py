"""Prefix-cache reference points (pure): what an ideal cache could hit on a request sequence.

Given each request's prompt block names in arrival order (:mod:`tidal.core.block_hash`), two
bounds on the share of prompt tokens a prefix cache can serve:

- **unbounded**: every block ever seen stays cached (the reuse the traffic holds at all);
- **LRU of C blocks**: one least-recently-used cache of that many blocks that sees each request at
  its arrival (a cache of the same capacity that never has to hold blocks for running requests).

A request's hit is the longest run of its leading blocks found, capped one token short of its
prompt (as the scheduler caps it: the last token must be computed).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


def _capped(names: Sequence[bytes], prompt_len: int, block_size: int) -> Sequence[bytes]:
    return names[: max(0, (prompt_len - 1) // block_size)]


def prefix_bounds(requests: Sequence[tuple[Sequence[bytes], int]], block_size: int,
                  capacities: Sequence[int] = ()) -> dict[str, Any]:
    """``requests``: (block names, prompt tokens) in arrival order. Returns the prompt tokens, and
    the hit rate (share of prompt tokens) of an unbounded cache and of an LRU of each capacity."""
    total = sum(n for _, n in requests)
    seen: set[bytes] = set()
    unbounded = 0
    lrus: dict[int, OrderedDict[bytes, None]] = {c: OrderedDict() for c in capacities}
    lru_hits = dict.fromkeys(capacities, 0)
    for names, n in requests:
        capped = _capped(names, n, block_size)
        k = 0
        while k < len(capped) and capped[k] in seen:
            k += 1
        unbounded += k * block_size
        seen.update(names)
        for c, lru in lrus.items():
            k = 0
            while k < len(capped) and capped[k] in lru:
                k += 1
            lru_hits[c] += k * block_size
            for name in names:
                if name in lru:
                    lru.move_to_end(name)
                else:
                    lru[name] = None
            while len(lru) > c:
                lru.popitem(last=False)
    def rate(x: int) -> float:
        return x / total if total else 0.0

    return {"prompt_tokens": total, "unbounded_hit_rate": rate(unbounded),
            "lru_hit_rate": {str(c): rate(lru_hits[c]) for c in capacities}}


def cache_summary(instances: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A run's prefix-cache figures from its instances' counters (tokens): queries, hits on the
    device pool and in the host tier, and their rates."""
    q = sum(i.get("prefix_queries", 0) for i in instances)
    hits = sum(i.get("prefix_hits", 0) for i in instances)
    host = sum(i.get("prefix_host_hits", 0) for i in instances)
    return {"queries": q, "hits": hits, "host_hits": host, "hit_rate": hits / q if q else 0.0,
            "pool_hit_rate": (hits - host) / q if q else 0.0, "host_hit_rate": host / q if q else 0.0}


__all__ = ["cache_summary", "prefix_bounds"]
