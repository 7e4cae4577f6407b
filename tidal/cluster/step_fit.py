"""An instance's prefill steps' times, fitted on their shape (pure): what a router prices queued and new
prompt tokens with.

Every step that computed prompt tokens is recorded with its shape (DynaServe Alg. 2 line 1's RECORD:
prefill tokens, their chunks' prefixes, decode count and context) in a
:class:`~tidal.policies.profile_table.ProfileTable`, whose least-squares weights are the fit. A step
time alone (the moving average the monitor keeps) says nothing of what a prefill costs: an instance
that has been decoding steps in ~20 ms, and a 512-token chunk deep into a 32K-token prompt takes
several times that. ``min_samples`` steps come first (the seven weights need them).
"""

from __future__ import annotations

from tidal.policies.profile_table import NUM_FEATURES, ProfileTable

MIN_SAMPLES = 4 * NUM_FEATURES  # prefill steps before the fit is used


class StepFit:
    def __init__(self, min_samples: int = MIN_SAMPLES):
        self.table = ProfileTable()
        self.min_samples = min_samples
        self._fit: tuple[float, ...] | None = None
        self._stale = False

    @classmethod
    def of(cls, w: tuple[float, ...]) -> StepFit:
        """A fit given by its weights (a decision record's, replayed)."""
        fit = cls(min_samples=0)
        fit._fit = tuple(w)
        return fit

    def record(self, prefill_tokens: int, prefix: float, sq: float | None, decode_count: int,
               decode_context: float, time_s: float) -> None:
        self.table.record(prefill_tokens, decode_context, decode_count, time_s, prefix=prefix, sq=sq)
        self._stale = True

    def fit(self) -> tuple[float, ...] | None:
        """The weights on :func:`tidal.policies.profile_table.features`, or None before ``min_samples``."""
        if self.table.num_samples < self.min_samples:
            return None
        if self._stale or self._fit is None:
            w = self.table.coefficients()
            self._fit = tuple(w) if w is not None else None
            self._stale = False
        return self._fit


__all__ = ["MIN_SAMPLES", "StepFit"]
