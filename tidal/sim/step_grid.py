"""The simulator's step grid: an offline profile of a cost model on a grid, interpolated.

DynaServe's predictor and its local composer take their step times from "offline profiling ...
table lookups" (Sec. 4.1, Alg. 2). In the simulator that profile is the simulator's own cost
model timed on a grid of steps: each point is one step of a ``p``-token prefill chunk (it samples)
after a cached prefix of ``x`` tokens, beside ``d`` decodes whose context after the step is
``ctx``. The prefix matters: a chunk deep into a long prompt attends over ``p*x + p^2/2`` pairs
(KunServe Eq. 1), so 490 tokens after a prefix of 6,000 cost a fifth more than at the prompt's
start on an A100 (Qwen-2.5-14B).

A query is interpolated linearly along each of the four axes and clamped to the grid; the
analytic model is piecewise linear in each, so on its grid points the grid is exact and between
them close. :meth:`ProfileGrid.records` hands every point to a
:class:`~tidal.policies.profile_table.ProfileTable` as its offline profile.

Pure: no torch, no clock.
"""

from __future__ import annotations

import bisect

from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim.cost_model import CostModel

GRID_PREFILL = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384)
GRID_PREFIX = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
GRID_CONTEXT = (1, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
GRID_DECODES = (0, 1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


class ProfileGrid:
    """A cost model timed on the (prefill, prefix, context, decodes) grid, interpolated
    (module docstring). ``grid(p, ctx, d, prefix)`` is the step's time in seconds."""

    def __init__(self, cost_model: CostModel, max_tokens: int = 16384, max_seqs: int = 1024,
                 max_context: int = 131072):
        self.ps = [p for p in GRID_PREFILL if p <= max(max_tokens, 16)]
        self.xs = [x for x in GRID_PREFIX if x <= max(max_context, 512)]
        self.cs = [c for c in GRID_CONTEXT if c <= max(max_context, 128)]
        self.ds = [d for d in GRID_DECODES if d <= max(max_seqs, 1)]
        sp = SamplingParams(max_tokens=1)
        empty = BatchComposition()
        decodes = {c: [ScheduledChunk(f"d{i}", (0,), c - 1, (), True, sp) for i in range(self.ds[-1])]
                   for c in self.cs}
        self.t: list[list[list[list[float]]]] = []  # [p][x][c][d]
        for p in self.ps:
            cube = []
            for x in (self.xs if p else self.xs[:1]):  # no prefill: no prefix axis
                pre = [ScheduledChunk("p", (0,) * p, x, (), True, sp)] if p else []
                plane = []
                for c in self.cs:
                    row = []
                    for d in self.ds:
                        chunks = tuple(pre + decodes[c][:d])
                        if not chunks:  # no work: the time of the smallest step (never asked for alone)
                            chunks = (decodes[c][0],)
                        row.append(cost_model.step_time(StepPlan(0, chunks, empty)))
                    plane.append(row)
                cube.append(plane)
            if not p:
                cube = cube * len(self.xs)
            self.t.append(cube)

    def records(self) -> list[tuple[int, int, int, int, float]]:
        """Every grid point as (prefill tokens, mean context, decode count, prefix, seconds): an
        offline profile to seed a :class:`~tidal.policies.profile_table.ProfileTable` with."""
        return [(p, c, d, x if p else 0, self.t[i][h][j][k])
                for i, p in enumerate(self.ps) for h, x in enumerate(self.xs if p else self.xs[:1])
                for j, c in enumerate(self.cs) for k, d in enumerate(self.ds) if p or d]

    @staticmethod
    def _at(axis: list[int], x: float) -> tuple[int, float]:
        """(index i, weight w): x = (1 - w) axis[i] + w axis[i + 1], clamped to the axis."""
        if len(axis) == 1 or x <= axis[0]:
            return 0, 0.0
        if x >= axis[-1]:
            return len(axis) - 2, 1.0
        i = bisect.bisect_right(axis, x) - 1
        return i, (x - axis[i]) / (axis[i + 1] - axis[i])

    def __call__(self, prefill_tokens: float, mean_context: float, decode_count: float, prefix: float = 0.0) -> float:
        (i, wi), (h, wh), (j, wj), (k, wk) = (self._at(self.ps, prefill_tokens), self._at(self.xs, prefix),
                                              self._at(self.cs, mean_context), self._at(self.ds, decode_count))
        t = self.t
        out = 0.0
        for di, fi in ((0, 1.0 - wi), (1, wi)):
            if fi:
                cube = t[i + di]
                for dh, fh in ((0, 1.0 - wh), (1, wh)):
                    if fh:
                        plane = cube[h + dh]
                        for dj, fj in ((0, 1.0 - wj), (1, wj)):
                            if fj:
                                row = plane[j + dj]
                                out += fi * fh * fj * (row[k] if not wk else (1.0 - wk) * row[k] + wk * row[k + 1])
        return out


__all__ = ["GRID_CONTEXT", "GRID_DECODES", "GRID_PREFILL", "GRID_PREFIX", "ProfileGrid"]
