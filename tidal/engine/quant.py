"""Weight-only int4 and int8 matmuls for weights stored as 4-bit (Q4_1) and 8-bit (Q8_0) groups.

A Q4_1 block is 32 weights ``q * d + m`` with ``q`` in 0..15 (llama.cpp's ``quantize_row_q4_1``:
``d = (max - min) / 15``, ``m = min``), so every group of 32 holds its own minimum (``q = 0``) and
maximum (``q = 15``). :func:`int4_grid` recovers ``q``, ``d`` and ``m`` from the dequantized float32
weights by each group's min and max and checks that ``q * d + m`` gives the weights back;
:func:`pack_int4` packs them for torch's CPU kernel ``_weight_int4pack_mm_for_cpu``, which computes
``(q - 8) * scale + zero``: ``scale = d``, ``zero = m + 8 d``. A matrix not on such a grid (F16,
Q8_0, the embedding, any HF float checkpoint) stays float.

The kernel reads a quarter of bf16's bytes, which pays while a step is bound by reading weights (few
tokens); with many tokens the float matmul wins. Where the two cross depends on the CPU, so
:func:`measure_crossover` times both at start-up on each matrix shape (on synthetic weights, before
the checkpoint loads), and a :class:`Int4Weight` is used for a step of at most ``max_tokens`` tokens.

An LM head stored as Q8_0 (``q * d``, ``|q| <= 127`` per group of 32) is recovered the same way by
:func:`int8_grid`; torch's ``_weight_int8pack_mm`` scales per output row only, so
:class:`GroupedInt8Weight` calls it once per group of 32 columns with that group's scales.
"""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.common.machine import cpu_model_and_flags
from tidal.engine import disk_cache, native

GROUP = native.GROUP  # Q4_0 / Q4_1 / Q8_0 block size
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)  # step sizes timed at start-up, up to the engine's
# largest step (``upto``: the step budget for decoder matrices, the most sequences a step holds for the LM head)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8, torch's CPU int4 layout
    scales_zeros: torch.Tensor  # [K / GROUP, N, 2] in the activation dtype
    max_tokens: int  # steps with at most this many tokens use the int4 kernel

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


def int4_shape_ok(n: int, k: int) -> bool:
    """The CPU kernel's packing takes whole groups along K and output rows in multiples of 16."""
    return k % GROUP == 0 and n % 16 == 0


def int4_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the int4 kernel can run here, else why not."""
    if device.type != "cpu":
        return f"the int4 kernel tidal uses is CPU-only (device {device})"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype} is not supported by the int4 kernel"
    return None


def int4_grid(weight: torch.Tensor, rel_tol: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight`` [N, K] (float32, as dequantized) as ``(q uint8 [N, K], d [N, K/32], m [N, K/32])``
    with ``weight == q * d + m`` per group of 32, or None if it is not on such a grid.

    ``rel_tol``: the largest error allowed, as a share of each group's step ``d``; float32 rounding of
    ``q * d + m`` is ~1e-6 of it, while a weight off the grid misses by up to half a step. (Cast to
    bf16 first, the weights leave the grid: this must see the checkpoint's float32 values.)"""
    n, k = weight.shape
    if k % GROUP or weight.dtype != torch.float32:
        return None
    w = weight.reshape(n, k // GROUP, GROUP)
    lo = w.amin(-1, keepdim=True)
    step = (w.amax(-1, keepdim=True) - lo) / 15
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((w - lo) / safe).clamp_(0, 15)
    if bool(((q * step + lo - w).abs() > rel_tol * safe).any()):  # Q4_1 data fits; anything finer does not
        return None
    return q.to(torch.uint8).reshape(n, k), step.squeeze(-1), lo.squeeze(-1)


def pack_int4(q: torch.Tensor, step: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
    """Pack an :func:`int4_grid` for the CPU kernel (``max_tokens`` still 0: set it by measurement)."""
    n, k = q.shape
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zero = lo + 8 * step  # the kernel's (q - 8) * scale + zero == q * d + m
    sz = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/32, N, 2]
    return Int4Weight(packed, sz, max_tokens=0)


def int8_grid(weight: torch.Tensor, rel_tol: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``weight`` [N, K] (float32, as dequantized) as ``(q int8 [N, K], d [N, K/32])`` with
    ``weight == q * d`` per group of 32 and ``|q| <= 127``, as GGUF's Q8_0 stores it (llama.cpp's
    ``quantize_row_q8_0``: ``d = amax / 127``, so each group holds a ``|q| = 127``); else None."""
    n, k = weight.shape
    if k % GROUP or weight.dtype != torch.float32:
        return None
    w = weight.reshape(n, k // GROUP, GROUP)
    d = w.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / safe).clamp_(-127, 127)
    if bool(((q * d - w).abs() > rel_tol * safe).any()):
        return None
    return q.to(torch.int8).reshape(n, k), d.squeeze(-1)


@dataclass
class GroupedInt8Weight:
    """A Q8_0 matrix for torch's ``_weight_int8pack_mm``, whose scales are per output row: one call
    per group of 32 input columns, each with that group's scales, summed in float32."""

    q: list[torch.Tensor]  # per group: int8 [N, 32]
    scales: list[torch.Tensor]  # per group: [N] in the activation dtype
    max_tokens: int  # steps with at most this many rows use it

    @classmethod
    def pack(cls, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> GroupedInt8Weight:
        return cls([q[:, g * GROUP:(g + 1) * GROUP].contiguous() for g in range(q.shape[1] // GROUP)],
                   [d[:, g].contiguous().to(dtype) for g in range(d.shape[1])], max_tokens=0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.q, *self.scales))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x[:, :GROUP].contiguous(), self.q[0], self.scales[0]).float()
        for g in range(1, len(self.q)):
            y += torch.ops.aten._weight_int8pack_mm(x[:, g * GROUP:(g + 1) * GROUP].contiguous(), self.q[g],
                                                    self.scales[g])
        return y


def _median_time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


_crossovers: dict[tuple, int] = {}  # measured once per process (tests and tools build many engines)
REPEATS = 11  # paired rounds per step size: the timing is paid once per machine (the disk cache keeps it)


@functools.cache
def _cpu_id() -> str:
    """The CPU as far as a timing depends on it: model name, a digest of its flags and the CPU count
    (a VM may name every EPYC alike; the flags tell generations apart)."""
    model, flags = cpu_model_and_flags()
    return f"{model}, flags {hashlib.sha256(' '.join(flags).encode()).hexdigest()[:8]}, {os.cpu_count()} cpus"


def _cached(fn):
    """Measure once per process, and once per machine: the result is also kept on disk
    (engine/disk_cache.py) under the shape, the kernels (torch's version, and the build of tidal's
    matmuls when they run), the threads and the CPU, so every worker of a cluster and every later
    start reads it instead of timing again (10-15 s of a start on 2 cores); processes that start
    together time one at a time (``disk_cache.crossover_lock``). Delete the file (or set
    TIDAL_DISK_CACHE_MB=0) to time again. ``measure.known(...)`` (the same arguments) says whether
    the timing is already known, so that a start prints a line only when it will time."""
    def keys(n: int, k: int, dtype: torch.dtype, repeats: int, kernels: str, upto: int) -> tuple[tuple, str]:
        # the whole shape: a smaller stand-in that fits in cache favours the float matmul
        key = (fn.__name__, n, k, dtype, repeats, kernels, upto, torch.get_num_threads())
        # torch's version either way: its float matmul is the other side of every ratio
        build = f"{native.matmul_build() + ' ' if kernels == 'tidal' else ''}torch {torch.__version__}"
        return key, "|".join(map(str, (*key, build, torch.backends.cpu.get_cpu_capability(), _cpu_id())))

    @functools.wraps(fn)
    def measure(n: int, k: int, dtype: torch.dtype, repeats: int = REPEATS, kernels: str = "torch", upto: int = 128) -> int:
        key, disk_key = keys(n, k, dtype, repeats, kernels, upto)
        if key not in _crossovers:
            _crossovers[key] = disk_cache.timed_once(disk_key, lambda: fn(n, k, dtype, repeats, kernels, upto))
        return _crossovers[key]

    def known(n: int, k: int, dtype: torch.dtype, repeats: int = REPEATS, kernels: str = "torch", upto: int = 128) -> bool:
        key, disk_key = keys(n, k, dtype, repeats, kernels, upto)
        return key in _crossovers or disk_cache.load_crossover(disk_key) is not None

    measure.known = known
    return measure


WORKING_SET = 64 << 20  # bytes of float weights a timing cycles through (more than a CPU's cache)


def _copies(n: int, k: int, dtype: torch.dtype) -> int:
    """How many copies of an [n, k] matrix a timing cycles through: a step of the model streams every
    layer's weights from memory, and a matrix timed alone would sit in cache and favour the float
    matmul (here: 3x its in-cache time for the float32 matrices of SmolLM2-135M)."""
    return max(1, min(64, -(-WORKING_SET // (n * k * torch.finfo(dtype).bits // 8))))


def _paired_ratio(fa, fb, repeats: int) -> float:
    """The median over ``repeats`` rounds of time(fa) / time(fb), the two timed back to back in each
    round: a drift of the machine's speed (another process, the clock) hits both sides of a round alike,
    where two separate medians can each catch a different phase of it."""
    fa()
    fb()
    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        ratios.append((t1 - t0) / max(time.perf_counter() - t1, 1e-9))
    return statistics.median(ratios)


def _largest_win(packed: list, weights: list[torch.Tensor], g: torch.Generator, repeats: int, upto: int) -> int:
    """The largest of ``_TOKENS`` at which ``packed[i].matmul`` beat ``F.linear(x, weights[i])`` (paired
    timings, each side cycling through its copies), up to the first size >= ``upto`` (no step is larger);
    0 if it never did. The scan stops after two sizes in a row where float won: one lost size alone is
    as likely a noisy timing (both kernels are near the core's peak there) as the crossover, and the
    rule is "the 4-bit kernel for every step up to the threshold". Beyond 64 tokens a matmul is bound
    by arithmetic, not by reading its weights, so fewer copies are cycled (the timing stays short)."""
    best, lost = 0, 0

    def cycle(fn, mats, x):
        for m in mats:
            fn(x, m)

    with torch.inference_mode():
        for m in _TOKENS:
            x = torch.randn(m, weights[0].shape[1], generator=g).to(weights[0].dtype)
            keep = max(1, len(packed) * 64 // max(m, 64))
            if _paired_ratio(functools.partial(cycle, lambda x, p: p.matmul(x), packed[:keep], x),
                             functools.partial(cycle, F.linear, weights[:keep], x), repeats) < 1.0:
                best, lost = m, 0
            else:
                lost += 1
                if lost == 2:
                    break
            if m >= upto:
                break
    return best


@_cached
def measure_crossover(n: int, k: int, dtype: torch.dtype, repeats: int = REPEATS, kernels: str = "torch",
                      upto: int = 128) -> int:
    """The largest step size (tokens) up to which the 4-bit kernel (``kernels``: torch's int4, or
    ``tidal``'s Q4_1 of engine/native.py) beat the float matmul on an ``[n, k]`` matrix of ``dtype``,
    timed here on synthetic weights; 0 if it never did."""
    if not int4_shape_ok(n, k):
        return 0
    g = torch.Generator().manual_seed(0)
    packed, weights = [], []
    for _ in range(_copies(n, k, dtype)):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        step = (torch.rand(n, k // GROUP, generator=g) * 0.01).half().float()
        lo = -8 * step
        weights.append((q.float().view(n, -1, GROUP) * step.unsqueeze(-1) + lo.unsqueeze(-1)).view(n, k).to(dtype))
        packed.append(native.Q4_1Weight.pack(q, step, lo) if kernels == "tidal" else pack_int4(q, step, lo, dtype))
    return _largest_win(packed, weights, g, repeats, upto)


@_cached
def measure_int8_crossover(n: int, k: int, dtype: torch.dtype, repeats: int = REPEATS, kernels: str = "torch",
                           upto: int = 128) -> int:
    """As :func:`measure_crossover`, for the LM head's 8-bit groups (:class:`GroupedInt8Weight`, or
    ``tidal``'s Q8_0 kernel, which takes whole tiles of eight output rows)."""
    if k % GROUP or (kernels == "tidal" and n % 8):
        return 0
    g = torch.Generator().manual_seed(0)
    packed, weights = [], []
    for _ in range(_copies(n, k, dtype)):
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        d = (torch.rand(n, k // GROUP, generator=g) * 0.01).half().float()
        weights.append((q.float().view(n, -1, GROUP) * d.unsqueeze(-1)).view(n, k).to(dtype))
        packed.append(native.Q8_0Weight.pack(q, d) if kernels == "tidal" else GroupedInt8Weight.pack(q, d, dtype))
    return _largest_win(packed, weights, g, repeats, upto)


def describe_quantization(report: dict) -> str:
    """One line for the start-up log and the benchmarks: which matrices run int4 (and the LM head
    int8), up to which step."""
    if report.get("why_not"):
        return f"float (quantization {report['requested']}: {report['why_not']})"
    n4, nf = report["int4_matrices"], report["float_matrices"]
    head = report.get("head_int8_max_tokens")
    head = f"; LM head as Q8_0 groups for <= {head if head < (1 << 30) else 'any'} rows" if head else ""
    isa = f", built for {report['kernel_isa']}" if report.get("kernel_isa") else ""
    kernels = f" (tidal's Q4_1/Q8_0 kernels{isa})" if report.get("kernels") == "tidal" else ""
    if not n4:
        return f"float ({nf} decoder matrices; none stored as 4-bit groups){head}{kernels}"
    tokens = ", ".join(f"{k} <= {v if v < (1 << 30) else 'any'}" for k, v in report["int4_max_tokens"].items())
    return f"int4 for {n4} of {n4 + nf} decoder matrices (steps of tokens: {tokens}){head}, float otherwise{kernels}"
