"""The per-process caches of the loader (opt-in): parsed GGUF metadata and dequantized fp32 weights.

A process that builds several engines from one file (the test suite, benchmarks that compare
policies) would otherwise parse and dequantize it again for each. With ``TIDAL_WEIGHT_CACHE_MB`` set
to a positive budget, the parsed metadata of the last few files and the dequantized tensors of files
whose weights fit are kept, keyed by the file's identity (resolved path, device, inode, size, mtime).
Cached tensors are never handed out (the loader yields clones). The cache on disk, shared by every
process, is :mod:`tidal.engine.disk_cache`.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import torch

from tidal.config import env_str

CACHE_ENV = "TIDAL_WEIGHT_CACHE_MB"  # MiB of dequantized weights a process may keep; unset or 0: no caching
_META_CACHE_ENTRIES = 4


def cache_limit_bytes() -> int:
    raw = (env_str(CACHE_ENV) or "").strip()
    try:
        return max(0, int(float(raw) * 1024**2)) if raw else 0
    except ValueError:
        return 0


def file_key(path: str) -> tuple | None:
    """What identifies a file's contents well enough to reuse what was read from it; None: don't cache."""
    if cache_limit_bytes() <= 0:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _LRU:
    """A small thread-safe LRU map, bounded by its number of entries or (``sized``) by the bytes of the
    tensors in its values (the cache budget)."""

    def __init__(self, max_entries: int | None = None, sized: bool = False):
        self.max_entries, self.sized = max_entries, sized
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @staticmethod
    def _nbytes(value: list[tuple[str, torch.Tensor]]) -> int:
        return sum(t.numel() * t.element_size() for _, t in value)

    def get(self, key: tuple) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(key)
            return value

    def has(self, key: tuple) -> bool:
        """Whether ``key`` is held (neither a hit nor a miss)."""
        with self._lock:
            return key in self._items

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            limit = cache_limit_bytes()
            while self._items and (
                    (self.max_entries is not None and len(self._items) > self.max_entries)
                    or (self.sized and sum(self._nbytes(v) for v in self._items.values()) > limit)):
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0


meta_cache = _LRU(max_entries=_META_CACHE_ENTRIES)  # file key -> LoadedCheckpoint (metadata + reader)
weight_cache = _LRU(sized=True)  # file key -> [(hf_name, fp32 tensor)] in the file's order


def clear_cache() -> None:
    """Forget every parsed GGUF and every cached dequantized tensor of this process."""
    meta_cache.clear()
    weight_cache.clear()


__all__ = ["CACHE_ENV", "clear_cache", "file_key", "cache_limit_bytes", "meta_cache", "weight_cache"]
