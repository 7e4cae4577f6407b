"""Every schedule of the fixed responses over the regime trace's phases, pinned: the hindsight bound
over all choices made per phase (``tidal bench sim-auto --all-schedules``).

The ``hindsight`` bound of :mod:`tidal.experiments.sim_auto` pins each phase to that phase's best fixed
response; a phase's response carries over into the next phase, so another schedule may do better
over the whole trace. This runs them all (4 responses over 3 phases: 64 schedules) on the trace of
``auto_sim.json`` (its rates, phases and seeds, so nothing is searched again) and asks, per level and
seed, whether the best of them beats every fixed response by the whole-trace bar. It is a bound
(chosen after seeing every run), not a policy: if no schedule reaches the bar, no choice made once
per phase among the four responses can.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from tidal.experiments import auto_runs as AR

FILE = "auto_schedules.json"


def all_schedules(phases: list[str]) -> list[tuple[str, ...]]:
    """Every response for every phase, in :data:`auto_runs.FIXED`'s order."""
    return list(itertools.product(AR.FIXED, repeat=len(phases)))


def schedule_run(rates: dict[str, float], duration_s: float, seed: int, max_len: int, traces_dir: str | None,
                 schedule: tuple[str, ...]) -> dict[str, Any]:
    """One pinned schedule on one seed's trace: its whole-trace and per-phase P99 TTFT, requests lost,
    and the responses its onsets took (a pinned response that cannot run falls back)."""
    from tidal.experiments.sim_auto import trace_run

    r = trace_run("hindsight", rates, duration_s, seed, max_len, traces_dir, schedule)
    return {"schedule": list(schedule), "ttft_p99_ms": r["whole"]["ttft_p99_ms"], "lost": r["whole"]["lost"],
            "phases": {ph: v["ttft_p99_ms"] for ph, v in r["phases"].items()},
            "choice_counts": r.get("choice_counts") or {}}


def _p99(v: float | None) -> float:
    return float("inf") if v is None else v


def judge(level: dict[str, Any], runs: list[list[dict[str, Any]]], seeds: list[int], bar: float) -> list[dict[str, Any]]:
    """Per seed: the schedule with the least whole-trace P99 TTFT, the best fixed response's (from the
    level's fixed runs, seed by seed), their ratio, and how many schedules reach ``bar``."""
    out = []
    for k, (seed, got) in enumerate(zip(seeds, runs, strict=True)):
        fixed = {s: level["runs"][s][k]["whole"]["ttft_p99_ms"] for s in AR.FIXED}
        best_fixed = min(AR.FIXED, key=lambda s: _p99(fixed[s]))
        best = min(got, key=lambda r: _p99(r["ttft_p99_ms"]))
        ratio = (fixed[best_fixed] / best["ttft_p99_ms"]) if fixed[best_fixed] and best["ttft_p99_ms"] else None
        reach = sum(1 for r in got if r["ttft_p99_ms"] and fixed[best_fixed] / r["ttft_p99_ms"] >= bar)
        out.append({"seed": seed, "best": best["schedule"], "best_p99_ms": best["ttft_p99_ms"], "best_lost": best["lost"],
                    "best_fixed": best_fixed, "best_fixed_p99_ms": fixed[best_fixed], "ratio": ratio,
                    "schedules_reaching_bar": reach, "schedules": len(got)})
    return out


def run_schedules(res: dict[str, Any], levels: list[str], n_seeds: int, jobs: int, traces_dir: str | None,
                  log: Callable[[str], None], previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every schedule on the first ``n_seeds`` seeds of each of ``levels`` of ``auto_sim.json``'s trace.
    ``previous``: an ``auto_schedules.json`` of this trace (:func:`matches`); a level's seeds it holds
    are read from it, not run again (the runs are deterministic), so a longer run resumes a shorter one."""
    from tidal.experiments.parallel import run_all
    from tidal.experiments.sim_auto import TRACE_BAR
    from tidal.sim.models import get_model

    tr, st = res["trace"], res["setup"]
    unknown = [lv for lv in levels if lv not in tr["levels"]]
    if unknown:
        raise ValueError(f"no level {unknown[0]!r} in the run (it has {', '.join(tr['levels'])})")
    max_len = get_model(AR.MODEL).max_position_embeddings
    seeds = list(st["seeds"])[:n_seeds]
    scheds = all_schedules(tr["phases"])
    kept: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for level, lv in ((previous or {}).get("levels") or {}).items():
        for seed, runs in zip(lv["seeds"], lv["runs"], strict=True):
            if len(runs) == len(scheds):
                kept[(level, seed)] = runs
    todo = [(level, seed) for level in levels for seed in seeds if (level, seed) not in kept]
    out: dict[str, Any] = {"bar": TRACE_BAR, "phases": tr["phases"], "levels": {},
                           "read_back": [[lv, sd] for lv in levels for sd in seeds if (lv, sd) in kept]}
    calls = [(tr["levels"][level]["rates"], st["phase_duration_s"], seed, max_len, traces_dir, s)
             for level, seed in todo for s in scheds]
    done = [0]

    def progress(i: int, r: dict[str, Any]) -> None:
        done[0] += 1
        if done[0] % 16 == 0 or done[0] == len(calls):
            log(f"{done[0]}/{len(calls)} schedule runs")
    log(f"{len(scheds)} schedules x {len(seeds)} seeds x {len(levels)} levels: {len(calls)} runs"
        + (f" ({len(out['read_back'])} level-seed pairs read from the previous run)" if out["read_back"] else ""))
    got = run_all(schedule_run, calls, jobs, on_done=progress) if calls else []
    for k, key in enumerate(todo):
        kept[key] = got[k * len(scheds):(k + 1) * len(scheds)]
    for level in levels:
        lv = tr["levels"][level]
        per = [kept[(level, seed)] for seed in seeds]
        judged = judge(lv, per, seeds, TRACE_BAR)
        bound = (lv.get("bounds") or {}).get("hindsight")
        if bound:  # the same schedule as the recorded bound's run gives the same figure: the runs are deterministic
            for k, j in enumerate(judged):
                same = next(r for r in per[k] if r["schedule"] == list(bound["schedules"][k]))
                j["hindsight_p99_ms"] = {"recorded": bound["runs"][k]["whole"]["ttft_p99_ms"],
                                         "here": same["ttft_p99_ms"]}
        out["levels"][level] = {"seeds": seeds, "runs": per, "judged": judged}
    return out


def matches(res: dict[str, Any], sched: dict[str, Any]) -> bool:
    """Whether ``sched`` (``auto_schedules.json``) was run on ``res``'s trace: the same phases, and per
    level and seed the same best fixed response's P99 TTFT and the same recorded bound's (a later
    ``sim-auto`` run's trace gives other figures, and the old schedules would no longer belong to it)."""
    tr = res.get("trace") or {}
    if sched.get("phases") != tr.get("phases"):
        return False
    for level, lv in sched.get("levels", {}).items():
        mine = tr.get("levels", {}).get(level)
        if mine is None:
            return False
        for k, j in enumerate(lv["judged"]):
            fixed = [mine["runs"][s][k]["whole"]["ttft_p99_ms"] for s in AR.FIXED]
            if j["best_fixed_p99_ms"] != min(fixed, key=_p99):
                return False
            bound = (mine.get("bounds") or {}).get("hindsight")
            if "hindsight_p99_ms" in j and (bound is None or
                                            j["hindsight_p99_ms"]["recorded"] != bound["runs"][k]["whole"]["ttft_p99_ms"]):
                return False
    return True


def read(res: dict[str, Any], directory: str) -> tuple[dict[str, Any] | None, bool]:
    """``directory``'s ``auto_schedules.json`` when it was run on ``res``'s trace (:func:`matches`), else
    None; and whether a file was there that belongs to another trace."""
    import json
    import os

    path = os.path.join(directory, FILE)
    if not os.path.isfile(path):
        return None, False
    with open(path, encoding="utf-8") as f:
        got = json.load(f)
    return (got, False) if matches(res, got) else (None, True)


__all__ = ["FILE", "all_schedules", "judge", "matches", "read", "run_schedules", "schedule_run"]
