"""A pure profile table: (prefill chunks, mean decode context, decode count) -> step time.

DynaServe (Alg. 2, line 1, ``RECORD(T, B.plen, B.ctx, B.dnum, B.time)``) refines such a table from
every executed batch and consults it for the largest prefill budget that keeps a batch within
the TBT SLO (``MAXPREFILLALLOWED``). A batch's prefill is described by its token count ``p`` and
by the chunks' own cached prefixes: a chunk of ``c`` tokens after a prefix of ``x`` attends over
``c*x + c^2/2`` pairs (KunServe Eq. 1's prefix and self terms), so a chunk deep into a long prompt
costs more than the same chunk at its start. Here:

- **Cells**: a grid of buckets: prefill tokens in steps of ``prefill_bucket``; the decodes' mean
  context, the decode count and the prefill's mean prefix in octaves of ``context_bucket``,
  ``decode_bucket`` and ``prefix_bucket`` ([0, b), [b, 2b), [2b, 4b), ...), so that an offline
  profile on a geometric grid (the simulator's :class:`~tidal.sim.step_grid.ProfileGrid`) has a
  point in the cell of most queries, which are then moved from a near point rather than read off
  the far regression. Each cell keeps a running mean of the step time and
  of the feature vector of its samples. The count is capped at ``max_cell_weight``, which turns
  the running mean into an exponential average, so the table follows drift.
- **Regression**: weighted least squares of step time on
  x = [1, p, d, d*ctx, p*ctx, sum(c_i*x_i), sum(c_i^2)] (the last two over the prefill chunks
  ``(c_i`` tokens after a prefix ``x_i)``; features rescaled, with a tiny ridge). It is fitted from
  every sample through its 7x7 normal equations, in plain Python.
- **Prediction**: a cell with at least ``min_cell_samples`` gives its mean, moved along the
  regression's slope from the cell's centroid to the query:
  t = mean_t + w.(x - mean_x). A cell that has never been seen falls back to the regression,
  w.x. An empty table predicts nothing (``None``).

A step's prefill is given as ``prefix`` (the token-weighted mean prefix of its chunks, so that
``p * prefix = sum(c_i*x_i)``) and ``sq`` (``sum(c_i^2)``; default ``p^2``, one chunk).
:func:`prefill_shape` computes both from a chunk list; :meth:`ProfileTable.max_prefill` fills a
queue of ``(prefix, tokens)`` prefills in order, as the scheduler will.

``dump()`` / ``load()`` round-trip the table through a JSON-able dict, so a table can be
seeded from an offline profile. ``load`` also takes plain records
``{"prefill_tokens", "mean_context", "decode_count", "time_s"}`` (optionally ``"prefix"`` and ``"sq"``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NUM_FEATURES = 7
_P_SCALE, _D_SCALE, _C_SCALE = 512.0, 64.0, 1024.0  # keep the normal equations well conditioned
_Q_SCALE, _S_SCALE = _P_SCALE * _C_SCALE, _P_SCALE * _P_SCALE


def features(prefill_tokens: float, mean_context: float, decode_count: float, prefix: float = 0.0,
             sq: float | None = None) -> list[float]:
    """x = [1, p, d, d*ctx, p*ctx, p*prefix, sq], rescaled (``sq`` = sum of the chunks' squared
    lengths, default p^2: one chunk)."""
    p, d, c = prefill_tokens / _P_SCALE, decode_count / _D_SCALE, mean_context / _C_SCALE
    s = prefill_tokens * prefill_tokens if sq is None else sq
    return [1.0, p, d, d * c, p * c, prefill_tokens * prefix / _Q_SCALE, s / _S_SCALE]


def steps_time(w: Sequence[float], steps: float, prefill_tokens: float, prefix_sum: float, sq: float,
               decode_count: float, mean_context: float) -> float:
    """The regression's time of ``steps`` steps that together compute ``prefill_tokens`` prefill
    tokens (their chunks' ``sum(c_i*x_i)`` = ``prefix_sum`` and ``sum(c_i^2)`` = ``sq``), each beside
    ``decode_count`` decodes of mean context ``mean_context``: the sum of w.x over the steps, in closed
    form (x is linear in each step's own sums)."""
    p, d, c = prefill_tokens / _P_SCALE, decode_count / _D_SCALE, mean_context / _C_SCALE
    return (w[0] * steps + w[1] * p + w[2] * d * steps + w[3] * d * c * steps + w[4] * p * c
            + w[5] * prefix_sum / _Q_SCALE + w[6] * sq / _S_SCALE)


def prefill_shape(chunks: Iterable[tuple[int, int]]) -> tuple[int, float, float]:
    """(p, mean prefix, sq) of prefill chunks given as ``(prefix, tokens)``."""
    p = q = sq = 0
    for x, n in chunks:
        p += n
        q += n * x
        sq += n * n
    return p, (q / p if p else 0.0), float(sq)


def step_shape(chunks: Iterable) -> tuple[int, float, float | None, int, float]:
    """A step's shape from its scheduled chunks, as a step report carries it: prefill tokens, their
    chunks' mean prefix and sum of squares (0.0 and None without prompt tokens), decode count and the
    decodes' mean context."""
    pre, dec = [], []
    for c in chunks:
        if c.is_decode:
            dec.append(c.context_len)
        else:
            pre.append((c.start, c.num_tokens))
    p, prefix, sq = prefill_shape(pre) if pre else (0, 0.0, None)
    return p, prefix, sq, len(dec), (sum(dec) / len(dec) if dec else 0.0)


def fill(prefills: Sequence[tuple[int, int]], m: int) -> tuple[float, float]:
    """(sum c_i*x_i, sum c_i^2) when ``m`` prefill tokens go to the ``(prefix, tokens)`` queue in
    order (Alg. 2 lines 3-8); what the queue cannot take is one more chunk at prefix 0."""
    q = sq = 0.0
    left = m
    for x, n in prefills:
        if left <= 0:
            break
        t = n if n < left else left
        q += t * x
        sq += t * t
        left -= t
    if left > 0:
        sq += left * left
    return q, sq


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
                 min_cell_samples: int = 1, max_cell_weight: float = 64.0, ridge: float = 1e-8,
                 prefix_bucket: int = 512):
        if min(prefill_bucket, context_bucket, decode_bucket, prefix_bucket) <= 0 or max_cell_weight < 1 or ridge < 0:
            raise ValueError("profile table: buckets must be > 0, max_cell_weight >= 1, ridge >= 0")
        self.prefill_bucket, self.context_bucket, self.decode_bucket = prefill_bucket, context_bucket, decode_bucket
        self.prefix_bucket = prefix_bucket
        self.min_cell_samples, self.max_cell_weight, self.ridge = min_cell_samples, max_cell_weight, ridge
        self.cells: dict[tuple[int, int, int, int], Cell] = {}
        self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._xty = [0.0] * NUM_FEATURES
        self._weight = 0.0
        self._w: list[float] | None = None
        self._dirty = False
        self.num_samples = 0

    def __len__(self) -> int:
        return len(self.cells)

    def key(self, prefill_tokens: float, mean_context: float, decode_count: float,
            prefix: float = 0.0) -> tuple[int, int, int, int]:
        """The cell: prefill tokens in steps of their bucket, the other axes in octaves of theirs."""
        return (int(prefill_tokens) // self.prefill_bucket,
                (int(mean_context) // self.context_bucket).bit_length(),
                (int(decode_count) // self.decode_bucket).bit_length(), (int(prefix) // self.prefix_bucket).bit_length())

    # ------------------------------------------------------------------ learning
    def record(self, prefill_tokens: float, mean_context: float, decode_count: float, time_s: float,
               weight: float = 1.0, *, prefix: float = 0.0, sq: float | None = None) -> None:
        """DynaServe Alg. 2 line 1: RECORD(T, plen, ctx, dnum, time), with the prefill's prefix."""
        if time_s < 0 or weight <= 0 or not math.isfinite(time_s):
            return
        x = features(prefill_tokens, mean_context, decode_count, prefix, sq)
        cell = self.cells.setdefault(self.key(prefill_tokens, mean_context, decode_count, prefix), Cell())
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
    def predict(self, prefill_tokens: float, mean_context: float, decode_count: float, prefix: float = 0.0,
                sq: float | None = None) -> float | None:
        w = self.coefficients()
        if w is None:
            return None
        return self._estimate(w, features(prefill_tokens, mean_context, decode_count, prefix, sq),
                              self.key(prefill_tokens, mean_context, decode_count, prefix))

    def predict_queue(self, m: int, mean_context: float, decode_count: float,
                      prefills: Sequence[tuple[int, int]] = ()) -> float | None:
        """:meth:`predict` for ``m`` prefill tokens given to the ``(prefix, tokens)`` queue in order."""
        q, sq = fill(prefills, m)
        return self.predict(m, mean_context, decode_count, q / m if m else 0.0, sq)

    def _estimate(self, w: list[float], x: list[float], key: tuple[int, int, int, int]) -> float:
        """The prediction at features ``x`` in cell ``key``: the cell's mean moved along the slope
        (t = mean_t + w.(x - mean_x)), else the regression w.x; never below 0. Written out for the
        seven features: a scheduler asks this a dozen times a step (:meth:`max_prefill`)."""
        cell = self.cells.get(key)
        if cell is not None and cell.count >= self.min_cell_samples:
            m = cell.mean_x
            t = cell.mean_time + (w[0] * (x[0] - m[0]) + w[1] * (x[1] - m[1]) + w[2] * (x[2] - m[2])
                                  + w[3] * (x[3] - m[3]) + w[4] * (x[4] - m[4]) + w[5] * (x[5] - m[5])
                                  + w[6] * (x[6] - m[6]))
        else:
            t = (w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3] + w[4] * x[4] + w[5] * x[5]
                 + w[6] * x[6])
        return 0.0 if t < 0.0 else t

    def max_prefill(self, target_s: float, mean_context: float, decode_count: float, limit: int,
                    prefills: Sequence[tuple[int, int]] = ()) -> int:
        """DynaServe's MAXPREFILLALLOWED: the largest M in [0, limit] with
        predict_queue(M) <= target, the M tokens filling the ``(prefix, tokens)`` prefill queue in
        order (none: one chunk at prefix 0).

        This is a binary search over M, assuming time grows with M. An empty table allows
        ``limit``. If even M = 0 misses the target, it returns 0 (the caller applies its floor).
        """
        limit = max(int(limit), 0)
        w = self.coefficients()
        if w is None:
            return limit
        # predict(M, mean_context, decode_count, ...) with what does not depend on M computed once
        x0 = features(0, mean_context, decode_count)
        c = mean_context / _C_SCALE
        k0 = self.key(0, mean_context, decode_count)
        pb, xb, estimate = self.prefill_bucket, self.prefix_bucket, self._estimate

        def ok(m: int) -> bool:
            q, sq = fill(prefills, m)
            pm = m / _P_SCALE
            x = [1.0, pm, x0[2], x0[3], pm * c, q / _Q_SCALE, sq / _S_SCALE]
            key = (m // pb, k0[1], k0[2], (int(q / m) // xb).bit_length() if m else 0)
            return estimate(w, x, key) <= target_s

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
            "version": 2,
            "grid": {"prefill_bucket": self.prefill_bucket, "context_bucket": self.context_bucket,
                     "decode_bucket": self.decode_bucket, "prefix_bucket": self.prefix_bucket,
                     "min_cell_samples": self.min_cell_samples, "max_cell_weight": self.max_cell_weight,
                     "ridge": self.ridge},
            "cells": [{"key": list(k), "n": c.n, "count": c.count, "mean_time": c.mean_time,
                       "mean_x": list(c.mean_x)} for k, c in sorted(self.cells.items())],
            "regression": {"xtx": [row[:] for row in self._xtx], "xty": list(self._xty),
                           "weight": self._weight, "num_samples": self.num_samples},
        }

    @classmethod
    def load(cls, data: dict | list) -> ProfileTable:
        """From ``dump()``'s dict, or from a list of records (prefill_tokens, mean_context,
        decode_count, time_s; optionally prefix and sq)."""
        if isinstance(data, list):
            table = cls()
            for rec in data:
                table.record(rec["prefill_tokens"], rec["mean_context"], rec["decode_count"], rec["time_s"],
                             prefix=rec.get("prefix", 0.0), sq=rec.get("sq"))
            return table
        if data.get("version") != 2:
            raise ValueError(f"profile table: unknown version {data.get('version')!r} (this table writes 2: "
                             "version 1 had no prefix features; record its samples again)")
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
