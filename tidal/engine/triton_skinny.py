"""Matrix products of few rows (decode steps) in Triton: ``x @ W.T`` for a 16-bit ``x`` [M, K], M <= 64.

Why: a decode step reads every weight once, so its products are bound by memory bandwidth. On an H200,
cuBLAS read the Llama-3-8B shape's QKV and output matrices at 1.8-2.3 TB/s at 1 and 32 rows, against 4.2 TB/s
for a plain copy (``benchmarks/gpu_check.py``'s kernels stage): those matrices are too small for its tiles to
keep every multiprocessor streaming. Here each program reads a ``BN``-row slab of ``W`` over a ``1/S`` share
of ``K`` (split-K), enough programs to fill the GPU twice over; the ``S`` partial sums (float32) are added
in a fixed order by a second kernel, so a result never depends on timing (no atomics) and equals itself
from run to run. The row count is padded to 16 inside the tile (the tensor cores' smallest).

The split count and tiles are a fixed function of the shape and the GPU's multiprocessor count
(:func:`plan`), not timed at start-up: every instance on a machine computes the same sums. CI checks the
kernels on the CPU under Triton's interpreter (``tests/engine/test_triton_skinny.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 64  # a step of more tokens goes to cuBLAS (its tiles fill the GPU there)
BN, BK = 64, 128  # a program's rows of W, and the K of one loop iteration


@dataclass(frozen=True)
class Plan:
    split: int  # programs along K (partial sums added by _reduce_kernel when > 1)
    bm: int  # the rows of x a tile holds: the row count rounded up to a power of two, at least 16


def plan(m: int, n: int, k: int, sms: int) -> Plan | None:
    """Tiles and split for an [m, k] x [k, n] product on a GPU of ``sms`` multiprocessors, or None where
    this kernel does not take it (too many rows, or a K that is no multiple of its loop step)."""
    if m > MAX_ROWS or m < 1 or k % BK:
        return None
    programs, split = triton.cdiv(n, BN), 1
    while programs * split < 2 * sms and split < 16 and k % (2 * split * BK) == 0:
        split *= 2
    return Plan(split, max(16, triton.next_power_of_2(m)))


@triton.jit
def _skinny_kernel(X, W, P, M, N, K_SPLIT, sxm, swn, spk, spm,
                   BM: tl.constexpr, BN_: tl.constexpr, BK_: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN_ + tl.arange(0, BN_)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK_)
    mmask = rm[:, None] < M
    nmask = rn[:, None] < N
    k0 = pid_k * K_SPLIT
    acc = tl.zeros([BM, BN_], tl.float32)
    for kk in range(k0, k0 + K_SPLIT, BK_):
        x = tl.load(X + rm[:, None] * sxm + (kk + rk)[None, :], mask=mmask, other=0.0)
        w = tl.load(W + rn[:, None] * swn + (kk + rk)[None, :], mask=nmask, other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(P + pid_k * spk + rm[:, None] * spm + rn[None, :], acc.to(P.dtype.element_ty),
             mask=mmask & (rn[None, :] < N))


@triton.jit
def _reduce_kernel(P, Out, total, spk, S: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(S):  # the splits in order: the same sum on every run
        acc += tl.load(P + s * spk + i, mask=mask, other=0.0)
    tl.store(Out + i, acc.to(Out.dtype.element_ty), mask=mask)


def matmul(x: torch.Tensor, w: torch.Tensor, p: Plan) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M, K] (rows contiguous) and ``w`` [N, K] (contiguous), as ``p`` says."""
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if p.split == 1 else torch.empty(p.split, m, n, dtype=torch.float32, device=x.device)
    _skinny_kernel[(triton.cdiv(n, BN), p.split)](
        x, w, part, m, n, k // p.split, x.stride(0), w.stride(0), part.stride(0) if p.split > 1 else 0,
        n, BM=p.bm, BN_=BN, BK_=BK, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4)
    if p.split > 1:
        total, block = m * n, 1024
        _reduce_kernel[(triton.cdiv(total, block),)](part, out, total, part.stride(0), S=p.split, BLOCK=block,
                                                     num_warps=4)
    return out


class Skinny:
    """The products of one GPU: a plan per shape, made once (``sms``: the GPU's multiprocessors)."""

    def __init__(self, sms: int):
        self.sms = sms
        self._plans: dict[tuple[int, int, int], Plan | None] = {}

    @classmethod
    def for_device(cls, device: torch.device) -> Skinny:
        return cls(torch.cuda.get_device_properties(device).multi_processor_count)

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """``x @ w.T`` through the kernel, or None where it does not take the shape (the caller runs cuBLAS)."""
        key = (x.shape[0], w.shape[0], w.shape[1])
        if key not in self._plans:
            self._plans[key] = plan(*key, self.sms)
        p = self._plans[key]
        return None if p is None else matmul(x, w, p)
