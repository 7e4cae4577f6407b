"""DynaServe's evaluation beyond the capacity grid, in the simulator: why fixed roles load alpha,
the real-time replay (Fig. 10) and the SLO-aware batching ablation (Fig. 11).

- **Where the sequences go** (:func:`alpha_beta`): one DynaServe run at a given rate with fixed
  roles and with the paper's load placement, each with the online length predictor (Sec. 5) and
  with the exact output lengths (an oracle): each instance's time-mean running sequences, and the
  decode tokens Alg. 1 planned for alpha and beta against those each ran. With the oracle the
  length predictor cannot be the cause; with load placement each instance is some requests' alpha.
- **Real-time replay** (:func:`replay`, Fig. 10: "a continuous request stream from the BurstGPT
  dataset, preserving original arrival pattern ... 42 minutes ... average goodput every 6
  minutes"). BurstGPT's timed trace is not in ``../shared/traces``; the Azure 2023 conversation
  trace is (real arrival times and lengths, one hour), so windows of 42 minutes of it are replayed
  at their own times, each 6-minute interval's goodput the output tokens emitted in it by the
  requests that met the TBT SLO (the paper's per-request P99 rule), over 360 s.
- **SLO-aware batching** (:func:`ablation`, Fig. 11: "the CDF of TBT under high-workload
  pressure"): DynaServe with Alg. 2 against the same system with vLLM's chunked prefill (2,048),
  at the rate of DynaServe's own capacity; the share of the gaps between tokens within the SLO
  (the paper: 52 % without, 99 % with) and the CDF.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tidal import workload as W
from tidal.experiments.dynaserve_stats import attains, token_times
from tidal.experiments.sim_dynaserve import COLOC, HEADLINE, SYSTEMS, WORKLOADS, run_probe

INTERVAL_S = 360.0  # Fig. 10: "we measure average goodput every 6 minutes"
WINDOW_S = 42 * 60.0  # Fig. 10: "spans 42 minutes"
REPLAY_TRACE = "azure2023_conv.csv"  # BurstGPT's timed trace is not available here (module docstring)
CDF_MS = np.arange(0.0, 401.0, 5.0)  # Fig. 11's TBT axis, ms
# Fig. 10's systems: PD Coloc. at both ends of the paper's tuning range, PD Disagg., DynaServe (the
# paper's placement; a 42-minute split run is the costly one on two cores)
FIG10_SYSTEMS = ("coloc-256", "coloc-2048", "disagg", HEADLINE)
FIG10_STARTS = (0.0, 480.0, 960.0)  # three 42-minute windows of the hour-long trace (they overlap)


def alpha_beta(model: str, workload: str, rate: float, seed: int, window: float, num_requests: int,
               step_jitter: str = "fitted") -> dict[str, Any]:
    """Fixed roles and load placement, each with the length predictor and with the oracle, on one
    seed's requests at ``rate``: per instance mean running sequences and decode tokens."""
    base = W.make_requests(W.WorkloadOptions(num_requests=num_requests, rate=1.0, seed=seed, **WORKLOADS[workload]))
    specs = W.specs_at_rate(base, rate, window)
    out: dict[str, Any] = {"rate": rate, "seed": seed, "num_requests": len(specs), "runs": {}}
    for name in ("dynaserve", "dynaserve-load"):
        for lengths in ("max-tokens", "oracle"):
            p = run_probe(model, SYSTEMS[name], specs, 0.1, 2.0, None, step_jitter=step_jitter, seed=seed,
                          length_mode=lengths)
            running = [i["mean_running"] for i in p["instances"]]
            out["runs"][f"{name}/{'predictor' if lengths == 'max-tokens' else 'oracle'}"] = {
                "mean_running": running, "imbalance": max(running) / max(min(running), 1e-9),
                "tokens": p["splits"]["tokens"], "phi_p50": p["splits"]["phi_p50"],
                "paper_attainment": p["paper_attainment"], "tbt_p99_ms": p["tbt_p99_ms"]}
    return out


def replay_specs(traces_dir: str | None, start_s: float, window_s: float | None = None) -> list[W.RequestSpec]:
    """The trace's requests that arrive in ``[start_s, start_s + window_s)`` of its own clock, from 0
    (default: :data:`WINDOW_S`)."""
    window_s = WINDOW_S if window_s is None else window_s
    rows = W.load_trace(_trace_path(traces_dir))
    t0 = rows[0].time_s + start_s
    return [W.RequestSpec(r.time_s - t0, r.input_len, max(1, r.output_len)) for r in rows
            if t0 <= r.time_s < t0 + window_s]


def _trace_path(traces_dir: str | None) -> str:
    return os.path.join(traces_dir or W.default_traces_dir(), REPLAY_TRACE)


def interval_goodput(records: list[Any], tbt_s: float, window_s: float | None = None,
                     interval_s: float | None = None) -> list[float]:
    """Per interval of the window (default :data:`WINDOW_S`, :data:`INTERVAL_S`): output tokens emitted
    in it by requests that met the TBT SLO (their own P99 gap, the paper's rule), per second."""
    window_s = WINDOW_S if window_s is None else window_s
    interval_s = INTERVAL_S if interval_s is None else interval_s
    n = int(round(window_s / interval_s))
    tokens = [0] * n
    for rec in records:
        if not attains(rec, tbt_s, stall=False):
            continue
        for t in token_times(rec):
            k = int(t // interval_s)
            if 0 <= k < n:
                tokens[k] += 1
    return [x / interval_s for x in tokens]


def replay(model: str, system: str, start_s: float, seed: int, traces_dir: str | None = None,
           step_jitter: str = "fitted", tbt_s: float = 0.1) -> dict[str, Any]:
    """One system over one window of the trace (Fig. 10): goodput per interval and over the window."""
    specs = replay_specs(traces_dir, start_s)
    p = run_probe(model, SYSTEMS[system], specs, tbt_s, 2.0, None, step_jitter=step_jitter, seed=seed,
                  keep_records=True)
    per = interval_goodput(p.pop("records"), tbt_s)
    return {"system": system, "start_s": start_s, "seed": seed, "num_requests": len(specs),
            "input_mean": float(np.mean([s.prompt_len for s in specs])) if specs else 0.0,
            "output_mean": float(np.mean([s.output_len for s in specs])) if specs else 0.0,
            "goodput_per_interval": per, "goodput": float(np.mean(per)) if per else 0.0,
            "paper_attainment": p["paper_attainment"], "tbt_p99_ms": p["tbt_p99_ms"], "ttft_p50_ms": p["ttft_p50_ms"]}


def interval_inputs(traces_dir: str | None, start_s: float) -> list[float]:
    """The mean prompt length of each interval's arrivals (what the paper reads the dips by)."""
    specs = replay_specs(traces_dir, start_s)
    n = int(round(WINDOW_S / INTERVAL_S))
    out = []
    for k in range(n):
        xs = [s.prompt_len for s in specs if k * INTERVAL_S <= s.arrival_s < (k + 1) * INTERVAL_S]
        out.append(float(np.mean(xs)) if xs else 0.0)
    return out


def ablation(model: str, workload: str, system: str, rate: float, seed: int, window: float, num_requests: int,
             step_jitter: str = "fitted", tbt_s: float = 0.1) -> dict[str, Any]:
    """One system at ``rate`` (Fig. 11): the share of all gaps between tokens within ``tbt_s``, the
    CDF over :data:`CDF_MS`, and the largest gap."""
    base = W.make_requests(W.WorkloadOptions(num_requests=num_requests, rate=1.0, seed=seed, **WORKLOADS[workload]))
    specs = W.specs_at_rate(base, rate, window)
    p = run_probe(model, SYSTEMS[system], specs, tbt_s, 2.0, None, step_jitter=step_jitter, seed=seed,
                  keep_records=True)
    gaps = np.asarray([g for r in p.pop("records") for g in r.itl_s], dtype=float) * 1e3
    cdf = [float(np.mean(gaps <= x)) for x in CDF_MS] if gaps.size else []
    return {"system": system, "rate": rate, "seed": seed, "num_requests": len(specs),
            "within_slo": float(np.mean(gaps <= tbt_s * 1e3)) if gaps.size else None,
            "tbt_max_ms": float(gaps.max()) if gaps.size else None, "cdf": cdf,
            "paper_attainment": p["paper_attainment"], "tbt_p99_ms": p["tbt_p99_ms"]}


def run_fig10(jobs: int = 1, model: str = "qwen-2.5-14b", traces_dir: str | None = None) -> dict[str, Any]:
    """Fig. 10: every system of :data:`FIG10_SYSTEMS` over every window of :data:`FIG10_STARTS` (a
    window is a seed), on ``jobs`` processes; PD Coloc.'s chunk is the one with the better median goodput."""
    from tidal.common.results import command_line
    from tidal.experiments.parallel import run_all

    calls = [(model, name, start, k, traces_dir) for k, start in enumerate(FIG10_STARTS) for name in FIG10_SYSTEMS]
    got = run_all(replay, calls, jobs)
    windows = []
    for k, start in enumerate(FIG10_STARTS):
        systems = {g["system"]: g for g in got if g["start_s"] == start}
        windows.append({"start_s": start, "seed": k, "systems": systems,
                        "input_per_interval": interval_inputs(traces_dir, start)})
    coloc = max((n for n in COLOC if n in FIG10_SYSTEMS),
                key=lambda n: sorted(w["systems"][n]["goodput"] for w in windows)[len(windows) // 2])
    first = windows[0]["systems"][HEADLINE]
    return {"command": command_line("python -m tidal.experiments.dynaserve_extra"), "trace": REPLAY_TRACE,
            "model": model, "headline": HEADLINE, "coloc": coloc, "windows": windows, "window_s": WINDOW_S,
            "interval_s": INTERVAL_S, "rate_mean": first["num_requests"] / WINDOW_S,
            "input_mean": first["input_mean"], "output_mean": first["output_mean"]}


def main(argv: list[str] | None = None) -> int:
    """``python -m tidal.experiments.dynaserve_extra --output FILE [--jobs N]``: Fig. 10's replay alone
    (``tidal reproduce dynaserve`` runs it too, and reads this file with ``--reuse-sim``)."""
    import argparse

    from tidal.common import flags as F
    from tidal.common.results import write_json

    p = argparse.ArgumentParser(prog="python -m tidal.experiments.dynaserve_extra", description=main.__doc__)
    p.add_argument("--output", required=True)
    p.add_argument("--jobs", type=F.positive_int, default=1)
    args = p.parse_args(argv)
    out = run_fig10(args.jobs)
    write_json(out, args.output)
    for w in out["windows"]:
        print(f"window from minute {w['start_s'] / 60:g}: " + ", ".join(
            f"{n} {v['goodput']:.0f} tok/s" for n, v in w["systems"].items()), flush=True)
    print(f"wrote {args.output}")
    return 0


__all__ = ["CDF_MS", "FIG10_STARTS", "FIG10_SYSTEMS", "INTERVAL_S", "REPLAY_TRACE", "WINDOW_S", "ablation",
           "alpha_beta", "interval_goodput", "interval_inputs", "main", "replay", "replay_specs", "run_fig10"]


if __name__ == "__main__":
    raise SystemExit(main())
