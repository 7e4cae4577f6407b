"""Machine measurements of ``tidal bench offline``: the machine record, the matmul peak the report
compares against, and the FLOPs of a decode step."""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

from tidal.common.machine import machine_info as report_machine_info


def machine_info(num_threads: int, dtype: str) -> dict[str, Any]:
    import torch  # noqa: F401  (loaded, so the machine record describes it)

    info = report_machine_info(num_threads=num_threads, dtype=dtype)
    for mod in ("transformers", "llama_cpp"):
        if importlib.util.find_spec(mod) is not None:
            try:
                info[mod] = getattr(__import__(mod), "__version__", "?")
            except Exception as e:  # noqa: BLE001 - a broken optional package must not stop the bench
                info[mod] = f"import failed: {e}"
    return info


def _time_op(fn: Callable[[], Any], min_time_s: float) -> float:
    """Seconds per call of ``fn``: enough calls to last ``min_time_s``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    iters = max(1, int(min_time_s / once))
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure_matmul_peak(hidden: int, dtype: str, square_n: int = 2048, skinny_m: int = 32,
                        samples: int = 5, min_time_s: float = 0.25) -> dict[str, Any]:
    """GFLOP/s of a square ``n x n @ n x n`` matmul and of a decode-shaped ``m x h @ h x 4h`` one."""
    import torch

    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"dtype": dtype, "samples": samples}
    with torch.inference_mode():
        a = torch.randn(square_n, square_n, generator=g).to(dt)
        b = torch.randn(square_n, square_n, generator=g).to(dt)
        flops = 2.0 * square_n ** 3
        ts = [_time_op(lambda: torch.mm(a, b), min_time_s) for _ in range(samples)]
        out["square"] = {"shape": [square_n, square_n, square_n], "gflops": flops / statistics.median(ts) / 1e9,
                         "gflops_samples": [flops / t / 1e9 for t in ts]}
        x = torch.randn(skinny_m, hidden, generator=g).to(dt)
        w = torch.randn(4 * hidden, hidden, generator=g).to(dt)  # an nn.Linear weight [out, in]
        flops = 2.0 * skinny_m * hidden * 4 * hidden
        ts = [_time_op(lambda: torch.nn.functional.linear(x, w), min_time_s) for _ in range(samples)]
        out["skinny"] = {"shape": [skinny_m, hidden, 4 * hidden], "gflops": flops / statistics.median(ts) / 1e9,
                         "gflops_samples": [flops / t / 1e9 for t in ts]}
    return out


def combine_peaks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The peak of several measurements (before and after the runs): per shape, the best median.

    A neighbour that is busy during one measurement only lowers that one; a peak is what the
    machine can do, so the better of the two is kept (both are in ``runs``).
    """
    out: dict[str, Any] = {"dtype": runs[0]["dtype"], "samples": runs[0]["samples"], "runs": runs}
    for shape in ("square", "skinny"):
        best = max(runs, key=lambda r: r[shape]["gflops"])
        out[shape] = {**best[shape], "when": best["when"]}
    return out


def linear_params(arch) -> int:
    """Weights of every matmul of a forward pass: q/k/v/o, gate/up/down per layer, plus lm_head
    (computed even when tied to the embedding)."""
    h = arch.hidden_size
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.intermediate_size
    return arch.num_layers * per_layer + arch.vocab_size * h


def decode_step_flops(arch, batch: int, sum_context: float) -> float:
    """2 * linear params * batch + attention (QK^T and PV: 4 * ctx * heads * head_dim per layer)."""
    attn = 4.0 * sum_context * arch.num_heads * arch.head_dim * arch.num_layers
    return 2.0 * linear_params(arch) * batch + attn
