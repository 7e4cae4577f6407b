"""The PNGs of ``tidal bench sim-kunserve`` (each shaped like the paper's figure it stands for):

- ``STEM.png``: per dataset, P50 / P99 TTFT and TPOT of every system (medians over the seeds, the
  bars' whiskers their range; Fig. 13's first columns) and seed 0's TTFT over time with KunServe's
  drops and restores (Fig. 12's second column);
- ``STEM_search.png``: the 60 % rule's search (vLLM's time-mean KV demand against the rate, the
  compute capacity beside it);
- ``STEM_slo.png``: SLO violations against the scale factor (Fig. 13's last column), mean over seeds;
- ``STEM_pipeline_fit.png``: the bubbles against the stage gap, the paper's measurements, the fit;
- ``STEM_extreme.png``: Fig. 16: KV demand and TTFT over time under the replayed burst, each
  system's memory limit;
- ``STEM_DATASET_SYSTEM_instances.png``: seed 0's per-instance timelines of each headline system.

:func:`plot_real` draws the real column (``kunserve_real.png``, written by ``tidal reproduce kunserve``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tidal.experiments import kunserve_timelines as TL
from tidal.experiments.kunserve_runs import BASELINES, DROP, VLLM


def _short(label: str) -> str:
    return label.split(" (")[0].replace("KunServe + group-queue dispatch", "KunServe+group").replace(
        "KunServe, pipeline cost calibrated", "KunServe calib.")


def plots(report: dict[str, Any], json_path: str) -> list[str]:
    from tidal.common.plots import pyplot

    plt = pyplot()
    stem = os.path.splitext(json_path)[0]
    out = [_latency(plt, report, stem)]
    for fn in (_search, _slo, _fit, _extreme):
        p = fn(plt, report, stem)
        if p:
            out.append(p)
    head = {ds: {"systems": {x: r for x, r in runs.items() if x in (*BASELINES, DROP)}}
            for ds, runs in report["_seed0"].items()}
    return out + TL.plot_all_instances({"datasets": head}, stem)


def _latency(plt: Any, report: dict[str, Any], stem: str) -> str:
    from tidal.sim.plots import mark_events

    dss = list(report["datasets"])
    fig, axes = plt.subplots(3, len(dss), figsize=(6.5 * len(dss), 11), squeeze=False)
    for j, ds in enumerate(dss):
        d = report["datasets"][ds]
        labels = list(d["systems"])
        x = np.arange(len(labels))
        for row, metric in ((0, "ttft_ms"), (1, "tpot_ms")):
            ax = axes[row][j]
            for k, (p, off) in enumerate((("p50", -0.2), ("p99", 0.2))):
                vals = [[r[metric][p] or 0 for r in d["systems"][lb]["per_seed"]] for lb in labels]
                med = [float(np.median(v)) for v in vals]
                err = [[m - min(v) for m, v in zip(med, vals, strict=True)],
                       [max(v) - m for m, v in zip(med, vals, strict=True)]]
                ax.bar(x + off, med, 0.4, yerr=err, capsize=2, label=p.upper(), color=f"C{k}")
            ax.set_yscale("log")
            ax.set_xticks(x, [_short(lb) for lb in labels], rotation=25, fontsize=7, ha="right")
            ax.set_ylabel(f"{metric[:4].upper()} (ms)")
            ax.set_title(f"{ds}: {d['rate']:.3g} req/s mean, seeds {d['seeds']}", fontsize=9)
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3, axis="y")
        ax = axes[2][j]  # Fig. 12's second column: TTFT over time, with KunServe's events (seed 0)
        runs = report["_seed0"][ds]
        w = 1
        for label, r in runs.items():
            s = np.asarray(r["ttft_series"])
            if len(s):
                w = max(1, len(s) // 100)
                ax.plot(s[w - 1:, 0], np.convolve(s[:, 1] * 1000, np.ones(w) / w, "valid"), linewidth=0.9,
                        label=_short(label))
        ax.set_yscale("log")
        ax.set_xlabel("arrival (s)")
        ax.set_ylabel(f"TTFT (ms), mean of {w} arrivals, seed {d['seeds'][0]}")
        if DROP in runs:
            mark_events([ax], [e for e in runs[DROP]["events"] if e["kind"] in ("drop", "restore")])
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    s = report["setup"]
    fig.suptitle(f"{s['model']} on {s['instances']} x {s['tp']} {s['hardware']}, {s['link']}: TTFT and TPOT under KV "
                 "pressure (simulated)")
    fig.tight_layout()
    png = f"{stem}.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def _search(plt: Any, report: dict[str, Any], stem: str) -> str | None:
    dss = [ds for ds, d in report["datasets"].items() if d["regime"].get("search")]
    if not dss:
        return None
    fig, axes = plt.subplots(1, len(dss), figsize=(5 * len(dss), 4), squeeze=False)
    for ax, ds in zip(axes[0], dss, strict=True):
        g = report["datasets"][ds]["regime"]
        pr = g["search"]["probes"]
        ax.plot([p["rate"] for p in pr], [p["mean_kv_demand"] for p in pr], "o-", label="vLLM mean KV demand (seeds' mean)")
        ax.plot([p["rate"] for p in pr], [p["mean_kv_use"] for p in pr], "s--", label="... of which in use", alpha=0.7)
        for p in pr:
            ax.plot([p["rate"]] * len(p["per_seed"]), p["per_seed"], ".", color="gray", alpha=0.6)
        ax.axhline(g["search"]["share"], color="black", linestyle=":", label=f"{g['search']['share']:.0%} rule")
        ax.axvline(g["capacity"]["capacity"], color="tab:red", linestyle="--", label="compute capacity")
        ax.axvline(g["rate"], color="tab:green", linestyle="-", label="chosen rate")
        ax.set_xlabel("mean rate (req/s)")
        ax.set_ylabel("KV demand / pool")
        ax.set_title(f"{ds}: {g['rate']:.3g} req/s = {g['rate_over_capacity']:.0%} of capacity", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = f"{stem}_search.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def _slo(plt: Any, report: dict[str, Any], stem: str) -> str | None:
    dss = [ds for ds, d in report["datasets"].items() if d.get("slo")]
    if not dss:
        return None
    fig, axes = plt.subplots(1, len(dss), figsize=(5 * len(dss), 4), squeeze=False)
    for ax, ds in zip(axes[0], dss, strict=True):
        per = report["datasets"][ds]["slo"]["per_seed"]
        for name in per[0]["systems"]:
            v = np.mean([c["systems"][name]["violation"] for c in per], axis=0)
            ax.plot(per[0]["scales"], v * 100, "o-", markersize=3, label=_short(name))
        ax.set_xlabel("SLO scale (x the best baseline's P50 TTFT and TPOT)")
        ax.set_ylabel("SLO violation (%), mean over seeds")
        ax.set_title(ds)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png = f"{stem}_slo.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def _fit(plt: Any, report: dict[str, Any], stem: str) -> str | None:
    fit = report.get("pipeline_fit")
    if not fit or not fit.get("grid"):
        return None
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for k, (cfg, pts) in enumerate(fit["grid"].items()):
        pts = [(g, b) for g, b in pts if b is not None]
        ax.plot([g * 1000 for g, _ in pts], [b * 100 for _, b in pts], "o-", color=f"C{k}", label=f"simulated, {cfg}")
        ax.axhline(fit["targets"][cfg] * 100, color=f"C{k}", linestyle=":", label=f"paper, {cfg}")
    if fit.get("gap_s") is not None:
        ax.axvline(fit["gap_s"] * 1000, color="black", linestyle="--", label="fitted gap")
    ax.set_xlabel("stage gap per microbatch (ms)")
    ax.set_ylabel("pipeline bubbles (%)")
    ax.set_title(f"{fit['dataset']}, seed {fit['seed']}: bubbles vs the stage gap (Sec. 5.3)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = f"{stem}_pipeline_fit.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def _extreme(plt: Any, report: dict[str, Any], stem: str) -> str | None:
    ex = report.get("extreme_burst")
    if not ex:
        return None
    seed, runs = next(iter(ex["_runs"].items()))
    e = next(x for x in ex["per_seed"] if x["seed"] == seed)
    fig, axes = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for k, (label, limit) in enumerate(((VLLM, e["vllm_limit_s"]), (DROP, e["drop_limit_s"]))):
        r = runs[label]
        tls = [tl for tl in r["timelines"] if len(tl["t"])]
        grid = np.linspace(0, max(tl["t"][-1] for tl in tls), 600)
        dem = np.mean([np.interp(grid, tl["t"], tl["kv_demand"]) for tl in tls], axis=0)
        axes[0].plot(grid, dem, color=f"C{k}", label=_short(label))
        s = np.asarray(r["ttft_series"])
        if len(s):
            axes[1].plot(s[:, 0], s[:, 1], ".", markersize=2, color=f"C{k}", label=_short(label))
        if limit is not None:
            for ax in axes:
                ax.axvline(limit, color=f"C{k}", linestyle="--")
    for ax in axes:
        ax.axvline(e["burst_start_s"], color="black", linestyle=":", label="burst replayed from here")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("KV demand / pool (mean of instances)")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("time (s); dashed: out of memory")
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"extreme burst (Fig. 16), {ex['dataset']}, seed {seed}", fontsize=9)
    fig.tight_layout()
    png = f"{stem}_extreme.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def plot_real(real: dict[str, Any], path: str) -> str:
    """The real column drawn: per system its P99 TTFT and P50 TPOT on each seed (dots) and their
    median (bar), from a ``kunserve_real.json`` record (2 CPU instances, paired seeds)."""
    from tidal.common.plots import pyplot, save_figure
    from tidal.experiments.kunserve_real import SYSTEMS, by_system

    plt = pyplot()
    seeds, rows = by_system(real)
    labels = [name for name, _ in SYSTEMS.values() if name in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, title) in zip(axes, (("ttft_p99_ms", "P99 TTFT (ms)"), ("tpot_p50_ms", "P50 TPOT (ms)")), strict=True):
        for i, lb in enumerate(labels):
            vals = [r[key] for r in rows[lb]]
            ax.bar(i, float(np.median(vals)), color="tab:red" if lb == DROP else "tab:gray", alpha=0.6)
            ax.scatter([i] * len(vals), vals, color="black", s=14, zorder=3)
        ax.set_xticks(range(len(labels)), [_short(lb) for lb in labels], rotation=15, fontsize=8)
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    return save_figure(plt, fig, path, f"KunServe's real column: 2 CPU instances, seeds "
                                       f"{', '.join(map(str, seeds))} (bars: median, dots: each seed)")


__all__ = ["plot_real", "plots"]
