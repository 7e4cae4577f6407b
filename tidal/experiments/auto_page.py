"""The generated page and plots of ``tidal bench sim-auto`` (from its JSON only: the same JSON always
gives the same page and figures)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tidal.common.plots import pyplot, save_figure

COLORS = {"recompute": "tab:gray", "swap": "tab:orange", "migrate": "tab:green", "drop": "tab:blue",
          "auto": "tab:red", "auto-nodrop": "tab:pink", "auto-limit": "tab:brown"}
MARKERS = {"recompute": "x", "swap": "s", "migrate": "^", "drop": "o"}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _mean(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return float(np.mean(got)) if got else None


def _per_seed(vals: list[float | None], fmt=_ms) -> str:
    return " / ".join(fmt(v) for v in vals)


# ---------------------------------------------------------------- text
def summary_lines(res: dict[str, Any]) -> list[str]:
    lines = []
    for level, d in (res.get("trace") or {}).get("levels", {}).items():
        j = d["judged"]
        lines.append(f"trace ({level}): " + "; ".join(
            f"{ph} {v['verdict']} (auto / best fixed P99 TTFT "
            + _per_seed([s["auto_over_best"] for s in v["per_seed"]], _x) + ")" for ph, v in j["phases"].items()))
        lines.append("  over the trace, fixed / auto P99 TTFT: " + "; ".join(
            f"{s} {_per_seed(v['per_seed'], _x)} ({v['verdict']})" for s, v in j["whole"].items())
            + f"; auto lost {j['lost']['auto']}")
        for b, v in (d.get("bounds") or {}).items():
            lines.append(f"  {b} (bound): best fixed / {b} P99 TTFT over the trace {_per_seed(best_over(v['judged']), _x)}")
        sl = (res.get("schedules") or {}).get("levels", {}).get(level)
        if sl:
            lines.append(f"  every schedule (bound): best fixed / best schedule P99 TTFT over the trace, seeds "
                         f"{sl['seeds']}: {_per_seed([x['ratio'] for x in sl['judged']], _x)}")
    for d, v in (res.get("kunserve") or {}).items():
        j = v["judged"]
        lines.append(f"KunServe {d} at {v['rate']:.3g} req/s: {j['verdict']} ("
                     + "; ".join("-" if s is None else f"vs {s['against']} {s['auto_vs']:.2f}" for s in j["per_seed"])
                     + ")")
    for lab, v in (res.get("pang") or {}).items():
        j = v["judged"]
        lines.append(f"Pang {lab}: {j['verdict']} (" + "; ".join(
            "-" if s is None else f"vs {s['against']} {s['auto_vs']:.2f}" for s in j["per_seed"]) + ")")
    real = res.get("real")
    if real:
        lines.append(f"real engine: tokens as one engine: {real['tokens_equal_one_engine']}; choices "
                     + ", ".join(f"{c['index']}:{c['choice']}" for c in real["choices"]))
    return lines


def readme_line(res: dict[str, Any]) -> str:
    """The README's auto line, every figure from the run's JSON (test-checked against README.md)."""
    from tidal.experiments.sim_auto import PAPER_BAR, PHASE_BAR, TRACE_BAR

    levels = (res.get("trace") or {}).get("levels", {})
    verdicts = [v["verdict"] for d in levels.values() for v in (*d["judged"]["phases"].values(),
                                                                *d["judged"]["whole"].values())]
    verdicts += [v["judged"]["verdict"] for part in ("kunserve", "pang") for v in (res.get(part) or {}).values()]
    ok = bool(verdicts) and all(v == "holds" for v in verdicts)
    out = "recommended." if ok else "not recommended."
    parts = []
    for i, (level, d) in enumerate(levels.items()):
        ph = [s["auto_over_best"] for v in d["judged"]["phases"].values() for s in v["per_seed"]
              if s["auto_over_best"] is not None]
        # auto over the best fixed response, per seed
        whole = [1 / x for x in best_over(d["judged"]) if x]
        if ph:
            parts.append(f"{min(ph):.2f}-{max(ph):.2f}x the best fixed choice's per phase and "
                         f"{min(whole):.2f}-{max(whole):.2f}x over the trace at KunServe's load" if i == 0 else
                         f"{min(ph):.2f}-{max(ph):.2f}x and {min(whole):.2f}-{max(whole):.2f}x at {level}")
    if parts:
        out += " P99 TTFT on a regime-changing trace: " + ", ".join(parts)
        bound = [x for d in levels.values() for v in (d.get("bounds") or {}).values() for x in best_over(v["judged"])]
        one = [x for d in levels.values() for x in d["judged"].get("one_best", [])]
        if bound:  # the hindsight bound: what any choice made per phase could give
            out += (f" (each phase's best, pinned in hindsight, beats them all by {TRACE_BAR:g}x in "
                    f"{sum(1 for x in bound if x is not None and x >= TRACE_BAR)} of {len(bound)} load-seed pairs)")
        elif one:
            out += (f" (one fixed response is within {(PHASE_BAR - 1) * 100:.0f} % of the best in every phase in "
                    f"{sum(1 for x in one if x)} "
                    f"of {len(one)} load-seed pairs)")
        out += "."
    ks = [s for v in (res.get("kunserve") or {}).values() for s in v["judged"]["per_seed"] if s is not None]
    if ks:
        out += (f" KunServe's datasets: within {(PAPER_BAR - 1) * 100:.0f} % of the better of drop and recompute on "
                f"{sum(s['auto_vs'] >= 1 / PAPER_BAR for s in ks)} of {len(ks)} seeds.")
    pg = [s["auto_vs"] for v in (res.get("pang") or {}).values() for s in v["judged"]["per_seed"] if s is not None]
    if pg:
        out += f" `--batching auto`: {min(pg):.2f}-{max(pg):.2f}x the better capacity of Pang's and a fixed cap."
    return out


def _phase_table(d: dict[str, Any], phases: list[str]) -> list[str]:
    runs = d["runs"]
    out = ["| phase | system | P50 TTFT (ms) | P99 TTFT (ms), per seed | P99 TPOT (ms) | goodput (tok/s) | lost |",
           "|---|---|---|---|---|---|---|"]
    for ph in [*phases, "whole"]:
        for s, rs in runs.items():
            row = [r["phases"][ph] if ph != "whole" else r["whole"] for r in rs]
            out.append(f"| {ph if ph != 'whole' else '**whole trace**'} | {s} | {_ms(_mean([r['ttft_p50_ms'] for r in row]))} | "
                       f"{_per_seed([r['ttft_p99_ms'] for r in row])} | {_ms(_mean([r['tpot_p99_ms'] for r in row]))} | "
                       f"{_ms(_mean([r['goodput_tok_s'] for r in row]))} | {sum(r['lost'] for r in row)} |")
    return out


def _audit_table(d: dict[str, Any]) -> list[str]:
    """Each run's onsets: the response used, how many, and realized / predicted (median) per seed."""
    from tidal.sim.auto_audit import summarize_audit

    out = ["| run | response used | onsets, per seed | realized / predicted (median), per seed |", "|---|---|---|---|"]
    for s, rs in d["runs"].items():
        per = [summarize_audit([{"response": a[2], "predicted_s": {a[2]: a[3]}, "realized_s": a[4]}
                                for a in r.get("audit") or []]) for r in rs]
        if not any(r.get("audit") is not None for r in rs):
            continue
        for resp in sorted({k for p in per for k in p}):
            out.append(f"| {s} | {resp} | {_per_seed([p.get(resp, {}).get('onsets', 0) for p in per], str)} | "
                       f"{_per_seed([p.get(resp, {}).get('median_realized_over_predicted') for p in per], _x)} |")
    return out


def _why_trace(d: dict[str, Any], instances: int) -> list[str]:
    """What bounds the whole-trace claim: a fixed response (near) the best in every phase, and what each
    system served per second over the run."""
    from tidal.experiments.sim_auto import PHASE_BAR, TRACE_BAR

    out = []
    one = d["judged"].get("one_best")
    if one is not None:
        out += [f"Fixed responses within {(PHASE_BAR - 1) * 100:.0f} % of the best one's P99 TTFT in every phase, "
                "per seed: " + " / ".join(", ".join(x) or "none" for x in one) + ". Where a seed has one, the trace "
                "did not change regime for the fixed responses there: a choice per phase is at best that response "
                f"in each phase, and the whole-trace claim asks auto to beat it by {TRACE_BAR:g}x.", ""]
    rates = {s: [r.get("service_tok_s") for r in rs] for s, rs in d["runs"].items()}
    if any(v is not None for vs in rates.values() for v in vs):
        out += ["Output tokens served per second over the run (the first arrival to the last response), per "
                "seed: " + "; ".join(f"{s} {_per_seed(v, lambda x: '-' if x is None else f'{x:,.0f}')}" for s, v in rates.items())
                + ". A drop's pipeline group lasts until KunServe's restore rule splits it, past the episode "
                  "the prediction prices; where memory stays high it does not split, and what the groups serve "
                  "per second is what the rest of the trace gets.", ""]
    return out + _layouts(d, instances) + _limits(d)


def layout_of(run: dict[str, Any], instances: int) -> dict[str, Any] | None:
    """What a run's pipeline groups cost it (None: it formed none): the deepest group (its stages,
    when it formed and ended), the share of the run's instance-seconds spent in a group, and the
    stages' idle share over that time (bubbles, weighted by each group's stage-seconds)."""
    groups, span = run.get("groups") or [], run.get("span_s")
    if not groups or not span or span[1] <= span[0]:
        return None
    held = [(k, t0, t1, b) for k, t0, t1, b in groups if t1 is not None and t1 > t0]
    stage_s = sum(k * (t1 - t0) for k, t0, t1, _ in held)
    idle = sum(k * (t1 - t0) * (b or 0.0) for k, t0, t1, b in held)
    k, t0, t1, _ = max(groups, key=lambda g: (g[0], -(g[1])))
    return {"deepest": k, "formed_s": t0, "ended_s": t1, "grouped_share": stage_s / (instances * (span[1] - span[0])),
            "bubble": idle / stage_s if stage_s else None}


def _layouts(d: dict[str, Any], instances: int) -> list[str]:
    """Per seed, the pipeline groups of the runs that formed any (drop's, auto's)."""
    parts = []
    for s, rs in d["runs"].items():
        got = [layout_of(r, instances) for r in rs]
        if not any(got):
            continue
        parts.append(f"{s} " + " / ".join(
            "none" if g is None else f"{g['deepest']} stages from {g['formed_s']:.0f} s to {g['ended_s']:.0f} s, "
            f"{g['grouped_share']:.0%} grouped, bubbles {'-' if g['bubble'] is None else format(g['bubble'], '.0%')}" for g in got))
    if not parts:
        return []
    return ["Pipeline groups, per seed (the deepest group and when it formed and ended; the share of the run's "
            "instance-seconds spent in a group; the stages' idle share there, Sec. 5.3's bubbles): "
            + "; ".join(parts) + ".", ""]


def _limits(d: dict[str, Any]) -> list[str]:
    """Per seed, when KunServe's limit signal put an ``undo_at_limit`` run off drops (and back on)."""
    parts = []
    for s, rs in d["runs"].items():
        if not any("limits" in r for r in rs):
            continue
        parts.append(f"{s} " + " / ".join(", ".join(f"{'off drops' if k == 'limit' else 'back on'} at {t:.0f} s"
                                                   for k, t in r.get("limits") or []) or "never" for r in rs))
    if not parts:
        return []
    return ["KunServe's limit signal (Sec. 4.4), per seed: " + "; ".join(parts) + ".", ""]


def kunserve_layouts(ks: dict[str, Any], instances: int) -> list[str]:
    """Per KunServe dataset, the pipeline groups of the runs that formed any, and the limit spells."""
    return [f"{dname}: {line}" if line else line for dname, v in ks.items() for line in _layouts(v, instances)
            + _limits(v)]


def _ablation_trace(d: dict[str, Any], labels: dict[str, str], why: dict[str, str]) -> list[str]:
    """Each labelled ablation's claims, judged as auto's are (the fixed responses' runs are the same)."""
    out = []
    for a, j in (d.get("ablations") or {}).items():
        out += [f"**{labels.get(a, a)}** (`{a}`: {why.get(a, 'ours')}). Per phase, its P99 TTFT over the "
                "best fixed response's, per seed: " + "; ".join(
                    f"{ph} {_per_seed([s['auto_over_best'] for s in v['per_seed']], _x)} ({v['verdict']})"
                    for ph, v in j["phases"].items())
                + ". Over the trace, each fixed response's P99 TTFT over its: " + "; ".join(
                    f"{s} {_per_seed(v['per_seed'], _x)}" for s, v in j["whole"].items())
                + f". Requests lost: {_per_seed(j['lost']['auto'], str)}.", ""]
    return out


def best_over(j: dict[str, Any]) -> list[float | None]:
    """Per seed, the best fixed response's whole-trace P99 TTFT over the judged system's (the least of
    the fixed-over-it ratios; what the whole-trace bar asks to be at least 1.2x)."""
    ratios = [w["per_seed"] for w in j["whole"].values()]
    return [None if any(r[k] is None for r in ratios) else min(r[k] for r in ratios) for k in range(len(ratios[0]))]


def _bound_trace(d: dict[str, Any], bounds: dict[str, dict[str, str]], every: bool = False) -> list[str]:
    """Each bound's schedule and figures, judged as auto's are, and the whole-trace ratio the bar asks."""
    from tidal.experiments.auto_runs import FIXED
    from tidal.experiments.sim_auto import TRACE_BAR

    out = []
    for b, v in (d.get("bounds") or {}).items():
        j, info = v["judged"], bounds.get(b, {})
        vs_best = best_over(j)
        reach = sum(1 for x in vs_best if x is not None and x >= TRACE_BAR)
        out += [f"**{info.get('label', b)}** (`{b}`: {info.get('why', 'ours')}). Its schedule per seed: "
                + " / ".join(", ".join(v["schedules"][k]) for k in range(len(v["schedules"])))
                + ". Per phase, its P99 TTFT over the best fixed response's: " + "; ".join(
                    f"{ph} {_per_seed([s['auto_over_best'] for s in w['per_seed']], _x)}"
                    for ph, w in j["phases"].items())
                + ". Over the trace, the best fixed response's P99 TTFT over its, per seed: " + _per_seed(vs_best, _x)
                + f": at least {TRACE_BAR:g}x on {reach} of {len(vs_best)} seeds. Where it falls short, choosing "
                  "each phase's best response does not meet the whole-trace bar on that seed (the other "
                  f"{len(FIXED) ** len(v['schedules'][0]) - 1} schedules of the fixed responses over "
                  + ("the phases: the next paragraph, on the seeds it names" if every else
                     "the phases were not run") + "). Requests lost: "
                + _per_seed(j["lost"]["auto"], str) + ".", ""]
    return out


def _schedules_trace(level: str, sched: dict[str, Any] | None) -> list[str]:
    """``--all-schedules``' paragraph for one level: the best of every schedule per seed, against the
    best fixed response over the trace, and how many schedules reach the bar."""
    lv = (sched or {}).get("levels", {}).get(level)
    if not lv:
        return []
    j = lv["judged"]
    n = j[0]["schedules"]
    back = [seed for lv_name, seed in sched.get("read_back") or [] if lv_name == level]
    reach = sum(1 for x in j if x["ratio"] is not None and x["ratio"] >= sched["bar"])
    same = [x["hindsight_p99_ms"] for x in j if "hindsight_p99_ms" in x]
    out = [f"**Every schedule** ({n}: each of the four fixed responses for each of the {len(sched['phases'])} phases, "
           f"pinned as the bound above, `{sched['command']}`, on seeds {', '.join(map(str, lv['seeds']))}"
           + (f" (seed{'s' if len(back) > 1 else ''} {', '.join(map(str, back))} read back from an earlier run in "
              "`auto_schedules.json`)" if back else "") + "). The best "
           "schedule per seed, its whole-trace P99 TTFT and the best fixed response's over it: " + "; ".join(
               f"seed {x['seed']}: {', '.join(x['best'])} {_ms(x['best_p99_ms'])} ms vs {x['best_fixed']} "
               f"{_ms(x['best_fixed_p99_ms'])} ms = {_x(x['ratio'])} ({x['schedules_reaching_bar']} of {n} "
               f"schedules reach {sched['bar']:g}x)" for x in j)
           + f". At least {sched['bar']:g}x on {reach} of {len(j)} seeds: where none does, no choice made once per "
             "phase among the four responses meets the whole-trace bar on that seed. Requests lost by the best "
             "schedules: " + _per_seed([x["best_lost"] for x in j], str) + "."
           + (" The per-phase-best schedule gives the bound's figure again on every seed (the runs are "
              "deterministic)." if same and all(v["recorded"] == v["here"] for v in same) else
              " **The per-phase-best schedule did not give the bound's recorded figure on every seed.**"
              if same else ""), ""]
    return out


def drops_before_learning(run: dict[str, Any]) -> int | None:
    """The drops ``auto`` took before any drop episode of its own was served (before the first reason
    that scales drop's prediction); None when it never took drop."""
    import re

    choices, reasons = run.get("choices") or [], run.get("choice_reasons") or []
    if not any(c[2] == "drop" for c in choices):
        return None
    scaled = re.compile(r"\bdrop (?:predicted )?[^\s()]+ s \([^\s()]+ x [^\s()]+ learned\)")  # decide()'s wording
    first = next((i for i, x in enumerate(reasons) if scaled.search(x)), len(choices))
    return sum(1 for c in choices[:first] if c[2] == "drop")


def _claims(j: dict[str, Any]) -> list[str]:
    out = ["| claim | per seed | verdict |", "|---|---|---|"]
    for ph, v in j["phases"].items():
        seeds = ", ".join(f"{_x(s['auto_over_best'])} (best: {s['best_fixed']})" for s in v["per_seed"])
        out.append(f"| {ph}: {v['claim']} (auto / best, <= 1.05) | {seeds} | **{v['verdict']}** |")
    for v in j["whole"].values():
        out.append(f"| whole trace: {v['claim']} | {_per_seed(v['per_seed'], _x)} | **{v['verdict']}** |")
    out.append(f"| no request lost by auto | {_per_seed(j['lost']['auto'], str)} | **{j['no_loss']}** |")
    return out


def write_page(res: dict[str, Any], path: str, figures: list[str]) -> None:
    st = res["setup"]
    rel = os.path.relpath(os.path.dirname(figures[0]) if figures else ".", os.path.dirname(os.path.abspath(path)))
    fig = {os.path.basename(f): f"{rel}/{os.path.basename(f)}" for f in figures}
    L = ["# auto: the response the moment calls for", "",
         f"Generated by `{res['command']}` from `auto_sim.json`" + (
             f" and by `{res['schedules']['command']}` from `auto_schedules.json`; every figure here comes from "
             "those files." if res.get("schedules") else "; every figure here comes from that file."), "",
         "## The mechanism", "",
         "`--kv-pressure auto` (`tidal/cluster/pressure/predict.py`, `choose.py`, `auto.py`; the simulator's "
         "`tidal/sim/auto.py` and the runtime's `tidal/runtime/auto.py` drive the same object). At each throttle "
         "onset (the head of an instance's queue does not fit its free KV, the monitor's detection) it predicts, "
         "with Eq. 1 coefficients of the simulator's cost model, the seconds until the queued demand and what the "
         "response displaces are served: recompute (the victims' re-prefill; the victims are the running "
         "requests the scheduler preempts when their growth finds no free block while the queue waits), swap "
         "(their KV out and back over the host link, as far as the host pool holds them), migrate (decoding requests' KV over the instance "
         "link to peers with room), drop (KunServe's plan: the freed weights and the peer's spare KV, the "
         "group's queue on n instances less the pipeline's per-stage overheads and activation hops); the memory a "
         "response leaves uncovered comes back as requests finish, the running ones and the queued ones once "
         "admitted (their remaining tokens, at the instance's measured step time), and the queue's prefill "
         "overlaps that wait (the later of the two counts). Each prediction is scaled by what the response's "
         "past episodes took against their predictions (the median of its last 8 ratios: the seconds until the "
         "last request queued at the onset had its first token over the seconds predicted; for a response with "
         "none yet, the median of every response's latest ratios; 1 before any episode is served). It "
         "takes the least; an episode is one decision (it lasts while the "
         "instance is throttled and 2 s after), and a new episode leaves the instance's previous choice only for "
         "a response predicted 20 % faster. Every choice is recorded with its episode, prices, predictions, "
         "scales and reason and replays from them.", "",
         "The overlap, the queue's recycling and the learned scales are a revision, made after the audit below, "
         "run on the first version (commit c67701f), showed recompute's and swap's predictions well above what "
         "happened and drop's below it, so that auto took drop where swap served the queue sooner. The victims "
         "as the growth's lack are a second revision: until commit 6ae761f they were the running requests whose "
         "blocks covered the queue's shortage, which no scheduler here preempts (a throttle preempts nothing), "
         "and that page's audit showed recompute's predictions, which carried their re-prefill, above what "
         "happened where swap's came close, so that the learned scales made recompute "
         "look faster than swap. A third revision: a migration that moves nothing (no peer has room) leaves "
         "the queue to the scheduler's recompute, and its prediction, recompute's, is now scaled and learned as "
         "recompute's; until commit 09524c2 it kept scale 1 beside recompute's learned one, so that page's "
         "auto-nodrop took that same recompute as migrate in the long and code phases at 1.25x, where swap "
         "served sooner. A fourth: a response with no served episode of its own is scaled by the error every "
         "response's predictions have shown so far; until commit 1058d6a it kept scale 1, and where a queue "
         "with no victims waits the same under recompute and swap, recompute at 1 looked faster than swap at "
         "its learned scale and was taken (auto-nodrop at 1.25x, seed 2, in the long and code phases, where "
         "swap served sooner). It is not a gain everywhere: it also takes away the push scale 1 gave a response "
         "not yet tried, which on that page had auto try swap at the paper rule (seed 1, the chat phase), where it "
         "now takes drop, and its code phase there is slower. The audit below is of this version.", "",
         "`--batching auto` (`tidal/policies/auto.py`): each step's batch cap is the tighter of Pang et al.'s "
         "b_mem (Alg. 1, the KV pool) and b_SLA (Alg. 2, the TBT SLO); its token budget is the tighter of Pang's "
         "chunk search (Alg. 2 on the chunk) and DynaServe's composer (Alg. 2) once the composer's profile "
         "table has 16 steps, the search's before; the binding constraint is recorded each step. The tighter "
         "of the two is a revision: the first version took the composer's budget alone once ready, and on "
         "Pang's setup (out-61) its steps ran at the SLO itself, so that auto's capacity was below the paper's "
         "controller's on every seed (commit d6ca204's run of this page).", "",
         "## Setup", "",
         f"{st['model']} on {st['instances']} x {st['hardware']} ({st['link']} between instances), dispatcher "
         f"`{st['router']}` (Llumnix's freeness, KunServe's dispatcher), chunked prefill of {st['max_num_batched_tokens']} tokens, the default KV pool (0.9 of each "
         f"GPU), 64 GiB of host memory per instance for swap. SLO for goodput: {st['slo']} (ms; our choice, set "
         f"before any run). Seeds: {st['seeds']} (trace windows and draws).", ""]
    tr = res.get("trace")
    if tr:
        L += ["## A trace that changes regime", "",
              f"Phases of {st['phase_duration_s']:g} s each, in order: " + "; ".join(
                  f"**{ph}**: {st['sources'][ph]}" for ph in tr["phases"]) + ".", "",
              "Each phase's rate: " + tr["search"][tr["phases"][0]]["rule"] + " (KunServe Sec. 5.1's rule), searched "
              "on seed 0 with the phase alone: " + ", ".join(
                  f"{ph} {v['rate']:.3g} req/s (bracket {_x(v['bracket'][0])}-{_x(v['bracket'][1])})"
                  for ph, v in tr["search"].items())
              + f". A second level runs every phase at {st['sensitivity']}x those rates (a sensitivity, fixed "
              "before any run).", ""]
        for name in ("auto_timeline.png", "auto_phases.png", "auto_audit.png"):
            if name in fig:
                L += [f"![{name}]({fig[name]})", ""]
        for level, d in tr["levels"].items():
            L += [f"### {level}: " + ", ".join(f"{ph} {r:.3g}" for ph, r in d["rates"].items()) + " req/s", ""]
            L += _phase_table(d, tr["phases"]) + [""] + _claims(d["judged"]) + [""]
            L += _ablation_trace(d, st.get("systems", {}), st.get("ablations", {}))
            every = _schedules_trace(level, res.get("schedules"))
            L += _bound_trace(d, st.get("bounds", {}), bool(every)) + every
            L += _why_trace(d, st['instances'])
            a = d["runs"]["auto"]
            counts: dict[str, int] = {}
            for r in a:
                for k, v in (r.get("choice_counts") or {}).items():
                    counts[k] = counts.get(k, 0) + v
            L += [f"auto's choices over {len(a)} seeds: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                                                             or "none (no throttle onset)") + ".", ""]
            reasons = a[0].get("choice_reasons") or []
            if reasons:
                L += ["Its first reasons (seed 0): " + "; ".join(f"`{x}`" for x in reasons[:6]) + ".", ""]
            early = [drops_before_learning(r) for r in a]
            if any(x for x in early):
                L += ["Drops taken before any drop episode of auto's own had been served (so before its scale "
                      "could correct drop's prediction), per seed: " + _per_seed(early, lambda v: "-" if v is None else str(v)) + ". Each pairs two "
                      "instances into a pipeline group, which only KunServe's restore rule (Sec. 4.4: memory use "
                      "back under its threshold) undoes.", ""]
            audit = _audit_table(d)
            if len(audit) > 2:
                L += ["Predictions against what happened (`tidal.sim.auto_audit`): at every throttle onset, the "
                      "seconds predicted for the response the run used beside the seconds until the last request "
                      "waiting there had its first token. Recompute, swap and migrate runs are audited by a passive "
                      "predictor; auto's rows are its own choices (its drops are the only drop rows). A ratio above "
                      "1: the response took longer than predicted.", ""] + audit + [""]
    ks = res.get("kunserve")
    if ks:
        L += ["## KunServe's own setup", "",
              "`tidal bench sim-kunserve`'s datasets and bursty arrivals (Gamma, burstiness 0.5, the rate modulated "
              "per 20 s window), the default pool, each dataset's rate by the 60 % rule on recompute (seed 0). "
              "The claim: auto within 5 % of drop (KunServe) where drop beats recompute (vLLM), else within 5 % "
              "of recompute.", "",
              "| dataset | rate (req/s) | system | P99 TTFT (ms), per seed | P99 TPOT (ms) | lost | auto's choices |",
              "|---|---|---|---|---|---|---|"]
        for dname, v in ks.items():
            for s, rs in v["runs"].items():
                ch = _choices(rs) if s == "auto" else ""
                L.append(f"| {dname} | {v['rate']:.3g} | {s} | {_per_seed([r['ttft_p99_ms'] for r in rs])} | "
                         f"{_ms(_mean([r['tpot_p99_ms'] for r in rs]))} | {sum(r['lost'] for r in rs)} | {ch} |")
        L += ["", "| dataset | per seed (>= 0.95 meets the bar) | verdict |", "|---|---|---|"]
        for dname, v in ks.items():
            j = v["judged"]
            L.append(f"| {dname} | " + ", ".join("-" if s is None else f"{s['auto_vs']:.2f} vs {s['against']}"
                                                  for s in j["per_seed"]) + f" | **{j['verdict']}** |")
        for dname, v in ks.items():
            for a, j in (v.get("ablations") or {}).items():
                L.append(f"| {dname}, {st.get('systems', {}).get(a, a)} | " + ", ".join(
                    "-" if s is None else f"{s['auto_vs']:.2f} vs {s['against']}" for s in j["per_seed"])
                    + f" | {j['verdict']} |")
        L += [""] + kunserve_layouts(ks, st["instances"])
        L += [f"![kunserve]({fig['auto_kunserve.png']})", ""] if "auto_kunserve.png" in fig else []
    pg = res.get("pang")
    if pg:
        L += ["## Pang et al.'s own setup (`--batching auto`)", "",
              "`tidal bench sim-policies`' `pang-sla`: Llama-3-70B at TP 4 on an A100-80G, prompts of 256.6 "
              "tokens, outputs of 61.5 or 447.5, a 50 ms TPOT SLO; capacity = the highest rate with 90 % "
              "attainment. The claim: auto within 5 % of memory+sla (the paper's) where it beats the fixed cap "
              "(vLLM), else within 5 % of the fixed cap.", "",
              "| workload | policy | capacity (req/s), per seed | P99 TPOT at capacity (ms) |", "|---|---|---|---|"]
        for lab, v in pg.items():
            for p, rs in v["runs"].items():
                L.append(f"| {lab} | {p} | {_per_seed([r['capacity_rps'] for r in rs], _x)} | "
                         f"{_ms(_mean([r['tpot_p99_ms'] for r in rs]))} |")
        L += ["", "| workload | per seed | verdict |", "|---|---|---|"]
        for lab, v in pg.items():
            j = v["judged"]
            L.append(f"| {lab} | " + ", ".join("-" if s is None else f"{s['auto_vs']:.2f} vs {s['against']}"
                                                for s in j["per_seed"]) + f" | **{j['verdict']}** |")
        L.append("")
    real = res.get("real")
    if real:
        L += ["## The real engine", "", real["setup"], "",
              f"Tokens equal to one engine's, request by request: **{real['tokens_equal_one_engine']}** "
              f"({real['requests']} requests). Choices recorded (replayed from their records: "
              f"{real['replayed']}): " + "; ".join(f"t={c['time']:.2f} s instance {c['index']}: **{c['choice']}** "
                                                    f"({c['reason']})" for c in real["choices"])
              + f". Events: {real['events_total']}.", ""]
    L += ["## What this does not show", "",
          "- The code phase is synthetic (published statistics): the shared traces hold no code service.",
          "- Every system here uses the same dispatcher, `llumnix` (Llumnix's freeness); cache- or "
          "pressure-aware routing is not part of the choice.",
          "- The prediction leaves out what is off the queue's path: the stall of requests whose KV moves, a "
          "pipeline's longer decode steps (TPOT), a restore's weight load, and arrivals after the onset; the "
          "learned scales correct a response's predictions on average, not episode by episode, and a response "
          "auto has not taken yet only by the error of those it has.", ""]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(L))


def _choices(rs: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rs:
        for k, v in (r.get("choice_counts") or {}).items():
            counts[k] = counts.get(k, 0) + v
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


# ---------------------------------------------------------------- figures
def write_plots(res: dict[str, Any], out_dir: str) -> list[str]:
    plt = pyplot()
    files = []
    tr = res.get("trace")
    if tr:
        level = next(iter(tr["levels"]))
        d = tr["levels"][level]
        dur = res["setup"]["phase_duration_s"]
        fig, ax = plt.subplots(figsize=(11, 3.8))
        for k, ph in enumerate(tr["phases"]):
            ax.axvspan(k * dur, (k + 1) * dur, color=("#f2f2f2" if k % 2 else "#e6eef8"), zorder=0)
            ax.text((k + 0.5) * dur, res["setup"]["instances"] - 0.4, ph, ha="center", fontsize=9)
        shown = 0
        for tech, m in MARKERS.items():
            pts = [(t, i) for t, i, c in d["runs"]["auto"][0].get("choices", []) if c == tech]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=m, color=COLORS[tech], label=tech, zorder=2)
                shown += 1
        if not shown:
            ax.text(1.5 * dur, res["setup"]["instances"] / 2, "no throttle onset: no choice made", ha="center")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("instance")
        ax.set_ylim(-0.8, res["setup"]["instances"])
        if shown:
            ax.legend(loc="lower right", fontsize=8, ncol=4)
        files.append(save_figure(plt, fig, os.path.join(out_dir, "auto_timeline.png"),
                                 f"auto's choice at each throttle onset ({level}, seed 0)"))
        phases = [*tr["phases"], "whole"]
        fig, axes = plt.subplots(1, len(phases), figsize=(3.2 * len(phases), 3.6))
        for ax, ph in zip(axes, phases, strict=True):
            for k, (s, rs) in enumerate(d["runs"].items()):
                vals = [(r["phases"][ph] if ph != "whole" else r["whole"])["ttft_p99_ms"] for r in rs]
                vals = [v / 1000 for v in vals if v is not None]
                if vals:
                    ax.bar(k, float(np.mean(vals)), color=COLORS[s])
                    ax.scatter([k] * len(vals), vals, color="black", s=8, zorder=3)
            ax.set_xticks(range(len(d["runs"])), list(d["runs"]), rotation=35, ha="right", fontsize=8)
            ax.set_title(ph, fontsize=9)
            ax.set_ylabel("P99 TTFT (s)")
        files.append(save_figure(plt, fig, os.path.join(out_dir, "auto_phases.png"),
                                 f"P99 TTFT per phase ({level}; bars: mean, dots: seeds)"))
        pts: dict[str, list[tuple[float, float]]] = {}
        for rs in d["runs"].values():
            for r in rs:
                for _t, _i, resp, p, real in r.get("audit") or []:
                    if p and real:
                        pts.setdefault(resp, []).append((p, real))
        if pts:
            fig, ax = plt.subplots(figsize=(6.4, 4.8))
            for tech, xy in sorted(pts.items()):
                ax.scatter([x for x, _ in xy], [y for _, y in xy], s=10, alpha=0.6, color=COLORS[tech],
                           marker=MARKERS.get(tech, "o"), label=f"{tech} ({len(xy)})")
            lo = min(min(v) for xy in pts.values() for v in xy)
            hi = max(max(v) for xy in pts.values() for v in xy)
            ax.plot([lo, hi], [lo, hi], color="black", lw=0.8, ls="--")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("predicted (s)")
            ax.set_ylabel("realized: the queue's last first token (s)")
            ax.legend(fontsize=8)
            files.append(save_figure(plt, fig, os.path.join(out_dir, "auto_audit.png"),
                                     f"predicted vs realized ({level}; every seed and run)"))
    ks = res.get("kunserve")
    if ks:
        fig, axes = plt.subplots(1, len(ks), figsize=(3.6 * len(ks), 3.6), squeeze=False)
        for ax, (dname, v) in zip(axes[0], ks.items(), strict=True):
            for k, (s, rs) in enumerate(v["runs"].items()):
                vals = [r["ttft_p99_ms"] / 1000 for r in rs if r["ttft_p99_ms"] is not None]
                if vals:
                    ax.bar(k, float(np.mean(vals)), color=COLORS[s])
                    ax.scatter([k] * len(vals), vals, color="black", s=8, zorder=3)
            ax.set_xticks(range(len(v["runs"])), list(v["runs"]), rotation=35, ha="right", fontsize=8)
            ax.set_title(f"{dname} at {v['rate']:.3g} req/s", fontsize=9)
            ax.set_ylabel("P99 TTFT (s)")
        files.append(save_figure(plt, fig, os.path.join(out_dir, "auto_kunserve.png"),
                                 "KunServe's setup: P99 TTFT (bars: mean, dots: seeds)"))
    return files


__all__ = ["best_over", "readme_line", "summary_lines", "write_page", "write_plots"]
