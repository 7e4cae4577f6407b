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

**It learns how far each prediction runs from what happens** (``learn``; a revision, after an
audit of the simulator's runs, :mod:`tidal.sim.auto_audit`, found drop's predictions shorter than
what happened, where preemption's came close): when every request that waited at an episode's
onset has had its first token, the seconds that took over the seconds predicted for the response
taken is that response's latest ratio; each prediction is scaled by the median of its response's
last ``learn`` ratios (a queue served at its onset's own instant teaches nothing, so no scale is
ever 0) before the least is taken. A response with no ratio of its own yet is scaled by the median of
every response's latest ratios, the error the prediction has shown so far (1 before any episode is
served; a revision: before it, a response never taken kept scale 1, and where its prediction was
another's to the second -- a queue with no victims waits the same under recompute and swap -- it
looked that response's learned scale faster and was taken, at 1.25x on commit 1058d6a's page:
recompute at 1 beside swap's 1.3, 53 onsets of auto-nodrop's seed 2). The scales a choice used are
in its record, so a replay decides the same. A prediction that
amounts to another response's (:attr:`~tidal.cluster.pressure.predict.Prediction.same_as`: a
migration that moves nothing leaves the queue to the scheduler's recompute) is scaled, and its
episode learned, as that response's (a revision: before it, such a migration kept scale 1 beside
recompute's learned one, so the same recompute looked faster under migrate's name and was taken as
migrate again and again, at 1.25x on commit 09524c2's page).

Every choice is an :class:`AutoChoice`: the episode and the prices it read, the previous choice,
every prediction and the reason. :func:`replay` decides again from those alone, so a recorded
choice can be checked (same inputs, same decision).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tidal.cluster.pressure.predict import TECHNIQUES, Episode, Prediction, Prices, predict

MARGIN = 0.2  # a new episode switches only for a response predicted >= 20 % faster than the last choice
HOLD_S = 2.0  # a throttle back within 2 s of the last one seen continues that episode
LEARN = 8  # a response's scale: the median realized / predicted of its last 8 served episodes (0: no learning)
OPEN = 64  # episodes whose queue is still being served, at most (the oldest is given up)


@dataclass(frozen=True)
class AutoParams:
    margin: float = MARGIN
    hold_s: float = HOLD_S
    techniques: tuple[str, ...] = TECHNIQUES
    learn: int = LEARN
    # a labelled ablation (ours, after the page showed drop's groups outlasting their episodes): once
    # KunServe's own limit signal fires (Sec. 4.4's autoscale: KV use still rising after a drop), undo
    # the groups and take no drop until the cluster's KV demand is back under the restore threshold
    undo_at_limit: bool = False
    # a bound for the page (ours), not a policy: from each (time, response) on, every onset takes that
    # response whatever the predictions (a schedule known only after the run); empty: chosen by prediction
    pinned: tuple[tuple[float, str], ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"auto margin must be in [0, 1), got {self.margin}")
        if self.hold_s < 0:
            raise ValueError(f"auto hold_s must be >= 0, got {self.hold_s}")
        if self.learn < 0:
            raise ValueError(f"auto learn must be >= 0, got {self.learn}")
        bad = [t for t in self.techniques if t not in TECHNIQUES]
        if bad or not self.techniques or len(set(self.techniques)) != len(self.techniques):
            raise ValueError(f"auto techniques must be some of {', '.join(TECHNIQUES)}, each once; "
                             f"got {', '.join(self.techniques) or 'none'}")
        times = [t for t, _ in self.pinned]
        if times != sorted(times) or any(r not in self.techniques for _, r in self.pinned):
            raise ValueError("auto pinned must be (time, response) pairs in time order, each response one of "
                             f"{', '.join(self.techniques)}; got {list(self.pinned)}")

    def pinned_at(self, now: float) -> str | None:
        """The pinned response at ``now`` (the first entry's before its time); None when nothing is pinned."""
        at = [r for t, r in self.pinned if t <= now]
        return at[-1] if at else self.pinned[0][1] if self.pinned else None

    def to_dict(self) -> dict[str, Any]:
        return {"margin": self.margin, "hold_s": self.hold_s, "techniques": list(self.techniques), "learn": self.learn,
                **({"undo_at_limit": True} if self.undo_at_limit else {}),
                **({"pinned": [list(x) for x in self.pinned]} if self.pinned else {})}


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
    scales: dict[str, float] = field(default_factory=dict)  # what each response's prediction was scaled by (learned)

    @property
    def index(self) -> int:
        return self.episode.index

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "index": self.index, "choice": self.choice, "previous": self.previous,
                "reason": self.reason, "predictions": {k: v.to_dict() for k, v in self.predictions.items()},
                "episode": self.episode.to_dict(), "prices": self.prices.to_dict(), "params": self.params.to_dict(),
                "scales": dict(self.scales)}

    def summary(self) -> dict[str, Any]:
        """The short form for event logs and the dashboard: choice, reason, predicted seconds."""
        return {"choice": self.choice, "previous": self.previous, "reason": self.reason,
                "predicted_s": {k: (None if math.isinf(v.seconds) else round(v.seconds, 4))
                                for k, v in self.predictions.items()},
                **({"scales": {k: round(v, 3) for k, v in self.scales.items()}} if self.scales else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AutoChoice:
        """The inputs of a recorded choice (its outputs are decided again by :func:`replay`)."""
        p = d["params"]
        params = AutoParams(p["margin"], p["hold_s"], tuple(p["techniques"]), p.get("learn", 0),
                            p.get("undo_at_limit", False), tuple((t, r) for t, r in p.get("pinned", ())))
        return cls(d["time"], Episode.from_dict(d["episode"]), Prices.from_dict(d["prices"]), d["previous"], params,
                   choice=d["choice"], reason=d["reason"], scales=dict(d.get("scales", {})))


def decide(episode: Episode, prices: Prices, previous: str | None, params: AutoParams,
           now: float = 0.0, scales: dict[str, float] | None = None) -> AutoChoice:
    """The response for ``episode``: the least predicted (each prediction times its response's
    learned scale), unless the instance's ``previous`` choice is within ``margin`` of it; with
    ``params.pinned`` (a bound, not a policy), the schedule's response wherever it can run."""
    preds = predict(episode, prices, params.techniques)
    # a prediction that amounts to another response's (a migration that moves nothing) takes that one's scale
    acting = {p.acts_as for p in preds.values()}
    scales = {k: v for k, v in (scales or {}).items() if k in acting and v != 1.0}
    sec = {k: p.seconds * scales.get(p.acts_as, 1.0) for k, p in preds.items()}

    def said(t: str) -> str:
        s = scales.get(preds[t].acts_as)
        return f"{sec[t]:.3g} s" + (f" ({preds[t].seconds:.3g} x {s:.2g} learned)" if s is not None else "")

    order = params.techniques
    ranked = sorted(order, key=lambda t: (sec[t], order.index(t)))
    best, second = ranked[0], ranked[1] if len(ranked) > 1 else None
    choice = best
    s = sec[best]
    reason = f"{best} predicted {said(best)}, least (next: {second} {said(second)})" if second is not None else \
        f"{best} predicted {said(best)}"
    pin = params.pinned_at(now)
    if pin is not None:  # the hindsight bound: the schedule's response, unless it cannot run now
        if not math.isinf(sec[pin]):
            return AutoChoice(now, episode, prices, previous, params, preds, pin, f"pinned: {pin} ({said(pin)})",
                              scales)
        reason = f"pinned {pin} cannot run now; " + reason
    elif previous in preds and previous != best:
        prev_s = sec[previous]
        if not math.isinf(prev_s) and s > (1.0 - params.margin) * prev_s:
            choice = previous
            reason = (f"kept {previous} ({prev_s:.3g} s): {best}'s {s:.3g} s is not {params.margin:.0%} faster "
                      "(hysteresis)")
    return AutoChoice(now, episode, prices, previous, params, preds, choice, reason, scales)


def replay(choice: AutoChoice) -> AutoChoice:
    """Decide again from a record's inputs alone (the scales it used included)."""
    return decide(choice.episode, choice.prices, choice.previous, choice.params, choice.time, choice.scales)


@dataclass
class _Open:
    """An episode whose queue is being served: the response taken, its (unscaled) prediction, the
    onset and the requests still waiting for their first token."""

    response: str
    predicted_s: float
    start: float
    waiting: set[str]


class AutoChooser:
    """The per-instance state of the choice: each instance's last choice and when it was last seen
    throttled (its episode's hold)."""

    def __init__(self, params: AutoParams | None = None):
        self.params = params or AutoParams()
        self.last: dict[int, str] = {}
        self.seen: dict[int, float] = {}
        self.open: list[_Open] = []  # episodes whose queue is being served (learning)
        self.ratios: dict[str, deque[float]] = {}  # each response's latest realized / predicted

    def scales(self) -> dict[str, float]:
        """Each response's learned scale: the median of its latest ratios; for a response with none
        yet, the median of every response's latest ratios (none before any episode is served)."""
        own = {k: statistics.median(v) for k, v in self.ratios.items() if v}
        pooled = [r for v in self.ratios.values() for r in v]
        if not pooled:
            return own
        prior = statistics.median(pooled)  # the prediction's error so far, where a response has shown none of its own
        return {t: own.get(t, prior) for t in self.params.techniques}

    def first_token(self, rid: str, now: float) -> None:
        """Request ``rid`` had its first token: an episode whose queue it was the last of is served."""
        for o in [o for o in self.open if rid in o.waiting]:
            o.waiting.discard(rid)
            if not o.waiting:
                self.open.remove(o)
                if o.predicted_s > 0 and not math.isinf(o.predicted_s) and now > o.start:
                    self.ratios.setdefault(o.response, deque(maxlen=self.params.learn)).append(
                        (now - o.start) / o.predicted_s)

    def in_episode(self, index: int, now: float) -> bool:
        t = self.seen.get(index)
        return t is not None and now - t <= self.params.hold_s

    def choose(self, now: float, episode: Episode, prices: Prices) -> AutoChoice:
        learn = self.params.learn > 0
        c = decide(episode, prices, self.last.get(episode.index), self.params, now, self.scales() if learn else None)
        self.last[episode.index] = c.choice
        self.seen[episode.index] = now
        waiting = {q.rid for q in episode.queue if q.rid}
        if learn and waiting:
            taken = c.predictions[c.choice]
            self.open.append(_Open(taken.acts_as, taken.seconds, now, waiting))
            del self.open[:-OPEN]
        return c

    def throttled(self, indices: Iterable[int], now: float) -> None:
        """These instances are throttled now: their episodes go on."""
        for i in indices:
            self.seen[i] = now

    def forget(self, indices: Iterable[int]) -> None:
        """These instances changed shape (joined or left a group): their next throttle is an onset."""
        for i in indices:
            self.seen.pop(i, None)


__all__ = ["HOLD_S", "LEARN", "MARGIN", "AutoChoice", "AutoChooser", "AutoParams", "decide", "replay"]
