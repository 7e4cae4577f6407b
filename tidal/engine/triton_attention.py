"""Paged attention in Triton: every decode of a step in one call a layer, every prefill chunk in one
call a layer (varlen), both reading K and V from the paged cache's blocks in place.

Why: the torch path gathers each request's blocks into a padded tensor for every layer and calls SDPA
once per decode group and once per prefill chunk; on a GPU that is a copy of the whole context and
tens of launches a layer. These kernels walk each sequence's block table instead.

- :func:`decode`: FlashDecoding (split-K): programs ``(decode, kv head, split)``; a program takes the
  ``G`` query heads that share one KV head as the rows of one tile (GQA without repeating K/V), runs
  FlashAttention's online softmax over its span of the context, and writes its partial output and
  log-sum-exp; the spans are merged after (``out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``).
  The split count depends only on the block-table width, so a CUDA graph captured at one width
  replays for any context up to it; spans past a decode's context do no work.
- :func:`prefill`: FlashAttention-2's loop over query tiles of every chunk of the step (a tile table
  built once a step by :func:`varlen_meta`), causal relative to each chunk's cached prefix: query ``i``
  of a chunk that starts at ``start`` sees keys ``[0, start + i]``.

Float32 runs the dots in IEEE float32 (no TF32), so tokens match the SDPA reference; 16-bit runs them
on the tensor cores with float32 accumulation. On CPU the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``): CI checks them against SDPA there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal.engine import attention
from tidal.engine.attention import num_splits
from tidal.engine.triton_fused import merge_splits

TILE_N = 32  # keys a loop iteration reads (two 16-token blocks)
BLOCK_M = 32  # query rows of a prefill tile


@triton.jit
def _decode_kernel(Q, K, V, Tables, Lens, Out, Lse, scale,
                   sqn, sqh, skb, skt, skh, stn, son, soh, sos, sln, slh,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   TILE: tl.constexpr, PART: tl.constexpr, IEEE: tl.constexpr):
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(Lens + n)
    lo = s * PART
    hi = tl.minimum(lo + PART, ctx)
    rows = tl.arange(0, GP)
    rmask = rows < G
    d = tl.arange(0, D)
    heads = kvh * G + rows
    q = tl.load(Q + n * sqn + heads[:, None] * sqh + d[None, :], mask=rmask[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for t0 in range(lo, hi, TILE):
        toks = t0 + tl.arange(0, TILE)
        tmask = toks < hi
        blk = tl.load(Tables + n * stn + toks // BS, mask=tmask, other=0)
        off = blk.to(tl.int64) * skb + (toks % BS) * skt + kvh * skh
        k = tl.load(K + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(tmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    has = lsum > 0
    out = acc / tl.where(has, lsum, 1.0)[:, None]
    tl.store(Out + n * son + heads[:, None] * soh + s * sos + d[None, :], out, mask=rmask[:, None])
    tl.store(Lse + n * sln + heads * slh + s, tl.where(has, m + tl.log(tl.where(has, lsum, 1.0)), float("-inf")),
             mask=rmask)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q`` [N, H, D] (one token per decode) over each decode's first ``ctx_lens[i]`` cached
    tokens, read through ``block_tables`` [N, W] from ``k_cache``/``v_cache`` [blocks, BS, KVH, D]."""
    n, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = h // kvh
    splits = num_splits(block_tables.shape[1] * bs)
    q = q if q.stride(-1) == 1 else q.contiguous()  # rows and heads may be strided (a slice of the QKV rows)
    tables = block_tables.to(torch.int32) if block_tables.dtype != torch.int32 else block_tables
    lens = ctx_lens.to(torch.int32)
    o = torch.empty(n, h, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(n, h, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(n, kvh, splits)](
        q, k_cache, v_cache, tables, lens, o, lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BS=bs, TILE=TILE_N, PART=attention.PARTITION,
        IEEE=q.dtype == torch.float32)
    if splits == 1:
        return o[:, :, 0].to(q.dtype)
    return merge_splits(o, lse, q.dtype)  # sum_s exp(lse_s - logsumexp(lse)) o_s: each span's share, one kernel


@triton.jit
def _prefill_kernel(Q, K, V, Out, Tables, TileSeq, TileRow, QOff, QLen, Start, scale,
                    sqt, sqh, skb, skt, skh, stn, sot, soh,
                    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    IEEE: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // G
    seq = tl.load(TileSeq + tile)
    r0 = tl.load(TileRow + tile)
    qoff = tl.load(QOff + seq)
    qlen = tl.load(QLen + seq)
    start = tl.load(Start + seq)
    rows = r0 + tl.arange(0, BM)
    rmask = rows < qlen
    d = tl.arange(0, D)
    q = tl.load(Q + (qoff + rows)[:, None] * sqt + head * sqh + d[None, :], mask=rmask[:, None], other=0.0)
    qpos = start + rows  # each row's position: it sees keys 0..qpos
    m = tl.full([BM], float("-inf"), tl.float32)
    lsum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    hi = tl.minimum(start + r0 + BM, start + qlen)  # keys past the tile's last row are never seen
    for t0 in range(0, hi, BN):
        toks = t0 + tl.arange(0, BN)
        tmask = toks < hi
        blk = tl.load(Tables + seq * stn + toks // BS, mask=tmask, other=0)
        off = blk.to(tl.int64) * skb + (toks % BS) * skt + kvh * skh
        k = tl.load(K + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(tmask[None, :] & (toks[None, :] <= qpos[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row sees no key
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=tmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    tl.store(Out + (qoff + rows)[:, None] * sot + head * soh + d[None, :], out.to(Out.dtype.element_ty),
             mask=rmask[:, None])


@dataclass
class VarlenMeta:
    """A step's prefill chunks as the varlen kernel reads them (built once a step, used by every layer)."""

    tables: torch.Tensor  # [P, W] int32: each chunk's block table, padded
    q_offsets: torch.Tensor  # [P] int32: the chunk's first row in the flat token batch
    q_lens: torch.Tensor  # [P] int32
    starts: torch.Tensor  # [P] int32: tokens cached before the chunk
    tile_seq: torch.Tensor  # [tiles] int32: the chunk of each query tile
    tile_row: torch.Tensor  # [tiles] int32: the tile's first row within its chunk
    first_row: int  # the flat batch's first prefill row
    last_row: int  # one past its last


def varlen_meta(chunks: list[tuple[int, int, int, list[int] | torch.Tensor]], device: torch.device) -> VarlenMeta:
    """``chunks``: (row offset in the flat batch, tokens, cached prefix, block table) per prefill chunk."""
    width = max(len(t) for *_, t in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    tile_seq, tile_row = [], []
    for i, (_, n, _, t) in enumerate(chunks):
        tables[i, :len(t)] = torch.as_tensor(t, dtype=torch.int32)
        for r in range(0, n, BLOCK_M):
            tile_seq.append(i)
            tile_row.append(r)

    def dev(x: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.int32).to(device, non_blocking=True)

    return VarlenMeta(dev(tables), dev([c[0] for c in chunks]), dev([c[1] for c in chunks]),
                      dev([c[2] for c in chunks]), dev(tile_seq), dev(tile_row),
                      chunks[0][0], chunks[-1][0] + chunks[-1][1])


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMeta, scale: float,
            out: torch.Tensor) -> None:
    """Causal attention of every prefill chunk's queries (rows of ``q`` [T, H, D]) over its cached prefix
    and itself, written into ``out``'s rows (the chunks' K/V are already in the cache)."""
    t, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    grid = (meta.tile_seq.shape[0], h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.tables, meta.tile_seq, meta.tile_row, meta.q_offsets, meta.q_lens,
        meta.starts, scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.tables.stride(0), out.stride(0), out.stride(1),
        G=h // kvh, D=d, BS=bs, BM=BLOCK_M, BN=TILE_N, IEEE=q.dtype == torch.float32)


def supported(head_dim: int) -> bool:
    """The kernels take head sizes that are powers of two of at least 16 (tl.arange and tl.dot)."""
    return head_dim >= 16 and head_dim == 2 ** int(math.log2(head_dim))
