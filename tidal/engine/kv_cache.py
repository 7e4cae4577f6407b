"""The paged KV tensors of one instance: follow the block manager's decisions in memory.

Per present layer, K and V are ``[num_blocks, block_size, kv_heads, head_dim]`` tensors on the
device; a host pool of the same layout holds swapped-out blocks. The pool can grow and shrink
at run time, layers can be dropped (their KV memory becomes blocks of the others) and re-added,
and a request's KV can be exported / imported by layer range and token range as plain tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from tidal.config import ModelArch
from tidal.engine import hugepages
from tidal.engine.attention import KVLayer


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_block_bytes(arch: ModelArch, block_size: int, dtype: torch.dtype, num_layers: int) -> int:
    """Bytes one block takes across ``num_layers`` layers (K and V)."""
    return block_size * arch.kv_bytes_per_token(_dtype_bytes(dtype), num_layers)


class PagedKVCache:
    def __init__(self, arch: ModelArch, layer_ids: Iterable[int], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0, scratch_block: bool = False):
        self.arch, self.block_size, self.dtype, self.device = arch, block_size, dtype, device
        self.num_blocks = num_blocks
        # one block past the pool that the manager never hands out: the padded rows of a CUDA-graph
        # decode step write their K/V there (engine/cuda_graph.py)
        self.spare = int(scratch_block)
        self.num_host_blocks = num_host_blocks
        self._shape = (block_size, arch.num_kv_heads, arch.head_dim)
        pin = device.type == "cuda"
        self.layers: dict[int, KVLayer] = {}
        self.host: dict[int, KVLayer] = {}
        for i in layer_ids:
            self._add_layer(i, pin)

    def _add_layer(self, i: int, pin: bool = False) -> None:
        self.layers[i] = KVLayer(self._alloc(self.num_blocks), self._alloc(self.num_blocks))
        if self.num_host_blocks:
            # empty, never zeroed: a host block is read only after a swap-out wrote it, so on CPU the
            # swap space costs memory only as blocks are swapped out (its pages are touched then)
            h = (self.num_host_blocks, *self._shape)
            self.host[i] = KVLayer(torch.empty(h, dtype=self.dtype, pin_memory=pin),
                                   torch.empty(h, dtype=self.dtype, pin_memory=pin))

    def _alloc(self, n: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """n blocks (and the scratch block, if any; on huge pages where the CPU's kernel gives them):
        ``like``'s first, zeros after."""
        t = hugepages.empty((n + self.spare, *self._shape), dtype=self.dtype, device=self.device)
        kept = 0 if like is None else min(len(like), n + self.spare)
        if kept:
            t[:kept] = like[:kept]
        t[kept:].zero_()
        return t

    @property
    def scratch_block(self) -> int:
        """The block past the pool (needs ``scratch_block=True``)."""
        if not self.spare:
            raise ValueError("this KV cache has no scratch block")
        return self.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return kv_block_bytes(self.arch, self.block_size, self.dtype, len(self.layers))

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    # ------------------------------------------------------------------ block copies
    def swap_out(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: (device, host) pairs."""
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves], device=self.device)
        dst = torch.tensor([m[1] for m in moves])
        for i, layer in self.layers.items():
            self.host[i].k[dst] = layer.k[src].to("cpu", non_blocking=False)
            self.host[i].v[dst] = layer.v[src].to("cpu", non_blocking=False)

    def swap_in(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: (host, device) pairs."""
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves])
        dst = torch.tensor([m[1] for m in moves], device=self.device)
        for i, layer in self.layers.items():
            layer.k[dst] = self.host[i].k[src].to(self.device)
            layer.v[dst] = self.host[i].v[src].to(self.device)

    def copy_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        if not moves:
            return
        src = torch.tensor([m[0] for m in moves], device=self.device)
        dst = torch.tensor([m[1] for m in moves], device=self.device)
        for layer in self.layers.values():
            layer.k[dst] = layer.k[src]
            layer.v[dst] = layer.v[src]

    # ------------------------------------------------------------------ resize
    def grow(self, n: int) -> None:
        for layer in self.layers.values():
            layer.k = self._alloc(self.num_blocks + n, layer.k)
            layer.v = self._alloc(self.num_blocks + n, layer.v)
        self.num_blocks += n

    def shrink(self, n: int, moves: Sequence[tuple[int, int]]) -> None:
        """Apply the manager's relocations, then drop the top ``n`` blocks (memory is freed)."""
        self.copy_blocks(moves)
        keep = self.num_blocks - n
        for layer in self.layers.values():
            layer.k = self._alloc(keep, layer.k[:keep])
            layer.v = self._alloc(keep, layer.v[:keep])
        self.num_blocks = keep

    def drop_layers(self, layer_ids: Iterable[int]) -> int:
        """Free the KV of these layers; returns the bytes freed."""
        freed = 0
        for i in layer_ids:
            layer = self.layers.pop(i)
            freed += layer.k.numel() * layer.k.element_size() * 2
            self.host.pop(i, None)
        return freed

    def add_layers(self, layer_ids: Iterable[int]) -> None:
        for i in layer_ids:
            if i in self.layers:
                raise ValueError(f"layer {i} already has a KV cache")
            self._add_layer(i, self.device.type == "cuda")

    # ------------------------------------------------------------------ export / import
    def _slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(list(block_table), dtype=torch.long)
        if end > len(block_table) * self.block_size:
            raise ValueError(f"tokens [{start}, {end}) exceed the request's {len(block_table)} blocks")
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def export(self, block_table: Sequence[int], layers: Iterable[int] | None = None,
               start: int = 0, end: int | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """KV of tokens ``[start, end)`` for ``layers`` as CPU tensors ``[n, kv_heads, head_dim]``."""
        end = len(block_table) * self.block_size if end is None else end
        slots = self._slots(block_table, start, end)
        out = {}
        for i in (sorted(self.layers) if layers is None else layers):
            layer = self.layers[i]
            flat_k = layer.k.view(-1, *self._shape[1:])
            flat_v = layer.v.view(-1, *self._shape[1:])
            out[i] = (flat_k[slots].cpu(), flat_v[slots].cpu())
        return out

    def import_(self, block_table: Sequence[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                start: int = 0) -> None:
        """Write exported KV into this cache at tokens ``start..`` of the given block table."""
        for i, (k, v) in kv.items():
            if i not in self.layers:
                raise ValueError(f"layer {i} has no KV cache on this instance")
            slots = self._slots(block_table, start, start + k.shape[0])
            layer = self.layers[i]
            layer.k.view(-1, *self._shape[1:]).index_copy_(0, slots, k.to(self.device, self.dtype))
            layer.v.view(-1, *self._shape[1:]).index_copy_(0, slots, v.to(self.device, self.dtype))
