"""Llama-3 RoPE scaling recovered from the per-frequency factors llama.cpp stores (``rope_freqs``).

Pure arithmetic; a factor table that is no Llama-3 scaling raises ``ValueError`` (the loader turns it
into a ``ModelLoadError`` naming the file)."""

from __future__ import annotations

import math

import numpy as np


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, orig: float) -> np.ndarray:
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def llama3_rope_from_freq_factors(factors: np.ndarray, rope_theta: float, head_dim: int,
                                  context_length: int, path: str = "") -> dict | None:
    """Recover HF ``llama3`` rope-scaling parameters from llama.cpp's per-frequency ``rope_freqs``.

    llama.cpp stores ``1 / ((1 - s) / factor + s)`` per frequency (``s`` the clipped smoothing ramp).
    Those values depend only on ``factor`` and the ramp's two end points, so any (low, high, original
    context) triple that reproduces them is equivalent; the standard Llama 3.x values are tried first.
    """
    n = head_dim // 2
    if factors.shape[0] != n:
        raise ValueError(f"{path}: rope_freqs has {factors.shape[0]} entries, expected {n}")
    if np.allclose(factors, 1.0):
        return None
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())

    def matches(low: float, high: float, orig: float) -> bool:
        return bool(np.allclose(_llama3_factors(inv_freq, factor, low, high, orig), factors, rtol=1e-4, atol=1e-5))

    candidates = [(1.0, 4.0, 8192.0), (1.0, 4.0, float(context_length))]
    candidates += [(1.0, 4.0, float(2**k)) for k in range(10, 18)]
    for low, high, orig in candidates:
        if matches(low, high, orig):
            return _llama3_dict(factor, low, high, orig)
    # general fit: s = 1/ff ... is linear in inv_freq on the ramp; fix low = 1 and solve for high/orig
    inner = (factors > 1.0 + 1e-6) & (factors < factor * (1.0 - 1e-6))
    if factor > 1.0 and inner.sum() >= 2:
        s = (1.0 / factors[inner] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(inv_freq[inner], s, 1)
        if b < 0 and a > 0:
            high = 1.0 - 1.0 / b
            orig = 2 * math.pi * a * (high - 1.0)
            if matches(1.0, high, orig):
                return _llama3_dict(factor, 1.0, high, orig)
    raise ValueError(f"{path}: cannot interpret the rope_freqs tensor as Llama-3 rope scaling")


def _llama3_dict(factor: float, low: float, high: float, orig: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": int(round(orig))}


__all__ = ["llama3_rope_from_freq_factors"]
