"""How ``--kv-pressure auto``'s predictions compare with what happened (simulator only, pure).

``auto`` takes the response predicted to serve a throttled instance's queue soonest
(:mod:`tidal.cluster.pressure.predict`). Whether that prediction ranks the responses as they turn
out is a question of fact, asked here run by run: at every throttle onset (the onset ``auto``
itself would choose at) the audit notes every response's prediction and the requests waiting on
that instance for their first token; at the end of the run it reads when the last of them had its first token. The
realized time is what the response the run actually used (its fixed mode, or ``auto``'s choice)
gave, beside the seconds that response was predicted to take.

- in ``auto`` runs the notes are ``auto``'s own choices (:class:`tidal.sim.auto.AutoHandler`);
- in ``preempt`` (recompute or swap) and ``migrate`` runs a passive :class:`AutoPressure` over the
  same monitor predicts at each onset and acts on nothing (:class:`ShadowAudit`);
- ``drop`` runs are not audited: a passive predictor would plan drops against groups it never
  formed; where ``auto`` drops, its own notes are the drop rows.

The audit neither changes a decision nor reads a wall clock; the predictions are the ones the
decision code makes, so a biased response shows as a realized / predicted ratio far from its peers'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.cluster.pressure import AutoChoice, AutoPressure
    from tidal.sim.simulator import ClusterSimulator


class PredictionAudit:
    """Notes of (onset, instance, the response used, every prediction, the queue's request ids)."""

    def __init__(self) -> None:
        self.notes: list[tuple[float, int, str, dict[str, float], dict[str, float], list[str]]] = []

    def note(self, choice: AutoChoice, response: str, waiting: Iterable[str]) -> None:
        preds = {k: p.seconds for k, p in choice.predictions.items()}
        used = choice.predictions.get(response)
        terms = {} if used is None else {k: round(v, 4) for k, v in used.terms.items()}
        self.notes.append((choice.time, choice.index, response, preds, terms, list(waiting)))

    def rows(self, sim: ClusterSimulator) -> list[dict[str, Any]]:
        """Each note with its realized seconds: until the last request waiting at the onset had its
        first token (None when one never did: lost, or the run ended first)."""
        out = []
        for t, index, response, preds, terms, rids in self.notes:
            firsts = []
            for rid in rids:
                rec = sim.records[sim._index[rid]]
                firsts.append(None if rec.ttft_s is None else rec.arrival_s + rec.ttft_s)
            realized = None if not firsts or None in firsts else max(firsts) - t
            out.append({"time": round(t, 4), "index": index, "response": response, "waiting": len(rids),
                        "predicted_s": {k: (None if math.isinf(v) else round(v, 4)) for k, v in preds.items()},
                        "terms": terms,  # of the response used's prediction
                        "realized_s": None if realized is None else round(realized, 4)})
        return out


def waiting_ids(sim: ClusterSimulator, index: int) -> list[str]:
    """The requests waiting on instance ``index`` for their first token (a preempted one had it)."""
    return [r.request_id for r in sim.instances[index].scheduler.waiting if not r.output_token_ids]


class ShadowAudit(PredictionAudit):
    """A passive ``auto`` over a fixed-mode run: it predicts at each onset and changes nothing."""

    def __init__(self, auto: AutoPressure, sim: ClusterSimulator, response: str | None = None):
        super().__init__()
        self.auto, self.sim, self.response = auto, sim, response

    def step(self, now: float) -> None:
        from tidal.sim.auto import _Running

        sim = self.sim
        for c in self.auto.onsets(now, _Running(sim.instances), True, _Running(sim.instances, queue=True)):
            used = self.response or sim.instances[c.index].scheduler.preemption_mode
            self.note(c, used, waiting_ids(sim, c.index))


def summarize_audit(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per response used: onsets, those with a realized time, and the median realized / predicted."""
    by: dict[str, list[float]] = {}
    count: dict[str, int] = {}
    for r in rows:
        k = r["response"]
        count[k] = count.get(k, 0) + 1
        p = r["predicted_s"].get(k)
        if r["realized_s"] is not None and p:
            by.setdefault(k, []).append(r["realized_s"] / p)
    out = {}
    for k, n in count.items():
        xs = by.get(k, [])
        out[k] = {"onsets": n, "realized": len(xs), "median_realized_over_predicted": statistics.median(xs) if xs else None}
    return out


__all__ = ["PredictionAudit", "ShadowAudit", "summarize_audit", "waiting_ids"]
