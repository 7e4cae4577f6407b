"""PNG plots of a serving result (``tidal bench serve``, ``tidal sim``) (matplotlib, Agg backend).

* ``<stem>_cdf.png``: CDFs of TTFT, TPOT and E2E latency, with the SLO as a vertical line;
* ``<stem>_timeline.png``: TTFT of every request at its send time (attaining / missing / failed)
  above the number of requests in flight over time;
* ``<stem>_capacity.png`` (capacity search only): SLO attainment of every probe against its rate,
  with the target and the capacity found;
* ``<stem>_placement.png`` (a tidal cluster that logs placements, e.g. ``--mode split``): where each
  request was split against its prompt length, and each instance's share of the work.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from tidal import metrics as M


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: str, title: str = "") -> str:
    """Give ``fig`` its title (if any), lay it out, write it to ``path`` at 100 dpi, close it."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def records_of(result: dict[str, Any]) -> list[M.RequestRecord]:
    return [M.RequestRecord.from_dict(d) for d in result.get("requests", [])]


def slo_of(result: dict[str, Any]) -> M.SLO:
    s = result.get("slo") or {}
    return M.SLO(*(s[k] / 1000.0 if k in s else None for k in ("ttft", "tpot", "e2e")))


def plot_cdfs(records: list[M.RequestRecord], slo: M.SLO, path: str, title: str = "") -> str:
    plt = pyplot()
    ok = [r for r in records if r.success]
    series = [("TTFT", [r.ttft_s for r in ok], slo.ttft_s), ("TPOT", [M.tpot(r) for r in ok], slo.tpot_s),
              ("E2E latency", [r.e2e_s for r in ok], slo.e2e_s)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, vals, limit) in zip(axes, series, strict=True):
        xs = np.sort(np.asarray([v * 1000 for v in vals if v is not None], dtype=float))
        if xs.size:
            ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
        if limit is not None:
            ax.axvline(limit * 1000, color="red", linestyle="--", label=f"SLO {limit * 1000:g} ms")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} CDF ({xs.size} requests)")
    return save_figure(plt, fig, path, title)


def plot_timeline(records: list[M.RequestRecord], slo: M.SLO, path: str, title: str = "") -> str:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    groups = {"attains SLO": ([], [], "tab:green"), "misses SLO": ([], [], "tab:orange"),
              "failed": ([], [], "tab:red")}
    for r in records:
        if r.send_s is None:
            continue
        if not r.success:
            key, y = "failed", (r.ttft_s if r.ttft_s is not None else (r.end_s or r.send_s) - r.send_s)
        else:
            key, y = ("attains SLO" if M.attains(r, slo) else "misses SLO"), r.ttft_s
        groups[key][0].append(r.send_s)
        groups[key][1].append((y or 0.0) * 1000)
    for label, (xs, ys, color) in groups.items():
        if xs:
            ax1.scatter(xs, ys, s=10, color=color, label=f"{label} ({len(xs)})")
    if slo.ttft_s is not None:
        ax1.axhline(slo.ttft_s * 1000, color="red", linestyle="--", linewidth=1, label="TTFT SLO")
    ax1.set_ylabel("TTFT (ms)")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8)
    times, counts = M.in_flight_series(records)
    ax2.step(times, counts, where="post", color="tab:blue")
    ax2.set_ylabel("requests in flight")
    ax2.set_xlabel("time since start (s)")
    ax2.grid(alpha=0.3)
    if title:
        ax1.set_title(title)
    return save_figure(plt, fig, path)


def plot_capacity(search: dict[str, Any], path: str, title: str = "") -> str:
    plt = pyplot()
    probes = sorted(search["probes"], key=lambda p: p["rate"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rates = [p["rate"] for p in probes]
    att = [100 * p["attainment"] for p in probes]
    ax.plot(rates, att, marker="o")
    for p in probes:
        ax.annotate("pass" if p["passed"] else "fail", (p["rate"], 100 * p["attainment"]), fontsize=7,
                    textcoords="offset points", xytext=(0, 6), ha="center")
    ax.axhline(100 * search["target_attainment"], color="red", linestyle="--",
               label=f"target {search['target_attainment']:.0%}")
    if search.get("capacity_rps") is not None:
        ax.axvline(search["capacity_rps"], color="green", linestyle=":",
                   label=f"capacity {search['capacity_rps']:.3g} req/s")
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower left")
    ax.set_title(title or "SLO attainment vs request rate")
    return save_figure(plt, fig, path)


def plot_placements(records: list[M.RequestRecord], instances: list[dict[str, Any]] | None, path: str,
                    title: str = "") -> str:
    """DynaServe's placements: each request's split point ``s`` against its prompt length (split
    requests by pair; ``s = P`` is pure disaggregation, above it alpha also decoded), the requests
    that ran whole, and per instance the requests dispatched to it and the hand-offs it received."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    placed = [(r, r.placement) for r in records if r.placement]
    pairs = sorted({tuple(p["pair"]) for _, p in placed if p.get("whole_on") is None})
    for pair in pairs:
        pts = [(p["prompt_len"], p["split"]) for _, p in placed if p.get("whole_on") is None and tuple(p["pair"]) == pair]
        ax1.scatter(*zip(*pts, strict=True), s=12, label=f"split on pair {pair[0]}-{pair[1]} ({len(pts)})")
    whole = [(p["prompt_len"], p["split"]) for _, p in placed if p.get("whole_on") is not None]
    if whole:
        ax1.scatter(*zip(*whole, strict=True), s=12, marker="x", color="grey", label=f"ran whole ({len(whole)})")
    if placed:
        top = max(p["prompt_len"] for _, p in placed)
        ax1.plot([0, top], [0, top], color="black", linewidth=0.8, linestyle=":", label="s = prompt length")
    ax1.set_xlabel("prompt length P (tokens)")
    ax1.set_ylabel("split point s (tokens of KV alpha computes)")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title("where requests split")
    inst = sorted(instances or [], key=lambda i: i["index"])
    xs = np.arange(len(inst))
    ax2.bar(xs - 0.2, [i.get("dispatched", 0) for i in inst], 0.4, label="requests dispatched (alpha or whole)")
    ax2.bar(xs + 0.2, [i.get("handoffs_in", 0) for i in inst], 0.4, label="hand-offs received (beta)")
    ax2.set_xticks(xs, [f"{i['index']} ({i.get('role') or '?'})" for i in inst])
    ax2.set_xlabel("instance")
    ax2.set_ylabel("requests")
    ax2.grid(alpha=0.3, axis="y")
    ax2.legend(fontsize=8)
    ax2.set_title("per-instance load")
    return save_figure(plt, fig, path, title)


def write_plots(result: dict[str, Any], json_path: str) -> list[str]:
    """All plots of a result, next to ``json_path``; returns the paths written."""
    stem = os.path.splitext(json_path)[0]
    records, slo = records_of(result), slo_of(result)
    title = f"{result.get('model', '')} - {result.get('workload', {}).get('name', '')}"
    out = [plot_cdfs(records, slo, f"{stem}_cdf.png", title),
           plot_timeline(records, slo, f"{stem}_timeline.png", title)]
    if result.get("capacity_search"):
        out.append(plot_capacity(result["capacity_search"], f"{stem}_capacity.png"))
    if any(r.placement for r in records):
        out.append(plot_placements(records, result.get("instances"), f"{stem}_placement.png", title))
    return out


__all__ = ["plot_capacity", "plot_cdfs", "plot_placements", "plot_timeline", "pyplot", "records_of", "save_figure", "slo_of", "write_plots"]
