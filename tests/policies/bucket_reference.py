"""Reference forms of BucketServe's formulas, for the tests: Eq. 5-6 in bytes for a model shape,
and Alg. 1's AdjustBuckets over the whole queue at once (the policy keeps its buckets change by
change in :class:`~tidal.policies.bucket_index.BucketIndex`, which the tests hold to this)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tidal.config import ModelArch
from tidal.policies.bucket import Bucket, bucket_key, n_max_prefix, safe_memory


def max_safe_batch_size(arch: ModelArch, dtype_bytes: int, m_remain_bytes: int,
                        seq_lens: int | Sequence[int], m_safe_frac: float = 0.9) -> int:
    """N_max = max{N | sum_{i<=N} S_i <= M_safe / (2 L H D B)}, M_safe = 0.9 M_remain (Eq. 5-6), in bytes.

    ``seq_lens`` is one S shared by every request (then N_max = floor(M_safe / (2LHDB S))) or the
    lengths in admission order (then the longest prefix that fits). 2LHDB is
    ``arch.kv_bytes_per_token(dtype_bytes)`` (H = the KV heads, which Eq. 1's H is for MHA).
    """
    budget_tokens = safe_memory(m_remain_bytes, m_safe_frac) / arch.kv_bytes_per_token(dtype_bytes)
    if isinstance(seq_lens, int):
        if seq_lens <= 0:
            raise ValueError("sequence length must be > 0")
        return int(budget_tokens // seq_lens)
    return n_max_prefix(seq_lens, budget_tokens)


def assign(bounds: Sequence[tuple[int, int]], items: Iterable[Any],
           key: Callable[[Any], int] = bucket_key) -> list[Bucket]:
    """Put each item in the bucket with low <= S < up (Alg. 1 lines 2-9); S >= L_max goes last."""
    buckets = [Bucket(lo, up) for lo, up in bounds]
    for item in items:
        s = key(item)
        for b in buckets:
            if b.low <= s < b.up:
                b.members.append(item)
                break
        else:  # S >= L_max: the last bucket
            buckets[-1].members.append(item)
    return buckets


def adjust_buckets(buckets: list[Bucket], n_max: int, theta: float = 0.5, l_max: int | None = None,
                   key: Callable[[Any], int] = bucket_key) -> list[Bucket]:
    """One round of AdjustBuckets (Alg. 1 lines 10-29): merge everything into [0, L_max) when
    the total is below N_max; else split each bucket holding more than m = N_max members of which
    more than theta lie below its midpoint."""
    total = sum(len(b.members) for b in buckets)
    if total < n_max:
        up = l_max if l_max is not None else buckets[-1].up
        return [Bucket(0, up, [m for b in buckets for m in b.members])]
    out: list[Bucket] = []
    for b in buckets:
        n = len(b.members)
        below = [m for m in b.members if key(m) < b.mid]
        if n > n_max and len(below) / n > theta and b.up - b.low >= 2:
            out.append(Bucket(b.low, b.mid, below))
            out.append(Bucket(b.mid, b.up, [m for m in b.members if key(m) >= b.mid]))
        else:
            out.append(b)
    return out
