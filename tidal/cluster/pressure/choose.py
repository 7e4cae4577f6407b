"""``--kv-pressure auto``: the choice at a throttle onset, its hysteresis, its record and its replay (pure).

At each onset the response predicted to serve the queued demand soonest is taken
(:func:`tidal.cluster.pressure.predict.predict`), with two guards against flapping, both set
before any run was measured:

- **an episode is one decision**: while an instance stays throttled, and for ``hold_s`` after it
  was last seen throttled, its episode goes on under the choice made at its onset; a throttle that
  clears for a step and returns is not a new onset;
- **a switch must pay**: a new episode leaves the instance's previous choice only when the best
  response is predicted at least ``margin`` faster than that choice (a response that cannot run
  now, predicted ``inf``, is always left).

Every choice is an :class:`AutoChoice`: the episode and the prices it read, the previous choice,
every prediction and the reason. :func:`replay` decides again from those alone, so a recorded
choice can be checked (same inputs, same decision).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tidal.cluster.pressure.predict import TECHNIQUES, Episode, Prediction, Prices, predict

MARGIN = 0.2  # a new episode switches only for a response predicted >= 20 % faster than the last choice
HOLD_S = 2.0  # a throttle back within 2 s of the last one seen continues that episode


@dataclass(frozen=True)
class AutoParams:
    margin: float = MARGIN
    hold_s: float = HOLD_S
    techniques: tuple[str, ...] = TECHNIQUES

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"auto margin must be in [0, 1), got {self.margin}")
        if self.hold_s < 0:
            raise ValueError(f"auto hold_s must be >= 0, got {self.hold_s}")
        bad = [t for t in self.techniques if t not in TECHNIQUES]
        if bad or not self.techniques or len(set(self.techniques)) != len(self.techniques):
            raise ValueError(f"auto techniques must be some of {', '.join(TECHNIQUES)}, each once; "
                             f"got {', '.join(self.techniques) or 'none'}")

    def to_dict(self) -> dict[str, Any]:
        return {"margin": self.margin, "hold_s": self.hold_s, "techniques": list(self.techniques)}


@dataclass(frozen=True)
class AutoChoice:
    """One decision: what it read (episode, prices, the instance's previous choice, the knobs) and
    what it made of it (every prediction, the choice and why)."""

    time: float
    episode: Episode
    prices: Prices
    previous: str | None
    params: AutoParams
    predictions: dict[str, Prediction] = field(default_factory=dict)
    choice: str = "recompute"
    reason: str = ""

    @property
    def index(self) -> int:
        return self.episode.index

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "index": self.index, "choice": self.choice, "previous": self.previous,
                "reason": self.reason, "predictions": {k: v.to_dict() for k, v in self.predictions.items()},
                "episode": self.episode.to_dict(), "prices": self.prices.to_dict(), "params": self.params.to_dict()}

    def summary(self) -> dict[str, Any]:
        """The short form for event logs and the dashboard: choice, reason, predicted seconds."""
        return {"choice": self.choice, "previous": self.previous, "reason": self.reason,
                "predicted_s": {k: (None if math.isinf(v.seconds) else round(v.seconds, 4))
                                for k, v in self.predictions.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AutoChoice:
        """The inputs of a recorded choice (its outputs are decided again by :func:`replay`)."""
        p = d["params"]
        params = AutoParams(p["margin"], p["hold_s"], tuple(p["techniques"]))
        return cls(d["time"], Episode.from_dict(d["episode"]), Prices.from_dict(d["prices"]), d["previous"], params,
                   choice=d["choice"], reason=d["reason"])


def decide(episode: Episode, prices: Prices, previous: str | None, params: AutoParams,
           now: float = 0.0) -> AutoChoice:
    """The response for ``episode``: the least predicted, unless the instance's ``previous`` choice
    is within ``margin`` of it."""
    preds = predict(episode, prices, params.techniques)
    order = params.techniques
    ranked = sorted(order, key=lambda t: (preds[t].seconds, order.index(t)))
    best, second = ranked[0], ranked[1] if len(ranked) > 1 else None
    choice = best
    s = preds[best].seconds
    if second is not None:
        reason = f"{best} predicted {s:.3g} s, least (next: {second} {preds[second].seconds:.3g} s)"
    else:
        reason = f"{best} predicted {s:.3g} s"
    if previous in preds and previous != best:
        prev_s = preds[previous].seconds
        if not math.isinf(prev_s) and s > (1.0 - params.margin) * prev_s:
            choice = previous
            reason = (f"kept {previous} ({prev_s:.3g} s): {best}'s {s:.3g} s is not {params.margin:.0%} faster "
                      "(hysteresis)")
    return AutoChoice(now, episode, prices, previous, params, preds, choice, reason)


def replay(choice: AutoChoice) -> AutoChoice:
    """Decide again from a record's inputs alone."""
    return decide(choice.episode, choice.prices, choice.previous, choice.params, choice.time)


class AutoChooser:
    """The per-instance state of the choice: each instance's last choice and when it was last seen
    throttled (its episode's hold)."""

    def __init__(self, params: AutoParams | None = None):
        self.params = params or AutoParams()
        self.last: dict[int, str] = {}
        self.seen: dict[int, float] = {}

    def in_episode(self, index: int, now: float) -> bool:
        t = self.seen.get(index)
        return t is not None and now - t <= self.params.hold_s

    def choose(self, now: float, episode: Episode, prices: Prices) -> AutoChoice:
        c = decide(episode, prices, self.last.get(episode.index), self.params, now)
        self.last[episode.index] = c.choice
        self.seen[episode.index] = now
        return c

    def throttled(self, indices: Iterable[int], now: float) -> None:
        """These instances are throttled now: their episodes go on."""
        for i in indices:
            self.seen[i] = now

    def forget(self, indices: Iterable[int]) -> None:
        """These instances changed shape (joined or left a group): their next throttle is an onset."""
        for i in indices:
            self.seen.pop(i, None)


__all__ = ["HOLD_S", "MARGIN", "AutoChoice", "AutoChooser", "AutoParams", "decide", "replay"]
