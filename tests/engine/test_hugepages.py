"""The KV cache's huge-page allocation: zeros of the asked shape, and the advice given where Linux takes it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tidal.engine import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (``always``, ``madvise``, ``never``), None without THP."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def test_zeros_are_zeros_of_the_shape_and_dtype():
    for shape, dtype in (((3, 16, 3, 64), torch.float32), ((700, 16, 3, 64), torch.float32),
                         ((600, 16, 2, 32), torch.bfloat16)):
        t = hugepages.zeros(shape, dtype, torch.device("cpu"))
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                    reason="needs Linux with transparent huge pages not switched off")
def test_large_cpu_tensors_are_advised_and_small_ones_not():
    big = torch.empty(3 * hugepages.HUGE // 4)  # 6 MiB: whole aligned huge pages inside
    assert hugepages.advise(big)
    assert not hugepages.advise(torch.empty(1024))  # 4 KiB holds no huge page
    assert not hugepages.advise(torch.empty(0))


def test_the_kv_cache_keeps_its_blocks_across_grow_and_shrink():
    from tidal.config import ModelArch
    from tidal.engine.kv_cache import PagedKVCache

    arch = ModelArch(architecture="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=100)
    cache = PagedKVCache(arch, [0, 1], num_blocks=300, block_size=16, dtype=torch.float32,
                         device=torch.device("cpu"))
    assert not cache.layers[0].k.any()
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers.values():
        layer.k.copy_(torch.randn(layer.k.shape, generator=g))
        layer.v.copy_(torch.randn(layer.v.shape, generator=g))
    before = {i: (kv.k.clone(), kv.v.clone()) for i, kv in cache.layers.items()}
    cache.grow(100)
    for i, kv in cache.layers.items():
        assert kv.k.shape[0] == 400
        assert torch.equal(kv.k[:300], before[i][0]) and torch.equal(kv.v[:300], before[i][1])
        assert not kv.k[300:].any() and not kv.v[300:].any()
    cache.shrink(150, moves=[(299, 0)])  # the manager relocates block 299 to 0, then the top 150 go
    for i, kv in cache.layers.items():
        assert kv.k.shape[0] == 250
        assert torch.equal(kv.k[0], before[i][0][299]) and torch.equal(kv.k[1:250], before[i][0][1:250])
        assert torch.equal(kv.v[0], before[i][1][299])
