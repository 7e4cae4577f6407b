"""A cost model fitted to measurements of the real engine (``tidal profile``).

The profile (format ``tidal-profile/1``, written by :mod:`tidal.engine.profiler`) holds samples
described by their chunk lists ``[[start, num_tokens, sample], ...]`` and the median time the
engine took to execute each. The model follows KunServe's Eq. 1,
``cost_c = alpha * (p*c + (c^2 + c)/2) + beta * c + gamma``, with two changes the CPU engine needs:

- ``beta * tokens + gamma`` (the linear layers, per step) becomes a piecewise-linear curve of the
  step's token count, knots at powers of two. A small batch is bound by streaming the weights
  (flat), and the GEMMs' speed per row changes with the row count.
- decode attention is kept apart from prefill attention and follows the runner's layout: decodes
  are sorted by context and padded into groups (``decode_grouping``), so its cost is in the KV a
  group gathers, ``num * width``, with a ``(num * width)^1.5`` term because larger gathers spill
  out of the caches and cost more per token.

The other features (:data:`FEATURES`): ``sampled`` chunks (LM head and sampler),
``prefill_attn`` = sum over prefill chunks of ``p*c + (c^2 + c)/2`` (alpha), ``prefix_kv`` =
the KV a chunk with a cached prefix gathers (``p + c``), ``decodes``, ``decode_groups`` (attention
calls) and ``prefills``. All weights and knot values are non-negative least squares on relative
error. A step's time adds the engine's measured overhead outside execution:
``per_step_s + per_seq_s * num_chunks``.

On two profiles of SmolLM2-135M (bf16, 2 CPU threads), a straight line in tokens with linear
decode KV terms fitted with 4-6% median and 11-13% p90 relative error; this model fits with 2%
and 6% (5-fold cross-validated alike), close to the noise of the samples themselves.

Pure: no torch; numpy only to fit. ``step_time`` is plain Python.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tidal.core.plan import StepPlan

FORMAT = "tidal-profile/1"
FEATURES = ("sampled", "prefill_attn", "prefix_kv", "decode_kv", "decode_kv15", "decodes", "decode_groups",
            "prefills")
MIN_SAMPLES = 8
Chunk = tuple[int, int, bool]


def decode_groups(contexts: Sequence[int], fill: float, min_group: int) -> list[tuple[int, int]]:
    """(num, longest context) of each padded decode group, as the engine's runner forms them:
    contexts sorted longest first, a group closed where the next context falls below ``fill`` x
    the group's longest and the group has at least ``min_group`` decodes."""
    ctx = sorted(contexts, reverse=True)
    out, start = [], 0
    for i in range(1, len(ctx) + 1):
        if i == len(ctx) or (ctx[i] < fill * ctx[start] and i - start >= min_group):
            out.append((i - start, ctx[start]))
            start = i
    return out


def features(chunks: Iterable[Chunk], block_size: int = 16, fill: float = 0.67,
             min_group: int = 4) -> tuple[int, list[float]]:
    """(token count, feature vector in the order of :data:`FEATURES`) of one step's chunks."""
    tokens = sampled = prefills = 0
    attn = prefix_kv = 0.0
    dctx = []
    for start, n, sample in chunks:
        tokens += n
        if sample:
            sampled += 1
        if n == 1 and start > 0:
            dctx.append(start + 1)  # context after the step, as the runner pads it
        else:
            prefills += 1
            attn += start * n + (n * n + n) / 2
            if start:
                prefix_kv += start + n
    dkv = dkv15 = 0.0
    ngroups = 0
    if dctx:
        for num, longest in decode_groups(dctx, fill, min_group):
            g = num * -(-longest // block_size) * block_size
            dkv += g
            dkv15 += g * math.sqrt(g)
            ngroups += 1
    return tokens, [float(sampled), attn, prefix_kv, dkv, dkv15, float(len(dctx)), float(ngroups), float(prefills)]


def token_knots(token_counts: Iterable[int]) -> list[int]:
    """Knots of the token curve: the smallest and largest counts seen and the powers of two
    between them, less any knot no sample touches (its value could not be fitted)."""
    counts = sorted(set(token_counts))
    lo, hi = counts[0], counts[-1]
    knots = sorted({lo, hi} | {1 << i for i in range(40) if lo < 1 << i < hi})
    while True:
        used = set()
        for t in counts:
            i = bisect.bisect_left(knots, t)
            used.add(i)
            if knots[i] != t:
                used.add(i - 1)
        if len(used) == len(knots):
            return knots
        knots = [k for i, k in enumerate(knots) if i in used]


def _hats(t: float, knots: Sequence[int]) -> list[float]:
    """Weights of the knots whose linear interpolation gives the curve at ``t`` (in range)."""
    out = [0.0] * len(knots)
    i = bisect.bisect_left(knots, t)
    if i == 0 or len(knots) == 1:
        out[0] = 1.0
    else:
        i = min(i, len(knots) - 1)
        u = (t - knots[i - 1]) / (knots[i] - knots[i - 1])
        out[i - 1], out[i] = 1.0 - u, u
    return out


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, min ||a x - b|| s.t. x >= 0 (Lawson and Hanson's active set)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(m, n)
    for _ in range(max_iter or 3 * n + 10):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=-np.inf) <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, grad)))] = True
        for _ in range(n + 1):
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            neg = passive & (z <= tol)
            step = x[neg] - z[neg]
            alpha = float(np.min(np.where(step > 0, x[neg] / np.where(step > 0, step, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return np.clip(x, 0.0, None)


def fit_weights(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative weights minimizing the relative error sum(((x w - y) / y)^2)."""
    a = x / y[:, None]
    scale = np.sqrt((a * a).sum(axis=0))
    scale[scale == 0] = 1.0
    return nnls(a / scale, np.ones(len(y))) / scale


class ProfiledCostModel:
    """Step time = token curve(tokens) + weights . features(plan) + overhead."""

    name = "profiled"

    def __init__(self, weights: dict[str, float] | Sequence[float], knots: Sequence[int],
                 knot_values: Sequence[float], overhead_per_step_s: float = 0.0, overhead_per_seq_s: float = 0.0,
                 block_size: int = 16, fill: float = 0.67, min_group: int = 4,
                 samples: list[tuple[list[Chunk], float]] | None = None, meta: dict[str, Any] | None = None):
        if isinstance(weights, dict):
            weights = [float(weights.get(f, 0.0)) for f in FEATURES]
        if len(weights) != len(FEATURES):
            raise ValueError(f"expected {len(FEATURES)} weights ({', '.join(FEATURES)}), got {len(weights)}")
        if not knots or len(knots) != len(knot_values) or list(knots) != sorted(set(knots)):
            raise ValueError("the token curve needs increasing knots, one value each")
        self.weights = [float(w) for w in weights]
        self.knots = [int(k) for k in knots]
        self.knot_values = [float(v) for v in knot_values]
        # past the last knot: the mean slope over the upper half of the curve
        mid = bisect.bisect_left(self.knots, self.knots[-1] / 2)
        span = self.knots[-1] - self.knots[min(mid, len(self.knots) - 1)]
        self._slope = (self.knot_values[-1] - self.knot_values[mid]) / span if span > 0 else 0.0
        self.overhead_per_step_s = float(overhead_per_step_s)
        self.overhead_per_seq_s = float(overhead_per_seq_s)
        self.block_size, self.fill, self.min_group = block_size, fill, min_group
        self.samples = samples or []
        self.meta = meta or {}

    # ------------------------------------------------------------------ loading and fitting
    @classmethod
    def load(cls, path: str) -> ProfiledCostModel:
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"profile {path}: no such file (write one with `tidal profile`)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"profile {path}: cannot read it ({e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        try:
            return cls.from_profile(data)
        except ValueError as e:
            raise ValueError(f"profile {path}: {e}") from None

    @classmethod
    def from_profile(cls, data: Any) -> ProfiledCostModel:
        if not isinstance(data, dict):
            raise ValueError("not a profile: expected a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown format {data.get('format')!r}; expected {FORMAT!r}")
        bs = data.get("block_size", 16)
        if not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"block_size must be a positive integer, got {bs!r}")
        grouping = data.get("decode_grouping") or {}
        fill, min_group = float(grouping.get("fill", 0.67)), int(grouping.get("min_group", 4))
        samples = []
        for i, s in enumerate(data.get("samples") or []):
            try:
                chunks = [(int(st), int(n), bool(smp)) for st, n, smp in s["chunks"]]
                t = float(s["time_s"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"sample {i} is malformed: expected chunks [[start, num_tokens, sample], ...] "
                                 "and time_s") from None
            if not chunks or any(st < 0 or n <= 0 for st, n, _ in chunks) or not (t > 0 and math.isfinite(t)):
                raise ValueError(f"sample {i} has an empty or invalid chunk list or a non-positive time")
            samples.append((chunks, t))
        if len(samples) < MIN_SAMPLES:
            raise ValueError(f"too few samples to fit: {len(samples)} (need at least {MIN_SAMPLES})")
        feats = [features(c, bs, fill, min_group) for c, _ in samples]
        knots = token_knots(tokens for tokens, _ in feats)
        x = np.array([f + _hats(tokens, knots) for tokens, f in feats])
        y = np.array([t for _, t in samples])
        w = fit_weights(x, y)
        ov = data.get("overhead") or {}
        meta = {k: data.get(k) for k in ("model", "dtype", "device", "threads", "machine", "created")}
        return cls(w[:len(FEATURES)], knots, w[len(FEATURES):], float(ov.get("per_step_s", 0.0)),
                   float(ov.get("per_seq_s", 0.0)), bs, fill, min_group, samples, meta)

    # ------------------------------------------------------------------ prediction
    def token_time(self, tokens: float) -> float:
        """The linear layers' part: the token curve at ``tokens``."""
        knots, vals = self.knots, self.knot_values
        i = bisect.bisect_left(knots, tokens)
        if i == 0:
            return vals[0]
        if i == len(knots):
            return vals[-1] + self._slope * (tokens - knots[-1])
        a, b = knots[i - 1], knots[i]
        return vals[i - 1] + (vals[i] - vals[i - 1]) * (tokens - a) / (b - a)

    def execute_time(self, chunks: Iterable[Chunk]) -> float:
        """Seconds the runner takes to execute these chunks (no engine overhead)."""
        tokens, f = features(chunks, self.block_size, self.fill, self.min_group)
        w = self.weights
        return (self.token_time(tokens) + w[0] * f[0] + w[1] * f[1] + w[2] * f[2] + w[3] * f[3] + w[4] * f[4]
                + w[5] * f[5] + w[6] * f[6] + w[7] * f[7])

    def step_time(self, plan: StepPlan) -> float:
        chunks = plan.chunks
        if not chunks:
            return self.overhead_per_step_s
        t = self.execute_time([(c.start, len(c.token_ids), c.sample) for c in chunks])
        return t + self.overhead_per_step_s + self.overhead_per_seq_s * len(chunks)

    def coefficients(self) -> dict[str, float]:
        out = dict(zip(FEATURES, self.weights, strict=True))
        out.update({f"tokens@{k}": v for k, v in zip(self.knots, self.knot_values, strict=True)})
        return out

    def fit_report(self) -> dict[str, Any]:
        """How well the execution part fits the profile's own samples (relative errors)."""
        y = np.array([t for _, t in self.samples])
        if not len(y):
            return {"r2": float("nan"), "median_abs_rel_err": float("nan"), "p90_abs_rel_err": float("nan"),
                    "max_abs_rel_err": float("nan"), "coefficients": self.coefficients(), "num_samples": 0}
        pred = np.array([self.execute_time(c) for c, _ in self.samples])
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        rel = np.abs(pred - y) / y
        return {"r2": r2, "median_abs_rel_err": float(np.median(rel)),
                "p90_abs_rel_err": float(np.percentile(rel, 90)), "max_abs_rel_err": float(rel.max()),
                "coefficients": self.coefficients(), "num_samples": int(len(y))}
