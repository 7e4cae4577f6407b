"""DynaServe (Sec. 6, Fig. 8-11, Tables 1-2) in the simulator: serving capacity and goodput of split
micro-requests (DynaServe) against colocation with chunked prefill (PD Coloc.) and P/D
disaggregation (PD Disagg.), two instances of Qwen-2.5-14B (one A100-80G each), 32B (two) and 72B
(four), on the paper's workloads, several seeds each.

The runs (each a command of its own, its JSON in ``--output``):

- ``dynaserve_sim.json``: ``tidal bench sim-dynaserve`` on 14B, Mini Reasoning (Fig. 9) and the hybrid
  of Table 2, at full fidelity (240 s windows of at most 2,000 requests a probe, 10 probes, a 4 %
  bracket), three seeds: PD Coloc. at 256, 512 and 2,048-token chunks, PD Disagg., and DynaServe
  with the paper's load placement (the claims' DynaServe), fixed roles and tidal's TTFT-guarded
  placement (labelled);
- ``dynaserve_fig9.json``: the same on 14B's other workloads of Fig. 9 (BurstGPT, Azure Code, arXiv
  summarization), DynaServe with the paper's placement only;
- ``dynaserve_grid.json``: 32B (TP 2, the paper's 2P2D) and 72B (TP 4, 4P4D), Fig. 8's rows, with
  fewer requests (120 s windows of at most 1,000, 8 probes), three seeds;
- ``dynaserve_extra.json``: why fixed roles load alpha (Mini Reasoning) and the SLO-aware batching
  ablation (Fig. 11), at rates the runs above measured; ``dynaserve_fig10.json``: the real-time replay
  (Fig. 10) (:mod:`tidal.experiments.dynaserve_extra`);
- ``jitter_fit.json``: ``tidal bench calibrate-jitter``, the testbed's fit to Table 1, read for the
  setup's words (written by the full run when absent).

``--quick``: Mini Reasoning on 14B only, three systems, one seed, 40 s windows of at most 200
requests, 3 probes (the tests check the runs, not the verdicts). ``--reuse-sim`` reads the run JSONs
already in ``--output`` instead of running them again (hours on two cores; each records the command that wrote it). Without ``--quick``
(or with ``--real``) the three layouts also run on 2 real CPU instances of the default model
(:mod:`tidal.experiments.dynaserve_real`) on Mini Reasoning's shape; ``--real-json`` reads a recorded
run of them instead.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from tidal.common.machine import usable_cores
from tidal.common.results import write_json
from tidal.experiments import dynaserve_claims as C
from tidal.experiments import sim_dynaserve as D
from tidal.experiments.dynaserve_real import row_seed as _seed
from tidal.experiments.reproduce import (
    Progress,
    Report,
    all_reused,
    beats,
    fmt_ratio,
    holds_on_seeds,
    ratio,
    run_bench,
    run_or_reuse,
    runs_real,
)

REAL = ("not run here: Qwen-2.5-14B does not fit this 2-core CPU; the same three layouts on 2 real CPU "
        "instances of the default model run without --quick (or with --real)")
# the simulated workloads whose shape the real run can serve (lengths scaled down): Mini Reasoning's
REAL_SHAPES = {"mini-reasoning": "dynaserve-219-1467"}
REAL_NO_SHAPE = "not run on the real engine: only Mini Reasoning's shape is (a 2-core CPU's time)"
WHY = "the A100 analytic cost model with the testbed fitted to the paper's own baselines stands in for vLLM on A100s"
WHY_WL = {
    "hybrid": "the hybrid is prefill-bound (~1,340 tokens in, ~69 out): a split moves work, it removes none",
    "mini-reasoning": "Mini Reasoning is decode-heavy (219 in, 1,467 out): every layout's capacity is where the host "
                      "tails, which grow with the decode batch, put over 1 % of the requests past the TBT SLO",
    "azure-code": "Azure Code is prefill-heavy (~2,048 in, ~28 out)",
    "arxiv": "arXiv summarization is long-input (~2,588 in, ~291 out)",
    "burstgpt": "BurstGPT is balanced (~642 in, ~262 out)",
}
SIM, FIG9, GRID = "dynaserve_sim.json", "dynaserve_fig9.json", "dynaserve_grid.json"
EXTRA, FIG10, FIT = "dynaserve_extra.json", "dynaserve_fig10.json", "jitter_fit.json"
# the rate range: up to 16 req/s, the paper's highest QPS for 14B on two GPUs (Table 3); a capacity
# at its top is a bound and is said so
FULL = ["--models", "qwen-2.5-14b", "--workloads", "hybrid,mini-reasoning",
        "--systems", "coloc-256,coloc-512,coloc-2048,disagg,dynaserve-load,dynaserve,dynaserve-place",
        "--seeds", "3", "--step-jitter", "fitted", "--rate-high", "16"]
FULL_FIG9 = ["--models", "qwen-2.5-14b", "--workloads", "burstgpt,azure-code,arxiv",
             "--systems", "coloc-256,coloc-512,coloc-2048,disagg,dynaserve-load", "--seeds", "3", "--step-jitter",
             "fitted", "--rate-high", "16"]
FULL_GRID = ["--models", "qwen-2.5-32b,qwen-2.5-72b", "--workloads", "burstgpt,azure-code,arxiv,mini-reasoning",
             "--systems", "coloc-256,coloc-512,coloc-2048,disagg,dynaserve-load", "--seeds", "3",
             "--step-jitter", "fitted", "--window", "120", "--num-requests", "1000", "--max-probes", "8",
             "--rate-high", "16"]
QUICK = ["--workloads", "mini-reasoning", "--systems", "coloc-512,disagg,dynaserve-load", "--seeds", "1",
         "--step-jitter", "fitted", "--num-requests", "200", "--window", "40", "--max-probes", "3", "--rate-low", "1",
         "--rate-high", "16"]


def _bench_argv(args: argparse.Namespace, base: list[str]) -> list[str]:
    argv = ["bench", "sim-dynaserve", *base]
    if not args.quick:
        argv += ["--jobs", str(usable_cores())]
    if args.no_progress:  # otherwise the bench's own lines (one per probe) show the progress
        argv.append("--no-progress")
    argv.append("--no-plots")  # drawn here, from the JSON (a reused run too)
    return argv


def _run_or_reuse(args: argparse.Namespace, name: str, base: list[str], log: Progress) -> dict[str, Any]:
    return run_or_reuse(args, D.add_parser, _bench_argv(args, base), os.path.join(args.output, name), log)


def _fit(args: argparse.Namespace, log: Progress) -> dict[str, Any] | None:
    """The testbed's Table 1 fit: ``jitter_fit.json`` in ``--output``; a full run writes it when absent."""
    from tidal.experiments import jitter_fit as J

    path = os.path.join(args.output, FIT)
    if not os.path.exists(path):
        if args.quick:
            return None
        argv = ["bench", "calibrate-jitter", "--jobs", str(usable_cores())]
        bench = run_bench(J.add_parser, argv, path, log)
        return bench
    with open(path) as f:
        return json.load(f)


def reproduce(args: argparse.Namespace, log: Progress) -> Report:
    from tidal.sim.jitter import FITTED

    reused = all_reused(args, (SIM,) if args.quick else (SIM, FIG9, GRID, EXTRA, FIG10))
    sim = _run_or_reuse(args, SIM, QUICK if args.quick else FULL, log)
    fig9 = None if args.quick else _run_or_reuse(args, FIG9, FULL_FIG9, log)
    grid = None if args.quick else _run_or_reuse(args, GRID, FULL_GRID, log)
    fit = _fit(args, log)
    extra = None if args.quick else _extra(args, sim, fig9, log)
    runs = {name: d for name, d in ((SIM, sim), (FIG9, fig9), (GRID, grid)) if d is not None}
    report = Report(
        "dynaserve", "DynaServe: split micro-requests vs colocation vs P/D disaggregation (Sec. 6, Fig. 8-11, "
                     "Tables 1-2)", _setup_text(runs, fit, FITTED), args.quick, data=_slim(runs, extra, fit),
        reused_sim=reused)
    if not args.no_plots:
        report.figures = _plots(runs, extra, args.output)
    recorded, real = getattr(args, "real_json", None), None
    if recorded:
        real = _recorded_real(recorded)
    elif runs_real(args):
        real = _run_real(sim, log)
    if real is not None:
        report.data["real"] = real
        how = (f"recorded earlier by `{real['command']}` (read from {recorded})" if recorded
               else f"run by this command, as `{real['command']}` runs it")
        report.setup += f" Real column: {how}."
    report.claims.append(C.table1_claim(fit))
    for data in runs.values():
        for model, by_wl in data["results"].items():
            for wl in by_wl:
                cells = _real_cells(real, wl)
                why = f"{WHY}; {WHY_WL.get(wl, '')}".rstrip("; ")
                if real is not None and wl in REAL_SHAPES:
                    why += f"; {_real_why(real, wl)}"
                st, res = data["setup"], data["results"][model][wl]["systems"]
                ratios = {d: D.seed_ratios(res, d, "paper", st["rate_low"], st["rate_high"]) for d in D.DYNA if d in res}
                report.claims += C.cell_claims(model, wl, ratios.get(D.HEADLINE, {}), why, cells,
                                               capacity_figure=model == "qwen-2.5-14b")
                if wl in ("hybrid", "mini-reasoning"):
                    report.claims += C.variant_claims(model, wl, ratios, why, REAL_NO_SHAPE)
    if extra is not None:
        if extra.get("alpha_beta"):
            report.claims.append(C.why_claim(extra["alpha_beta"], REAL_NO_SHAPE))
        if extra.get("fig10"):
            report.claims += C.replay_claims(extra["fig10"], REAL_NO_SHAPE)
        if extra.get("fig11"):
            report.claims.append(C.ablation_claim(extra["fig11"], REAL_NO_SHAPE))
    if not args.quick:
        report.data["readme_line"] = C.readme_line(report.claims, fit, real)
    return report


def _setup_text(runs: dict[str, dict[str, Any]], fit: dict[str, Any] | None, fitted: Any) -> str:
    sim = runs[SIM]
    s = sim["setup"]
    text = (f"Simulated on 2 x {s['hardware']} instances ({C.fit_text(fit, fitted)}), Poisson arrivals, seeds "
            f"{', '.join(str(x) for x in s['seeds'])} (each its own requests, arrivals and step tails), capacity "
            f"searched from {s['rate_low']:g} to {s['rate_high']:g} req/s (the paper's highest QPS for 14B, Table 3; a "
            f"capacity at either end is a bound and is said so).")
    for name, d in runs.items():
        g = d["setup"]
        cells = ", ".join(f"{m} (TP {g['tp'][m]}) x {', '.join(ws)}" for m, ws in d["results"].items())
        systems = ", ".join(g["systems"])
        text += (f" `{name}`: {cells}; {systems}; {g['window_s']:g} s windows of at most {g['num_requests']} requests "
                 f"a probe, {g['max_probes']} probes, a {g['tolerance']:.0%} bracket"
                 + (" (fewer requests than the 14B runs: two cores' time)" if g["num_requests"] < s["num_requests"]
                    else "") + ".")
    if GRID in runs:
        text += (" The step jitter was fitted on one A100 of 14B and is applied as is to the tensor-parallel "
                 "instances. The hybrid (Table 2) is 14B only, as in the paper; Fig. 9's capacities are 14B only, "
                 "Fig. 8's goodput rows all three models.")
    text += (f" Capacity is the paper's (Sec. 6.3): the highest sustained rate (no growing queue) at which >= "
             f"{s['target']:.0%} of the requests keep their own P99 TBT within {s['tbt_slo_ms']:g} ms; the TTFT-guarded "
             f"capacity (median TTFT <= {s['ttft_p50_ms']:g} ms) is in the JSON. DynaServe in the claims is the "
             f"paper's placement (`dynaserve-load`: Alg. 1 on both orientations of the pair, the one with the least "
             f"predicted max(T_alpha, T_beta), no TTFT target); fixed roles (`dynaserve`) and tidal's TTFT-guarded "
             f"placement (`dynaserve-place`) are labelled rows. PD Coloc. 'tuned' is the chunk (256, 512 or 2,048) "
             f"with the highest median capacity on the workload; PD Coloc. at 2,048 (Table 1's chunk) is its own row, "
             f"since which chunk the paper's tuned one was decides the claim. Verdicts (`judge`): per seed, a capacity "
             f"ratio must clear its searches' widest bracket plus {C.MARGIN_PAST_BRACKET:.0%}, a goodput ratio "
             f"{C.MARGIN:.0%}.")
    return text


def _extra(args: argparse.Namespace, sim: dict[str, Any], fig9: dict[str, Any] | None, log: Progress
           ) -> dict[str, Any]:
    """The runs beyond the grid (:mod:`tidal.experiments.dynaserve_extra`), at rates the grid measured."""
    from tidal.common.results import command_line
    from tidal.experiments import dynaserve_extra as X
    from tidal.experiments.parallel import run_all

    path = os.path.join(args.output, EXTRA)
    if getattr(args, "reuse_sim", False) and os.path.exists(path):
        log(f"reusing {path}")
        with open(path) as f:
            return json.load(f)
    model, jobs = "qwen-2.5-14b", usable_cores()
    rows = sim["results"].get(model, {})
    st = sim["setup"]
    out: dict[str, Any] = {"command": command_line("tidal reproduce")}
    mr = rows.get("mini-reasoning", {}).get("systems", {}).get("dynaserve")
    if mr:
        calls = [("qwen-2.5-14b", "mini-reasoning", r["paper"]["capacity_rps"], r["seed"], st["window_s"],
                  st["num_requests"]) for r in mr if r["paper"]["capacity_rps"]]
        log(f"where the sequences go (Mini Reasoning): {len(calls)} seeds x 4 runs")
        out["alpha_beta"] = run_all(X.alpha_beta, calls, jobs)
    out["fig10"] = _fig10(args, jobs, log)
    bg = (fig9 or sim)["results"].get(model, {}).get("burstgpt", {}).get("systems", {}).get(D.HEADLINE)
    if bg:
        calls = [(model, "burstgpt", name, r["paper"]["capacity_rps"], r["seed"], st["window_s"], st["num_requests"])
                 for r in bg if r["paper"]["capacity_rps"] for name in (D.HEADLINE, "dynaserve-noslo")]
        log(f"Fig. 11 ablation: {len(calls)} runs")
        got = run_all(X.ablation, calls, jobs)
        seeds = []
        for i in range(0, len(got), 2):
            seeds.append({"seed": got[i]["seed"], "rate": got[i]["rate"], "with": got[i], "without": got[i + 1]})
        out["fig11"] = {"workload": "burstgpt", "cdf_ms": list(map(float, X.CDF_MS)), "seeds": seeds}
    write_json(out, path)
    return out


def _fig10(args: argparse.Namespace, jobs: int, log: Progress) -> dict[str, Any]:
    """Fig. 10's replay (``dynaserve_fig10.json``, ``python -m tidal.experiments.dynaserve_extra``: it
    needs none of the other runs, so it can run beside them); reused with ``--reuse-sim``."""
    from tidal.experiments import dynaserve_extra as X

    path = os.path.join(args.output, FIG10)
    if getattr(args, "reuse_sim", False) and os.path.exists(path):
        log(f"reusing {path} (written by its own command)")
        with open(path) as f:
            return json.load(f)
    log(f"Fig. 10 replay: {len(X.FIG10_STARTS) * len(X.FIG10_SYSTEMS)} runs of {X.WINDOW_S / 60:g} minutes")
    got = X.run_fig10(jobs)
    write_json(got, path)
    return got


def _run_real(sim: dict[str, Any], log: Progress) -> dict[str, Any]:
    """The three layouts on 2 real CPU instances, on the shape of every simulated workload that has one,
    for each of the setup's seeds."""
    from tidal.experiments import dynaserve_real as R

    setup = R.RealSetup()
    shapes = sorted({REAL_SHAPES[wl] for by_wl in sim["results"].values() for wl in by_wl if wl in REAL_SHAPES})
    with tempfile.TemporaryDirectory(prefix="tidal-dynaserve-real-") as tmp:  # each run's records: not kept
        rows = R.run(shapes, list(R.CLAIM_LAYOUTS), setup, os.path.join(tmp, "run"), log)
    command = f"python benchmarks/dynaserve_serve.py --workloads {','.join(shapes)}"
    return {"setup": setup.__dict__, "engine_flags": setup.engine_flags(), "rows": rows, "command": command}


def _recorded_real(path: str) -> dict[str, Any]:
    """The real column from a recorded ``benchmarks/dynaserve_serve.py`` run's JSON (its runs take
    about 7 minutes a layout and seed here): its setup, rows and command, checked for every claim layout
    of each shape and seed; a run that was cut off is refused."""
    from tidal.experiments import dynaserve_real as R

    with open(path) as f:
        rec = json.load(f)
    if rec.get("complete") is False:
        raise ValueError(f"{path}: the run was cut off after {len(rec['rows'])} layouts; run it again")
    st = {**R.RealSetup().__dict__, **{k: v for k, v in rec["args"].items() if k in R.RealSetup().__dict__}}
    for wl in REAL_SHAPES.values():
        for seed in sorted({_seed(r) for r in rec["rows"] if r["workload"] == wl}):
            missing = set(R.CLAIM_LAYOUTS) - {r["layout"] for r in rec["rows"] if r["workload"] == wl
                                              and _seed(r) == seed}
            if missing:
                raise ValueError(f"{path}: {wl}, seed {seed} lacks the layouts {sorted(missing)}")
    return {"setup": st, "rows": rec["rows"], "command": rec["command"], "machine": rec.get("machine")}


def _real_rows(real: dict[str, Any] | None, wl: str) -> dict[str, list[dict[str, Any]]]:
    """Per layout its rows on workload ``wl``'s shape, one a seed, in seed order."""
    if real is None:
        return {}
    by: dict[str, list[dict[str, Any]]] = {}
    for r in sorted((r for r in real["rows"] if r["workload"] == REAL_SHAPES.get(wl)), key=_seed):
        by.setdefault(r["layout"], []).append(r)
    return by


def _paired(by: dict[str, list[dict[str, Any]]]) -> tuple[list[int], dict[str, list[dict[str, Any]]]]:
    """The seeds every claim layout ran, and each claim layout's rows on just those seeds."""
    from tidal.experiments.dynaserve_real import CLAIM_LAYOUTS

    seeds = sorted(set.intersection(*({_seed(r) for r in by.get(k, [])} for k in CLAIM_LAYOUTS)))
    return seeds, {k: [r for r in by.get(k, []) if _seed(r) in seeds] for k in CLAIM_LAYOUTS}


# the words for the split layout's placement (dynaserve_real.LAYOUTS)
PLACEMENT = {"split": "the paper's placement: either instance may be a request's alpha",
             "split-fixed": "fixed roles"}


def _real_cells(real: dict[str, Any] | None, wl: str) -> tuple[str, str, str]:
    """The real column of the three claims of workload ``wl`` (capacity vs PD Coloc., vs PD Disagg.,
    goodput), per seed, or why there is none. A direction holds when it holds on every seed."""
    if real is None:
        return REAL, REAL, REAL
    by = _real_rows(real, wl)
    if not by:
        return REAL_NO_SHAPE, REAL_NO_SHAPE, REAL_NO_SHAPE
    st = real["setup"]
    seeds, got = _paired(by)
    split, coloc, disagg = got["split"], got["colocate"], got["disaggregate"]
    first = split[0]
    slo = ", ".join(f"{k} <= {v} ms" for k, v in (kv.split("=") for kv in st["slo"].split(",")))
    where = (f"2 CPU instances of the default model, {REAL_SHAPES[wl]} at {first['lengths'][0]}/{first['lengths'][1]} "
             f"tokens, {slo} for {st['target']:.0%}, {st['duration']:g} s Poisson probes; "
             f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}, {PLACEMENT[first['layout']]}")
    per = " per seed" if len(seeds) > 1 else ""

    def cap(row: dict[str, Any]) -> str:
        c = row["capacity_rps"]
        if c is None:
            return f"< {st['search_low']:g}"
        return f">= {c:.2f}" if c >= st["search_high"] else f"{c:.2f}"

    def cap_cell(base: list[dict[str, Any]]) -> str:
        gains = ", ".join(fmt_ratio(ratio(a["capacity_rps"], b["capacity_rps"])) for a, b in zip(split, base, strict=True))
        wins = [beats(a["capacity_rps"], b["capacity_rps"]) for a, b in zip(split, base, strict=True)]
        return (f"{' / '.join(map(cap, split))} vs {' / '.join(map(cap, base))} rps{per}: {gains} ({where}) "
                f"(direction holds: {holds_on_seeds(wins)})")

    def tok(rows: list[dict[str, Any]]) -> str:
        return " / ".join(f"{r['goodput_tok_s']:.0f}" for r in rows)

    wins = [beats(s["goodput_tok_s"], c["goodput_tok_s"]) and beats(s["goodput_tok_s"], d["goodput_tok_s"])
            for s, c, d in zip(split, coloc, disagg, strict=True)]
    good = (f"{tok(split)} vs {tok(coloc)} (PD Coloc.) and {tok(disagg)} tok/s (PD Disagg.){per}, each at its own "
            f"capacity ({where}) (direction holds: {holds_on_seeds(wins)})")
    return cap_cell(coloc), cap_cell(disagg), good


def _real_why(real: dict[str, Any], wl: str) -> str:
    """The real run in words, every figure from its JSON (rows and, where recorded, the step-log profile)."""
    by = _real_rows(real, wl)
    if not by:
        return ""
    by = _paired(by)[1]
    sp = by["split"]

    def each(rows: list[dict[str, Any]], key: str, spec: str, scale: float = 1.0) -> str:
        return " / ".join(format(scale * (r.get(key) or 0), spec) for r in rows)

    text = (f"real: the default model on 1 CPU thread per instance, not vLLM on A100s; PD Coloc. there is one chunk "
            f"size ({real['setup'].get('max_num_batched_tokens', 256)} tokens) with the same "
            f"{real['setup']['batching']} local policy as the other two; the split runs split "
            f"{each(sp, 'split_fraction', '.0f', 100)} % of their requests ({PLACEMENT[sp[0]['layout']]}), "
            f"{each(sp, 'kv_mb_per_request', '.1f')} MB of KV a request; P99 TBT at capacity "
            f"{each(by['colocate'], 'tbt_p99_ms', '.0f')} ms (PD Coloc.), {each(by['disaggregate'], 'tbt_p99_ms', '.0f')} "
            f"(PD Disagg.), {each(sp, 'tbt_p99_ms', '.0f')} (split){', per seed' if len(sp) > 1 else ''}")
    row = sp[0]
    prof = row.get("profile")
    if prof:
        inst = prof["instances"]
        a, b = inst.get("0", {}), inst.get("1", {})
        text += f"; its step log (seed {_seed(row)})"
        if a.get("mixed_s"):
            text += (f": instance 0 ran {a['mixed_steps']} mixed steps of "
                     f"{a['mixed_s'][0]:.2f}-{a['mixed_s'][2]:.2f} s (p10-p90), instance 1 {b.get('mixed_steps', 0)}")
        if a.get("decode_s_per_seq") and b.get("decode_s_per_seq"):
            text += (f", decode steps {1e3 * a['decode_s_per_seq']:.0f} ms a sequence on instance 0 against "
                     f"{1e3 * b['decode_s_per_seq']:.0f} on instance 1, {a['mean_running']:.1f} vs "
                     f"{b['mean_running']:.1f} running")
        if prof.get("predicted_output_mean") is not None:
            text += (f"; the length predictor predicted {prof['predicted_output_mean']:.0f} tokens on average for "
                     f"{prof['output_len']}")
    else:
        text += "; no step-log profile was recorded in this run's JSON"
    return text


def _slim(runs: dict[str, dict[str, Any]], extra: dict[str, Any] | None, fit: dict[str, Any] | None
          ) -> dict[str, Any]:
    """Per run, cell and system the per-seed capacities and goodput (the runs' own JSON, next to this
    one, have every probe)."""
    def slim(data: dict[str, Any]) -> dict[str, Any]:
        return {"setup": data["setup"], "command": data["command"],
                "results": {m: {wl: {"workload": res["workload"], "systems": {
                    k: [{"seed": r["seed"], "capacity_rps": r["capacity_rps"], "bracket": r["bracket"],
                         "paper_capacity_rps": r["paper"]["capacity_rps"], "paper_bracket": r["paper"]["bracket"],
                         "max_goodput": r["paper"]["max_goodput"]} for r in rows]
                    for k, rows in res["systems"].items()}} for wl, res in by_wl.items()}
                    for m, by_wl in data["results"].items()}}
    out: dict[str, Any] = {name.removesuffix(".json").removeprefix("dynaserve_"): slim(d) for name, d in runs.items()}
    if extra is not None:
        out["extra_command"] = extra.get("command")
    if fit is not None:
        out["jitter_fit"] = {"command": fit["command"], "max_abs_rel_err": fit["fit"]["max_abs_rel_err"],
                             "mean_abs_rel_err": fit["fit"]["mean_abs_rel_err"], "params": fit["fit"]["params"]}
    return out


def _plots(runs: dict[str, dict[str, Any]], extra: dict[str, Any] | None, out_dir: str) -> list[str]:
    files = []
    for name, d in runs.items():
        files += [os.path.basename(p) for p in D._plots(d, os.path.join(out_dir, name))]
    if extra is not None:
        from tidal.experiments.dynaserve_plots import plot_extra

        files += plot_extra(extra, out_dir)
    return files


__all__ = ["REAL", "REAL_NO_SHAPE", "REAL_SHAPES", "reproduce"]
