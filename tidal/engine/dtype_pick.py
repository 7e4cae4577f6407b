"""What ``--dtype auto`` is on a CPU with native bf16: the faster of bfloat16 and float32, timed.

A CPU that reports native bf16 (AVX-512 BF16, AMX) does not always run bf16 matmuls faster than
float32 ones. Without AMX, torch's bf16 GEMM can reach about half the float32 GEMM's rate (one
2-core AVX-512 BF16 Xeon: 170 against 332 GFLOP/s on 2048^3, 0.44-0.76x at a model's prefill and
decode shapes); elsewhere it is the faster one. So ``auto`` times ``F.linear`` in both dtypes at
shapes a serving step has (a batch of decodes, a prefill chunk; weights cycled beyond the cache)
and picks bfloat16 only when it is at least :data:`MARGIN` faster (float32 keeps the float model's
tokens, so a tie goes to it). The answer is measured once per machine and kept on disk beside the
4-bit crossovers (``engine/disk_cache.py``, keyed by torch and the CPU: every process of a machine
picks alike, whatever its threads); processes that start together time one at a time and read what
the first stored.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import torch.nn.functional as F

from tidal.common.progress import startup_phase
from tidal.engine import disk_cache
from tidal.engine.quant import _cpu_id, _paired_ratio

MARGIN = 1.1  # bf16 must be this much faster than float32 to be picked
SHAPES = ((32, 1024, 4096), (512, 1024, 1024))  # (tokens, in, out): a step of 32 decodes; a prefill chunk
WORKING_SET = 64 << 20  # bytes of float32 weights each timing cycles through
REPEATS = 7

_picked: dict[tuple, int] = {}  # per process: the measured speed-up in percent


def _bf16_over_f32(m: int, k: int, n: int, repeats: int) -> float:
    """time(float32) / time(bfloat16) of ``F.linear`` at [m, k] x [n, k]^T, paired rounds."""
    g = torch.Generator().manual_seed(0)
    copies = max(1, WORKING_SET // (n * k * 4))
    w32 = [torch.randn(n, k, generator=g) for _ in range(copies)]
    w16 = [w.to(torch.bfloat16) for w in w32]
    x32 = torch.randn(m, k, generator=g)
    x16 = x32.to(torch.bfloat16)

    def cycle(x: torch.Tensor, ws: list[torch.Tensor]) -> None:
        for w in ws:
            F.linear(x, w)

    with torch.inference_mode():
        return _paired_ratio(functools.partial(cycle, x32, w32), functools.partial(cycle, x16, w16), repeats)


def bf16_speedup_percent(repeats: int = REPEATS) -> int:
    """How much faster bf16 matmuls run than float32 ones on this CPU, in percent of float32's rate
    (the geometric mean over :data:`SHAPES`; 200: twice as fast), measured once per machine."""
    key = ("bf16_over_f32", SHAPES, repeats)
    if key not in _picked:
        disk_key = "|".join(map(str, (*key, f"torch {torch.__version__}", torch.backends.cpu.get_cpu_capability(),
                                      _cpu_id())))
        timing = startup_phase("timing bfloat16 against float32 matmuls for --dtype auto (once per machine)", "timed") \
            if disk_cache.load_crossover(disk_key) is None else contextlib.nullcontext()
        with timing:
            _picked[key] = disk_cache.timed_once(disk_key, lambda: _geomean_percent(repeats))
    return _picked[key]


def _geomean_percent(repeats: int) -> int:
    ratios = [_bf16_over_f32(m, k, n, repeats) for m, k, n in SHAPES]
    return round(100 * math.exp(sum(map(math.log, ratios)) / len(ratios)))


def cpu_auto_dtype(f32_weight_bytes: int | None = None) -> torch.dtype:
    """``--dtype auto`` on CPU: float32 without native bf16; with it, bfloat16 when its matmuls are at
    least :data:`MARGIN` faster here, or when float32 weights (``f32_weight_bytes``, if known) would
    take more than half of this machine's memory; else float32."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    if f32_weight_bytes is not None and f32_weight_bytes > _total_memory() // 2:
        return torch.bfloat16
    return torch.bfloat16 if bf16_speedup_percent() >= 100 * MARGIN else torch.float32


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 1 << 62  # unknown: no memory guard
