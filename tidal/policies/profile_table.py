"""A pure profile table: (prefill tokens, mean decode context, decode count) -> step time.

DynaServe (Alg. 2, line 1, ``RECORD(T, B.plen, B.ctx, B.dnum, B.time)``) refines such a table from
every executed batch and consults it for the largest prefill budget that keeps a batch within
the TBT SLO (``MAXPREFILLALLOWED``). Here:

- **Cells**: a grid of buckets (``prefill_bucket`` tokens x ``context_bucket`` tokens x
  ``decode_bucket`` requests). Each cell keeps a running mean of the step time and of the feature
  vector of its samples. The count is capped at ``max_cell_weight``, which turns the running
  mean into an exponential average, so the table follows drift.
- **Regression**: weighted least squares of step time on
  x = [1, p, d, d*ctx, p*ctx] (features rescaled, with a tiny ridge). It is fitted from every
  sample through its 5x5 normal equations, in plain Python.
- **Prediction**: a cell with at least ``min_cell_samples`` gives its mean, moved along the
  regression's slope from the cell's centroid to the query:
  t = mean_t + w.(x - mean_x). A cell that has never been seen falls back to the regression,
  w.x. An empty table predicts nothing (``None``).

``dump()`` / ``load()`` round-trip the table through a JSON-able dict, so a table can be
seeded from an offline profile. ``load`` also takes plain records
``{"prefill_tokens", "mean_context", "decode_count", "time_s"}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

NUM_FEATURES = 5
_P_SCALE, _D_SCALE, _C_SCALE = 512.0, 64.0, 1024.0  # keep the normal equations well conditioned


def features(prefill_tokens: float, mean_context: float, decode_count: float) -> list[float]:
    """x = [1, p, d, d*ctx, p*ctx], rescaled."""
    p, d, c = prefill_tokens / _P_SCALE, decode_count / _D_SCALE, mean_context / _C_SCALE
    return [1.0, p, d, d * c, p * c]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (the first largest pivot); None if singular."""
    n = len(b)
    m = [row + [bi] for row, bi in zip(a, b, strict=True)]
    for col in range(n):
        piv, best = col, abs(m[col][col])
        for r in range(col + 1, n):
            v = abs(m[r][col])
            if v > best:
                piv, best = r, v
        if best < 1e-15:
            return None
        m[col], m[piv] = m[piv], m[col]
        top = m[col]
        for r in range(col + 1, n):
            row = m[r]
            f = row[col] / top[col]
            if f:
                for k in range(col, n + 1):
                    row[k] -= f * top[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        acc = 0.0
        for k in range(r + 1, n):
            acc += row[k] * x[k]
        x[r] = (row[n] - acc) / row[r]
    return x


@dataclass
class Cell:
    n: float = 0.0  # weight (capped)
    count: int = 0  # samples ever recorded
    mean_time: float = 0.0
    mean_x: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)


class ProfileTable:
    def __init__(self, prefill_bucket: int = 64, context_bucket: int = 256, decode_bucket: int = 4,
                 min_cell_samples: int = 1, max_cell_weight: float = 64.0, ridge: float = 1e-8):
        if min(prefill_bucket, context_bucket, decode_bucket) <= 0 or max_cell_weight < 1 or ridge < 0:
            raise ValueError("profile table: buckets must be > 0, max_cell_weight >= 1, ridge >= 0")
        self.prefill_bucket, self.context_bucket, self.decode_bucket = prefill_bucket, context_bucket, decode_bucket
        self.min_cell_samples, self.max_cell_weight, self.ridge = min_cell_samples, max_cell_weight, ridge
        self.cells: dict[tuple[int, int, int], Cell] = {}
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        self._weight = 0.0
        self._w: list[float] | None = None
        self._dirty = False
        self.num_samples = 0

    def __len__(self) -> int:
        return len(self.cells)

    def key(self, prefill_tokens: float, mean_context: float, decode_count: float) -> tuple[int, int, int]:
        return (int(prefill_tokens) // self.prefill_bucket, int(mean_context) // self.context_bucket,
                int(decode_count) // self.decode_bucket)

    # ------------------------------------------------------------------ learning
    def record(self, prefill_tokens: float, mean_context: float, decode_count: float, time_s: float,
               weight: float = 1.0) -> None:
        """DynaServe Alg. 2 line 1: RECORD(T, plen, ctx, dnum, time)."""
        if time_s < 0 or weight <= 0 or not math.isfinite(time_s):
            return
        x = features(prefill_tokens, mean_context, decode_count)
        cell = self.cells.setdefault(self.key(prefill_tokens, mean_context, decode_count), Cell())
        cell.count += 1
        cell.n = min(cell.n + weight, self.max_cell_weight)
        f = weight / cell.n if cell.n > weight else 1.0
        cell.mean_time += f * (time_s - cell.mean_time)
        cell.mean_x = [m + f * (xi - m) for m, xi in zip(cell.mean_x, x, strict=True)]
        self._add_regression(x, time_s, weight)
        self.num_samples += 1

    def _add_regression(self, x: list[float], y: float, weight: float) -> None:
        for i in range(NUM_FEATURES):
            wxi = weight * x[i]
            self._xty[i] += wxi * y
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] += wxi * x[j]
        self._weight += weight
        self._dirty = True

    def coefficients(self) -> list[float] | None:
        """The regression weights w (on the rescaled features), or None before any sample."""
        if self._weight == 0:
            return None
        if self._dirty or self._w is None:
            a = [row[:] for row in self._xtx]
            lam = self.ridge * max(self._weight, 1.0)
            for i in range(1, NUM_FEATURES):  # the intercept is not shrunk
                a[i][i] += lam
            self._w = _solve(a, self._xty) or [self._xty[0] / self._weight] + [0.0] * (NUM_FEATURES - 1)
            self._dirty = False
        return self._w

    # ------------------------------------------------------------------ prediction
    def predict(self, prefill_tokens: float, mean_context: float, decode_count: float) -> float | None:
        w = self.coefficients()
        if w is None:
            return None
        return self._estimate(w, features(prefill_tokens, mean_context, decode_count),
                              self.key(prefill_tokens, mean_context, decode_count))

    def _estimate(self, w: list[float], x: list[float], key: tuple[int, int, int]) -> float:
        """The prediction at features ``x`` in cell ``key``: the cell's mean moved along the slope
        (t = mean_t + w.(x - mean_x)), else the regression w.x; never below 0. Written out for the
        five features: a scheduler asks this a dozen times a step (:meth:`max_prefill`)."""
        cell = self.cells.get(key)
        if cell is not None and cell.count >= self.min_cell_samples:
            m = cell.mean_x
            t = cell.mean_time + (w[0] * (x[0] - m[0]) + w[1] * (x[1] - m[1]) + w[2] * (x[2] - m[2])
                                  + w[3] * (x[3] - m[3]) + w[4] * (x[4] - m[4]))
        else:
            t = w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3] + w[4] * x[4]
        return 0.0 if t < 0.0 else t

    def max_prefill(self, target_s: float, mean_context: float, decode_count: float, limit: int) -> int:
        """DynaServe's MAXPREFILLALLOWED: the largest p in [0, limit] with predict(p) <= target.

        This is a binary search over p, assuming time grows with p. An empty table allows
        ``limit``. If even p = 0 misses the target, it returns 0 (the caller applies its floor).
        """
        limit = max(int(limit), 0)
        w = self.coefficients()
        if w is None:
            return limit
        # predict(p, mean_context, decode_count) with what does not depend on p computed once
        x0 = features(0, mean_context, decode_count)
        c = mean_context / _C_SCALE
        k0 = self.key(0, mean_context, decode_count)
        pb, estimate = self.prefill_bucket, self._estimate

        def ok(p: int) -> bool:
            pp = p / _P_SCALE
            return estimate(w, [1.0, pp, x0[2], x0[3], pp * c], (p // pb, k0[1], k0[2])) <= target_s

        if ok(limit):
            return limit
        if not ok(0):
            return 0
        lo, hi = 0, limit  # ok(lo), not ok(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo

    # ------------------------------------------------------------------ persistence
    def dump(self) -> dict:
        return {
            "version": 1,
            "grid": {"prefill_bucket": self.prefill_bucket, "context_bucket": self.context_bucket,
                     "decode_bucket": self.decode_bucket, "min_cell_samples": self.min_cell_samples,
                     "max_cell_weight": self.max_cell_weight, "ridge": self.ridge},
            "cells": [{"key": list(k), "n": c.n, "count": c.count, "mean_time": c.mean_time,
                       "mean_x": list(c.mean_x)} for k, c in sorted(self.cells.items())],
            "regression": {"xtx": [row[:] for row in self._xtx], "xty": list(self._xty),
                           "weight": self._weight, "num_samples": self.num_samples},
        }

    @classmethod
    def load(cls, data: dict | list) -> ProfileTable:
        """From ``dump()``'s dict, or from a list of records (prefill_tokens, mean_context, decode_count, time_s)."""
        if isinstance(data, list):
            table = cls()
            for rec in data:
                table.record(rec["prefill_tokens"], rec["mean_context"], rec["decode_count"], rec["time_s"])
            return table
        if data.get("version") != 1:
            raise ValueError(f"profile table: unknown version {data.get('version')!r}")
        table = cls(**data["grid"])
        for c in data["cells"]:
            table.cells[tuple(c["key"])] = Cell(n=c["n"], count=c["count"], mean_time=c["mean_time"],
                                                mean_x=list(c["mean_x"]))
        reg = data["regression"]
        table._xtx = [list(map(float, row)) for row in reg["xtx"]]
        table._xty = list(map(float, reg["xty"]))
        table._weight = float(reg["weight"])
        table.num_samples = int(reg["num_samples"])
        table._dirty = True
        return table
