"""Attention over the paged KV cache: the per-step batch the runner builds (:class:`AttentionBatch`,
its prefill chunks and decode groups), the K/V tensors of a layer, and the three ways a step attends:
torch's SDPA over gathered blocks, tidal's C++ kernels (float32 on CPU, ``engine/native.py``) and the Triton
kernels that read blocks in place (``engine/triton_attention.py``, on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PARTITION = 512  # tokens of context a Triton decode program covers (a split of FlashDecoding)


def num_splits(width_tokens: int) -> int:
    """Spans the Triton kernel splits a decode's context into: a function of the block-table width alone
    (here, not in triton_attention.py, so that sizing the CUDA graphs' pool needs no Triton)."""
    return max(1, -(-width_tokens // PARTITION))


# ------------------------------------------------------------------------------------ batch
@dataclass
class PrefillSeq:
    """One prefill chunk inside the flat token batch: tokens ``[offset, offset+n)``."""

    offset: int
    num_tokens: int
    start: int  # position of its first token (tokens already cached before it)
    block_table: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor | None  # [n, ctx] bool (True = attend); None when there is no cached prefix


@dataclass
class DecodeGroup:
    """Decodes ``[offset, offset+n)`` of the flat batch whose contexts are padded to one width."""

    offset: int
    num: int
    block_tables: torch.Tensor  # [n, width_blocks] long (int32 for the Triton kernel)
    mask: torch.Tensor | None  # [n, 1, 1, width_blocks * block_size] bool, True = attend (torch's path only)
    ctx_lens: torch.Tensor | None = None  # [n] int32: tokens each decode attends over (the Triton kernel)


@dataclass
class AttentionBatch:
    """Per-step tensors the attention layers need. Decodes come first in the token order."""

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: block * block_size + offset of each new token
    num_decodes: int
    decode_groups: list[DecodeGroup]  # decodes sorted by context, grouped to bound padding
    prefills: list[PrefillSeq]
    block_size: int
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) of `positions`, set by the model
    native_attention: bool = False  # decodes attend with tidal's paged kernel (set by the model)
    triton_attention: bool = False  # decodes and prefills attend with the Triton kernels (set by the model)
    varlen: object | None = None  # the prefills as the Triton kernel reads them (triton_attention.VarlenMeta)


class KVLayer:
    """The paged K and V tensors of one layer: [num_blocks, block_size, kv_heads, head_dim]."""

    __slots__ = ("k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Blocks of ``block_table`` ([..., nblk]) as one tensor [..., nblk * block_size, KVH, D].

    index_select on a flat index is several times faster on CPU than advanced indexing."""
    nb, bs, kvh, d = cache.shape
    out = cache.index_select(0, block_table.reshape(-1))
    return out.view(*block_table.shape[:-1], block_table.shape[-1] * bs, kvh, d)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv: KVLayer,
                    batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Write the new K/V into their slots, then attend over each request's cached context.

    q: [T, H, D]; k_new, v_new: [T, KVH, D]. Returns [T, H, D]. For decodes, each group of
    query heads sharing a KV head is folded into the query-length axis of that head, so K/V are
    gathered once and never repeated; prefills use SDPA's grouped-query mode, or tidal's causal kernel
    (``prefill_attention``) in eager float32 steps where it is built.
    """
    nb, bs, KVH, D = kv.k.shape
    kv.k.view(nb * bs, KVH, D).index_copy_(0, batch.slot_mapping, k_new.to(kv.k.dtype))
    kv.v.view(nb * bs, KVH, D).index_copy_(0, batch.slot_mapping, v_new.to(kv.v.dtype))
    return attend(q, k_new, v_new, kv, batch, scale)


def attend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv: KVLayer, batch: AttentionBatch,
           scale: float) -> torch.Tensor:
    """paged_attention once the new K/V are in their slots (a prefill with no cached prefix reads them from
    k_new and v_new, everything else from the cache)."""
    G = q.shape[1] // k_new.shape[1]
    nd = batch.num_decodes
    native = batch.native_attention and not torch.compiler.is_compiling()
    if nd and not batch.prefills and len(batch.decode_groups) == 1:
        return _decode_attention(q, kv, batch, batch.decode_groups[0], scale)
    out = torch.empty_like(q)
    for g in batch.decode_groups:
        out[g.offset:g.offset + g.num] = _decode_attention(q[g.offset:g.offset + g.num], kv, batch, g, scale)
    if batch.triton_attention and batch.varlen is not None:  # every chunk in one varlen call (triton_attention.py)
        from tidal.engine import triton_attention

        triton_attention.prefill(q, kv.k, kv.v, batch.varlen, scale, out)
        return out
    for p in batch.prefills:
        n = p.num_tokens
        if native:  # tidal's tiled causal kernel (engine/kernels/prefill_attention.cpp)
            if p.mask is None:  # the chunk's own fresh K/V
                k, v, offset = k_new[p.offset:p.offset + n], v_new[p.offset:p.offset + n], 0
            else:  # a cached prefix: query i sees keys [0, start + i]
                ctx = p.start + n
                k, v, offset = _gather(kv.k, p.block_table)[:ctx], _gather(kv.v, p.block_table)[:ctx], p.start
            out[p.offset:p.offset + n] = torch.ops.tidal.prefill_attention(q[p.offset:p.offset + n], k, v, offset,
                                                                           scale)
            continue
        qp = q[p.offset:p.offset + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.mask is None:  # no cached prefix: attend over the chunk's own fresh K/V, causally
            k = k_new[p.offset:p.offset + n].transpose(0, 1).unsqueeze(0)
            v = v_new[p.offset:p.offset + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)
        else:
            ctx = p.start + n
            k = _gather(kv.k, p.block_table)[:ctx].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, KVH, ctx, D]
            v = _gather(kv.v, p.block_table)[:ctx].transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, scale=scale, enable_gqa=G > 1)
        out[p.offset:p.offset + n] = o[0].transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, kv: KVLayer, batch: AttentionBatch, group: DecodeGroup,
                      scale: float) -> torch.Tensor:
    if batch.triton_attention:  # every decode in one call, blocks read in place (engine/triton_attention.py)
        from tidal.engine import triton_attention

        lens = group.ctx_lens if group.ctx_lens is not None else \
            batch.positions[group.offset:group.offset + group.num] + 1
        return triton_attention.decode(q, kv.k, kv.v, group.block_tables, lens, scale)
    if batch.native_attention:  # reads the blocks in place (engine/native.py); a decode sees 0..its position
        return torch.ops.tidal.paged_decode_attention(q.contiguous(), kv.k, kv.v, group.block_tables,
                                                      batch.positions[group.offset:group.offset + group.num],
                                                      scale)
    nd, H, D = q.shape
    KVH = kv.k.shape[2]
    k = _gather(kv.k, group.block_tables).transpose(1, 2).to(q.dtype)  # [nd, KVH, ctx, D]
    v = _gather(kv.v, group.block_tables).transpose(1, 2).to(q.dtype)
    qd = q.view(nd, KVH, H // KVH, D)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=group.mask, scale=scale)
    return o.reshape(nd, H, D)


def _triton_unavailable(head_dim: int) -> str | None:
    """Why the Triton kernels cannot run here, or None."""
    try:
        from tidal.engine import triton_attention
    except ImportError as e:
        return f"Triton is not importable ({e})"
    if not triton_attention.supported(head_dim):
        return f"the Triton kernels take head sizes that are powers of two >= 16, not {head_dim}"
    return None
