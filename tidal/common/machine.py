"""The one reader of what machine a result was measured on (CPU model, ISA, cores, torch).

Benchmarks, the simulator and the profiler all stamp their JSON with :func:`machine_info`, so
results taken on different CPUs (AVX2-only against AVX-512 BF16, say) are told apart.
torch is described only when the caller already imported it: this module never imports it.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from tidal.config import affinity_cores, env_str

ISA_PREFIXES = ("avx512_bf16", "amx", "avx512f", "avx2")
# variables that make torch, MKL, oneDNN and tidal's kernels use less of the CPU than it has (an AVX2 run on
# an AVX-512 machine: ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
# TIDAL_NATIVE_SIMD=avx2); a result names those that were set
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "TIDAL_NATIVE_SIMD")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """(model name, flags) of the first CPU in ``/proc/cpuinfo``; the platform's name elsewhere."""
    cpu, flags = "", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
                if cpu and flags:
                    break
    except OSError:
        pass
    return cpu or platform.processor() or "unknown", flags


def usable_cores() -> int:
    """Cores this process may run on (its affinity; the engine's default thread count unless
    ``TIDAL_CPU_THREADS`` gives it a share)."""
    return affinity_cores()


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info(**extra: Any) -> dict[str, Any]:
    """CPU model, the ISA extensions that decide the dtype, cores, Python, torch (if loaded) and
    the load average, plus ``extra`` (e.g. ``dtype=``, ``num_threads=``)."""
    cpu, flags = cpu_model_and_flags()
    info: dict[str, Any] = {
        "cpu_model": cpu,
        "isa": [f for f in flags if f.startswith(ISA_PREFIXES)],
        "cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": load_average(),
    }
    limits = {v: value for v in ISA_LIMITS if (value := env_str(v)) is not None}
    if limits:
        info["isa_limits"] = limits
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # the kernels torch dispatches to
    info.update(extra)
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for a benchmark's header: ``2 cores (AMD EPYC), torch 2.13.0, 1 threads, bfloat16``."""
    parts = [f"{info['cores']} cores ({info['cpu_model']})"]
    if "torch" in info:
        parts.append(f"torch {info['torch']}, {info.get('threads')} threads")
    if info.get("dtype"):
        parts.append(str(info["dtype"]))
    return ", ".join(parts)


__all__ = ["cpu_model_and_flags", "describe", "load_average", "machine_info", "usable_cores"]
