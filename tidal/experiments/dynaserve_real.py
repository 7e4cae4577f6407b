"""DynaServe on this CPU: 2 real instances, colocated vs 1P1D disaggregated vs split (micro-requests).

For each of the paper's workload shapes (``dynaserve-*`` in ``tidal bench serve``, lengths divided
by ``scale`` so a 2-core CPU can serve them), each layout is a ``tidal serve --instances 2`` process
of its own (:mod:`tidal.experiments.server_proc`, one at a time, so the runs never share the cores), and
``tidal bench serve --capacity-search`` finds the highest Poisson rate at which ``target`` of the
requests meet the SLO: a P99 TBT bound per request (DynaServe Sec. 6), plus a TTFT bound so a queue
cannot grow without limit. ``benchmarks/dynaserve_serve.py`` prints and draws it; ``tidal reproduce
dynaserve`` puts it in the table's real column.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.experiments.server_proc import run_client, serve, stop
from tidal.workload.requests import SHAPES

# layout key -> (what it stands for in the paper, the cluster flags); every instance one thread
LAYOUTS = {
    "colocate": ("PD Coloc.", ["--instances", "2", "--threads-per-instance", "1"]),
    "disaggregate": ("PD Disagg. (1P1D)", ["--instances", "2", "--mode", "disaggregate", "--prefill-instances", "1",
                                           "--threads-per-instance", "1"]),
    # DynaServe Sec. 3.1 (Alg. 1 on both orientations of the pair): the paper's placement, the claims' row
    "split": ("DynaServe (split)", ["--instances", "2", "--mode", "split", "--split-placement", "load",
                                    "--threads-per-instance", "1"]),
    # a labelled row, not the paper's: instance 0 is every request's alpha (what the real column once ran)
    "split-fixed": ("DynaServe (split, fixed roles)", ["--instances", "2", "--mode", "split", "--split-placement",
                                                       "fixed", "--threads-per-instance", "1"]),
}
CLAIM_LAYOUTS = ("colocate", "disaggregate", "split")  # what the claims compare; the rest are labelled rows


def row_seed(row: dict[str, Any]) -> int:
    """A row's seed (a run recorded before the real runs had seeds ran seed 0)."""
    return int(row.get("seed", 0))


@dataclass
class RealSetup:
    scale: float = 4.0  # the shapes' lengths divided by this
    slo: str = "tbt=300,ttft=8000"
    target: float = 0.9  # SLO attainment a sustained rate needs
    duration: float = 30.0  # seconds of Poisson arrivals per probe: long enough for queues to form
    drain_timeout: float = 60.0  # a request still running this long after the last arrival fails
    search_low: float = 0.25
    search_high: float = 6.0
    max_probes: int = 6
    batching: str = "slo-compose"  # every instance's local policy (DynaServe Alg. 2)
    kv_cache_memory: str = "256MiB"
    max_num_batched_tokens: int = 256
    seeds: tuple[int, ...] = (0, 1, 2)  # each its own requests and arrivals, the same for every layout

    def engine_flags(self) -> list[str]:
        flags = ["--dtype", "auto", "--kv-cache-memory", self.kv_cache_memory, "--max-num-batched-tokens",
                 str(self.max_num_batched_tokens), "--batching", self.batching]
        tbt = dict(kv.split("=") for kv in self.slo.split(",")).get("tbt")
        if tbt:  # slo-compose (Alg. 2) composes each step to the same TBT bound the SLO counts
            flags += ["--tbt-slo-ms", tbt]
        return flags

    def lengths(self, workload: str) -> tuple[int, int]:
        shape = SHAPES[workload]
        return max(1, round(shape.in_mean / self.scale)), max(1, round(shape.out_mean / self.scale))


def run_layout(workload: str, layout: str, setup: RealSetup, seed: int, out_json: str,
               log: Callable[[str], None] = print) -> dict:
    """One layout's capacity search on one workload and seed: its server, the load; the row of the table."""
    name, flags = LAYOUTS[layout]
    max_in, max_out = setup.lengths(workload)
    steps = os.path.splitext(out_json)[0] + ".steps.jsonl"  # every worker step report: the row's profile
    proc, url, server_log = serve([*flags, "--step-log", steps], setup.engine_flags())
    try:
        cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", workload,
               "--max-input-len", str(max_in), "--max-output-len", str(max_out),
               "--duration", str(setup.duration), "--drain-timeout", str(setup.drain_timeout),
               "--capacity-search", "--slo", setup.slo,
               "--target-attainment", str(setup.target), "--search-low", str(setup.search_low),
               "--search-high", str(setup.search_high), "--max-probes", str(setup.max_probes),
               "--seed", str(seed), "--no-progress", "--no-plots", "--output", out_json,
               # no warm-up request: its 4-token output would be the first length the split front's online
               # predictor learns (it then predicted 24 tokens for 367 until real requests finished, and
               # split each early request at its prompt's end, as 1P1D); every layout alike
               "--warmup-requests", "0"]
        log(f"{workload} ({max_in}/{max_out} tokens), {name}, seed {seed}: tidal {' '.join(cmd[3:])}")
        run_client(cmd)  # its probe lines (stderr) show progress
        with open(out_json) as f:
            r = json.load(f)
    finally:
        stop(proc)
        os.unlink(server_log)
    splits = [q["placement"] for q in r["requests"] if q.get("placement")]
    search = r["capacity_search"]
    profile = step_profile(steps) if os.path.exists(steps) else None
    if os.path.exists(steps):
        os.unlink(steps)
    if profile is not None and splits:
        predicted = [s["predicted_output"] for s in splits if s.get("predicted_output") is not None]
        profile["predicted_output_mean"] = float(np.mean(predicted)) if predicted else None
        profile["output_len"] = max_out
    return {"workload": workload, "lengths": [max_in, max_out], "layout": layout, "system": name, "seed": seed,
            "capacity_rps": search["capacity_rps"], "search_note": search.get("note"),
            "goodput_tok_s": r["goodput"]["output_throughput"], "attainment": r["slo_attainment"],
            "tbt_p99_ms": r["itl_ms"]["p99"], "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
            "split_fraction": (sum(s["whole_on"] is None for s in splits) / len(splits)) if splits else None,
            "kv_mb_per_request": (sum(s["kv_bytes"] for s in splits) / len(splits) / 1e6) if splits else None,
            "probes": [(q["rate"], q["attainment"]) for q in search["probes"]],
            # why a probe failed: requests left unfinished after the drain, or SLO misses among the finished
            "probe_failures": [{"rate": q["rate"], "unfinished": q["summary"]["failed"],
                                "finished": q["summary"]["completed"],
                                "by_metric": q["summary"].get("slo_attainment_by_metric")}
                               for q in search["probes"] if "summary" in q],
            "profile": profile}


def step_profile(path: str) -> dict[str, Any]:
    """Where a layout's time went, from its step log (``tidal serve --step-log``): per instance the
    steps, the time-mean running sequences, the seconds per sequence of its decode-only steps, and
    the spread (p10 / p50 / p90) of its mixed steps (a prefill chunk beside decodes), in seconds."""
    by: dict[int, list[dict[str, Any]]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                by.setdefault(int(d["instance"]), []).append(d)
    out: dict[str, Any] = {"instances": {}}
    for i, steps in sorted(by.items()):
        decode = [s for s in steps if s["decodes"] and not s["prefill_tokens"]]
        mixed = [s["step_s"] for s in steps if s["decodes"] and s["prefill_tokens"]]
        busy = sum(s["step_s"] for s in steps)
        out["instances"][str(i)] = {
            "steps": len(steps), "busy_s": busy,
            "mean_running": float(np.average([s["running"] for s in steps], weights=[s["step_s"] or 1e-9 for s in steps])),
            "decode_s_per_seq": (sum(s["step_s"] for s in decode) / sum(s["decodes"] for s in decode)) if decode else None,
            "mixed_steps": len(mixed),
            "mixed_s": [float(np.percentile(mixed, q)) for q in (10, 50, 90)] if mixed else None}
    return out


def run(workloads: list[str], layouts: list[str], setup: RealSetup, stem: str,
        log: Callable[[str], None] = print, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every layout on every workload for each seed, one server after another (a seed's layouts
    before the next seed's); per-run JSON at ``STEM_WL_LAYOUT_sSEED.json``; ``on_row`` gets the rows so
    far after each run, so a cut-off run keeps what it measured."""
    for wl in workloads:
        if wl not in SHAPES:
            raise ValueError(f"unknown workload shape {wl!r} (known: {', '.join(SHAPES)})")
    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)  # the step logs go beside the runs' JSON
    rows: list[dict] = []
    total, k = len(setup.seeds) * len(workloads) * len(layouts), 0
    for seed in setup.seeds:
        for wl in workloads:
            for layout in layouts:
                k += 1
                log(f"[{k}/{total}]")
                row = run_layout(wl, layout, setup, seed, f"{stem}_{wl}_{layout}_s{seed}.json", log)
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                cap = row["capacity_rps"]
                log(f"  {row['system']}, seed {seed}: capacity {'none' if cap is None else f'{cap:.3f}'} req/s "
                    f"({row['search_note']}), goodput {row['goodput_tok_s']:.1f} tok/s, TBT p99 "
                    f"{row['tbt_p99_ms']:.0f} ms, probes {[(round(a, 3), round(b, 2)) for a, b in row['probes']]}")
    return rows
