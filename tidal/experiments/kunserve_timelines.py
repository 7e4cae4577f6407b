"""``tidal bench sim-kunserve``'s per-instance record: who throttled, who took part in a drop, and
the per-instance KV, queue and drop timelines (their own JSON and a plot per system).

Done-when of issue 40 asks for "every throttled instance taking part in a drop (counted)": a
throttle *onset* of instance ``i`` (the detector's Sec. 4.1 event, logged once per episode) is
*answered* when a drop including ``i`` follows it within ``ANSWER_S`` (the controller plans at the
onset, or right after a plan under way ends: an exchange takes 1-2 s, Sec. 4.2) and before ``i``'s
next onset.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

ANSWER_S = 10.0  # a drop this soon after an onset answers it
TIMELINE_POINTS = 400  # samples kept per instance in the timelines JSON
KEYS = ("kv_usage", "kv_demand", "waiting", "running", "batch_size")


def participation(events: list[dict[str, Any]], num_instances: int) -> dict[str, Any]:
    """Throttle onsets and drops per instance from a run's pressure events (``kind``, ``time``,
    ``instances``): how many onsets each instance had, how many drops it took part in, how many of
    its onsets a drop answered (within ``ANSWER_S``, before its next onset); the instances
    throttled but never in a drop; each drop's members."""
    onsets: dict[int, list[float]] = {i: [] for i in range(num_instances)}
    drops: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: e["time"]):
        if e["kind"] == "throttle":
            for i in e["instances"]:
                onsets[i].append(e["time"])
        elif e["kind"] == "drop":
            drops.append({"time": e["time"], "instances": sorted(e["instances"])})
    per: dict[str, Any] = {}
    for i in range(num_instances):
        mine = [d["time"] for d in drops if i in d["instances"]]
        ts = onsets[i]
        answered = sum(1 for k, t in enumerate(ts)
                       if any(t <= d < min(t + ANSWER_S, ts[k + 1] if k + 1 < len(ts) else float("inf"))
                              for d in mine))
        per[str(i)] = {"throttle_onsets": len(ts), "drops": len(mine), "onsets_answered": answered}
    throttled = sorted(i for i in range(num_instances) if onsets[i])
    dropped = sorted({i for d in drops for i in d["instances"]})
    return {"per_instance": per, "throttled": throttled, "in_a_drop": dropped,
            "throttled_never_in_a_drop": sorted(set(throttled) - set(dropped)),
            "throttle_onsets": sum(len(v) for v in onsets.values()),
            "onsets_answered": sum(v["onsets_answered"] for v in per.values()), "drops": drops}


def downsample(timeline: dict[str, Any], points: int = TIMELINE_POINTS) -> dict[str, Any]:
    """At most ``points`` samples of one instance's timeline, evenly spaced in index (the last kept)."""
    n = len(timeline.get("t", []))
    keep = np.unique(np.linspace(0, n - 1, min(n, points)).round().astype(int)) if n else np.zeros(0, dtype=int)
    out = {k: [timeline[k][j] for j in keep] for k in ("t", *KEYS) if k in timeline}
    out["t"] = [round(float(x), 4) for x in out.get("t", [])]
    for k in ("kv_usage", "kv_demand"):
        if k in out:
            out[k] = [round(float(x), 4) for x in out[k]]
    return out


def write_timelines(report: dict[str, Any], path: str) -> str:
    """Every dataset's and system's per-instance timelines (downsampled) with its pressure events
    and the participation counts, as JSON at ``path``."""
    doc: dict[str, Any] = {"command": report.get("command"), "datasets": {}}
    for ds, d in report["datasets"].items():
        doc["datasets"][ds] = {label: {"instances": [downsample(tl) for tl in r["timelines"]],
                                       "events": r["events"], "participation": r["participation"]}
                               for label, r in d["systems"].items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def plot_all_instances(report: dict[str, Any], stem: str) -> list[str]:
    """One per-instance timeline plot per dataset and system (KV use, queue, batch; its events)."""
    from tidal.sim.plots import plot_instance_timelines

    out = []
    for ds, d in report["datasets"].items():
        for label, r in d["systems"].items():
            key = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
            p = r["participation"]
            title = (f"{label}, {ds}: {p['throttle_onsets']} throttle onsets on {len(p['throttled'])} instances, "
                     f"{len(p['drops'])} drops, {p['onsets_answered']} onsets answered")
            out.append(plot_instance_timelines(r["timelines"], f"{stem}_{ds}_{key}_instances.png", title,
                                               [e for e in r["events"] if e["kind"] in ("throttle", "drop",
                                                                                         "restore")]))
    return out


__all__ = ["ANSWER_S", "downsample", "participation", "plot_all_instances", "write_timelines"]
