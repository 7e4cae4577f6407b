"""A decoder layer's elementwise work in Triton, fused: one kernel where torch's path runs several.

Why: torch's ops ran ~22 small kernels a decoder layer beside its four matrix products (RMSNorm and its
weight, RoPE's seven products and sums, two K/V scatters, SiLU and its product, the residual adds, FlashDecoding's
four-op merge), each costing a few microseconds however little it does. Fused, an 8B model's decode step on an
H200 runs ~400 kernels instead of ~700, and ``tidal bench offline`` gave 1.15-1.26x the out tok/s of the unfused
engine in the same run (``benchmarks/results/2026-11-30-69-h200-*``). Each group is one kernel:

- :func:`rms_norm`: ``weight * rms_norm(x)``, optionally after ``x + residual`` (the residual returned too);
- :func:`rope_write_kv`: rotates the query and key heads of a QKV row (rotate-half) and writes the key and
  value into the paged cache at their slots; returns the rotated queries;
- :func:`silu_mul`: ``silu(gate) * up`` over a fused gate-up row;
- :func:`merge_splits`: FlashDecoding's merge of the split partial outputs by their log-sum-exps.

Each rounds where torch's ops do (a bfloat16 product, sum or norm is rounded to bfloat16 before the next op
reads it, and float32 runs without fused multiply-adds), so a kernel's output equals the unfused ops' to the
last bit or within a rounding of the reductions' order and of the special functions (rsqrt, exp). CI checks
them against torch's ops on the CPU under Triton's interpreter (``tests/engine/test_triton_fused.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_FMA = {"enable_fp_fusion": False}  # float32 as torch computes it: a product rounded before the sum


@triton.jit
def _rms_norm_kernel(X, R, W, Out, ResOut, sx, sr, so, sro, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * sx + cols, mask=mask, other=0.0)
    if HAS_RES:  # the residual stream: x + residual rounded to its dtype, as torch's add
        r = tl.load(R + row * sr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * sro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    y = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)  # normalized in float32, rounded (HF's LlamaRMSNorm)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Out + row * so + cols, (w.to(tl.float32) * y.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(s), s)`` for ``s = x`` or ``s = x + residual`` (rows of ``x`` [T, N])."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if residual is not None else x
    if t:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(t,)](x, residual if residual is not None else x, weight, out, res, x.stride(0),
                               residual.stride(0) if residual is not None else 0, out.stride(0), res.stride(0), n,
                               eps, HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
                               **NO_FMA)
    return out, res


@triton.jit
def _rope_kv_kernel(QKV, Cos, Sin, Slots, Q, KC, VC, sqkv, scos, ssin, sqt, sqh, skc, skh, svc, svh,
                    H: tl.constexpr, KVH: tl.constexpr, HP: tl.constexpr, KVP: tl.constexpr,
                    D: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, HALF)
    c = tl.load(Cos + t * scos + j).to(tl.float32)[None, :]
    s = tl.load(Sin + t * ssin + j).to(tl.float32)[None, :]
    dt = QKV.dtype.element_ty
    # query heads: x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product rounded as torch's ops round
    hq = tl.arange(0, HP)
    mq = (hq < H)[:, None]
    base = QKV + t * sqkv + hq[:, None] * D + j[None, :]
    x1 = tl.load(base, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mq, other=0.0).to(tl.float32)
    o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    qdst = Q + t * sqt + hq[:, None] * sqh + j[None, :]
    tl.store(qdst, o1, mask=mq)
    tl.store(qdst + HALF, o2, mask=mq)
    # key heads, rotated the same way, and value heads: into the cache at this token's slot
    slot = tl.load(Slots + t).to(tl.int64)
    hk = tl.arange(0, KVP)
    mk = (hk < KVH)[:, None]
    kbase = QKV + t * sqkv + (H + hk[:, None]) * D + j[None, :]
    k1 = tl.load(kbase, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(kbase + HALF, mask=mk, other=0.0).to(tl.float32)
    r1 = ((k1 * c).to(dt).to(tl.float32) - (k2 * s).to(dt).to(tl.float32)).to(dt)
    r2 = ((k2 * c).to(dt).to(tl.float32) + (k1 * s).to(dt).to(tl.float32)).to(dt)
    kdst = KC + slot * skc + hk[:, None] * skh + j[None, :]
    tl.store(kdst, r1.to(KC.dtype.element_ty), mask=mk)
    tl.store(kdst + HALF, r2.to(KC.dtype.element_ty), mask=mk)
    d = tl.arange(0, D)
    v = tl.load(QKV + t * sqkv + (H + KVH + hk[:, None]) * D + d[None, :], mask=mk, other=0.0)
    tl.store(VC + slot * svc + hk[:, None] * svh + d[None, :], v.to(VC.dtype.element_ty), mask=mk)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """Rows of ``qkv`` [T, (H + 2 KVH) D]: the rotated queries [T, H, D]; the rotated keys and the values
    written to ``k_cache``/``v_cache`` [blocks, BS, KVH, D] at ``slots`` [T] (block * BS + offset).
    ``cos``/``sin``: [T, 1, D/2] (:meth:`Rotary.tables`)."""
    t = qkv.shape[0]
    q = torch.empty(t, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        kc = k_cache.view(-1, kv_heads, head_dim)  # [blocks * BS, KVH, D]: a slot's row
        vc = v_cache.view(-1, kv_heads, head_dim)
        _rope_kv_kernel[(t,)](qkv, cos, sin, slots, q, kc, vc, qkv.stride(0), cos.stride(0), sin.stride(0),
                              q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                              H=heads, KVH=kv_heads, HP=triton.next_power_of_2(heads),
                              KVP=triton.next_power_of_2(kv_heads), D=head_dim, HALF=head_dim // 2, **NO_FMA)
    return q


@triton.jit
def _silu_mul_kernel(GU, Out, sgu, so, N, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(GU + t * sgu + cols, mask=mask, other=0.0)
    u = tl.load(GU + t * sgu + N + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounded to the dtype, as F.silu's output is
    tl.store(Out + t * so + cols, (act.to(tl.float32) * u.to(tl.float32)).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows of ``gate_up`` [T, 2 I] (gate first): [T, I]."""
    t, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                      BLOCK=block, num_warps=4, **NO_FMA)
    return out


@triton.jit
def _merge_kernel(Part, Lse, Out, S, son, soh, sos, sln, slh, sout, south, SP: tl.constexpr, D: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    smask = sp < S
    lse = tl.load(Lse + n * sln + h * slh + sp, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # a span past the context (lse -inf) weighs 0
    w = w / tl.sum(w, 0)
    d = tl.arange(0, D)
    live = smask & (lse > float("-inf"))  # a span that saw no key adds nothing, whatever its partial holds
    o = tl.load(Part + n * son + h * soh + sp[:, None] * sos + d[None, :], mask=live[:, None], other=0.0)
    tl.store(Out + n * sout + h * south + d, tl.sum(o * w[:, None], 0).to(Out.dtype.element_ty))


def merge_splits(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FlashDecoding's merge: ``sum_s softmax(lse)_s o_s`` for ``o`` [N, H, S, D] and ``lse`` [N, H, S] (float32),
    in ``dtype`` [N, H, D]."""
    n, h, s, d = o.shape
    out = torch.empty(n, h, d, dtype=dtype, device=o.device)
    if n:
        _merge_kernel[(n, h)](o, lse, out, s, o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                              out.stride(0), out.stride(1), SP=max(2, triton.next_power_of_2(s)), D=d, num_warps=2)
    return out
