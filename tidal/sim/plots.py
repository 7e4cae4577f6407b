"""PNG plots of a ``tidal sim`` result: latency CDFs and attainment vs rate (the bench's own
plots), per-instance timelines of KV use, queue length and batch size (labelled by role);
disaggregated, the hand-offs: pending and in flight over time, and the CDF of their times; split,
each request's split ratio over time and the planner's predicted load per instance; with
``--kv-pressure``, its events (throttles, migrations, drops, exchanges, restores) on the timelines."""

from __future__ import annotations

import os
from typing import Any

from tidal.common import plots as BP

MAX_LINES = 8  # instances drawn one by one; beyond that the mean and the max are drawn


# --kv-pressure events: a line on every panel, or a tick at the top of the KV panel (frequent kinds)
EVENT_LINES = {"drop": ("tab:red", "--"), "exchange-done": ("tab:red", ":"), "restore": ("tab:green", "--"),
               "restore-done": ("tab:green", ":"), "autoscale": ("black", "-.")}
EVENT_TICKS = {"throttle": ("tab:orange", 1.0), "migrate": ("tab:purple", 0.95)}


def mark_events(axes: Any, events: list[dict[str, Any]]) -> None:
    """Drop / exchange / restore / autoscale as vertical lines; throttles and migrations as ticks."""
    seen: set[str] = set()
    for e in events:
        kind, t = e["kind"], e["time"]
        if kind in EVENT_LINES:
            color, style = EVENT_LINES[kind]
            for ax in axes:
                ax.axvline(t, color=color, linestyle=style, linewidth=0.9, alpha=0.8,
                           label=None if kind in seen or ax is not axes[0] else kind)
            seen.add(kind)
        elif kind in EVENT_TICKS:
            color, y = EVENT_TICKS[kind]
            axes[0].plot([t], [y], marker="|", color=color, markersize=9, transform=axes[0].get_xaxis_transform(),
                         linestyle="none", label=None if kind in seen else kind)
            seen.add(kind)


def plot_instance_timelines(timelines: list[dict[str, Any]], path: str, title: str = "",
                            events: list[dict[str, Any]] | None = None) -> str:
    plt = BP.pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    panels = (("kv_usage", "KV cache used (%)", 100.0), ("waiting", "queue length (requests)", 1.0),
              ("batch_size", "batch size (requests in step)", 1.0))
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        if len(timelines) <= MAX_LINES:
            for i, tl in enumerate(timelines):
                role = tl.get("role", "colocated")
                name = f"instance {i}" + ("" if role == "colocated" else f" ({role})")
                ax.plot(tl["t"], [v * scale for v in tl[key]], linewidth=0.8, label=name,
                        linestyle="--" if role == "prefill" else "-")
        else:
            import numpy as np

            grid = np.linspace(0, max((tl["t"][-1] for tl in timelines if tl["t"]), default=1.0), 500)
            vals = np.array([np.interp(grid, tl["t"], tl[key]) if tl["t"] else np.zeros_like(grid)
                             for tl in timelines]) * scale
            ax.plot(grid, vals.mean(axis=0), label=f"mean of {len(timelines)} instances")
            ax.plot(grid, vals.max(axis=0), linewidth=0.7, label="max")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if events:
        mark_events(axes, events)
    axes[0].legend(loc="upper right", fontsize=7, ncol=2)
    axes[-1].set_xlabel("simulated time (s)")
    if title:
        axes[0].set_title(title)
    return BP.save_figure(plt, fig, path)


def plot_handoffs(result: dict[str, Any], path: str, title: str = "") -> str:
    """Hand-offs pending (no decode instance with room) and in flight over time, and the CDF of
    each hand-off's wait, transfer and first-token-to-landing times."""
    import numpy as np

    plt = BP.pyplot()
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(13, 3.8))
    tl = result.get("handoff_timeline") or {}
    if tl.get("t"):
        a0.step(tl["t"], tl["pending"], where="post", label="pending")
        a0.step(tl["t"], tl["in_flight"], where="post", label="in flight")
    a0.set_xlabel("simulated time (s)")
    a0.set_ylabel("hand-offs")
    a0.legend(loc="upper right")
    a0.grid(alpha=0.3)
    reqs = [r for r in result.get("requests", []) if r.get("handoff_ms") is not None]
    xs = np.sort(np.asarray([r["handoff_ms"] for r in reqs], dtype=float))
    if xs.size:
        a1.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label="first token to landing")
        if xs[0] > 0 and xs[-1] / xs[0] > 100:
            a1.set_xscale("log")
    a1.set_xlabel("ms")
    a1.set_ylabel("fraction of hand-offs")
    a1.set_ylim(0, 1.02)
    a1.grid(alpha=0.3)
    a1.legend(loc="lower right")
    h = result.get("handoffs") or {}
    a1.set_title(f"{h.get('landed', 0)} hand-offs, transfer p50 "
                 f"{(h.get('transfer_ms') or {}).get('p50') or 0:.2f} ms on {result.get('link', {}).get('name', '?')}")
    return BP.save_figure(plt, fig, path, title)


def plot_splits(result: dict[str, Any], path: str, title: str = "") -> str:
    """DynaServe's splits: each request's split ratio phi = s / L over its arrival time, with its
    P/D point P / L beside it (above it: alpha also decodes; below: beta also prefills), and the
    planner's predicted load of every instance (the time to finish its ledger) at each decision."""
    plt = BP.pyplot()
    fig, (a0, a1) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    reqs = [r for r in result.get("requests", []) if r.get("split") is not None]
    t = [r["send_s"] for r in reqs]
    a0.scatter(t, [r["phi"] for r in reqs], s=6, label="split phi = s / L", color="tab:blue")
    a0.scatter(t, [r["prompt_len"] / (r["prompt_len"] + r["predicted_output"]) for r in reqs], s=4, marker="_",
               color="tab:gray", label="P / L (P/D disaggregation)")
    a0.set_ylabel("split ratio")
    a0.set_ylim(-0.02, 1.02)
    a0.grid(alpha=0.3)
    a0.legend(loc="lower right", fontsize=8)
    sp = result.get("splits") or {}
    a0.set_title(f"{sp.get('inside_prompt', 0)} inside the prompt, {sp.get('at_prompt_end', 0)} at its end, "
                 f"{sp.get('inside_output', 0)} inside the output, {sp.get('whole_on_alpha', 0)} whole on alpha, "
                 f"{sp.get('whole_on_beta', 0)} whole on beta", fontsize=9)
    load = result.get("split_load") or {}
    for inst in sorted(set(load.get("instance", []))):
        pts = [(tt, v) for tt, i, v in zip(load["t"], load["instance"], load["load_s"], strict=True) if i == inst]
        a1.plot([x for x, _ in pts], [y for _, y in pts], linewidth=0.8,
                label=f"instance {inst} ({'alpha' if inst % 2 == 0 else 'beta'})")
    a1.set_ylabel("predicted time to finish its work (s)")
    a1.set_xlabel("simulated time (s)")
    a1.grid(alpha=0.3)
    a1.legend(loc="upper right", fontsize=8)
    return BP.save_figure(plt, fig, path, title)


def write_sim_plots(result: dict[str, Any], json_path: str) -> list[str]:
    stem = os.path.splitext(json_path)[0]
    setup = result["batching"]
    if result.get("mode") == "split":
        setup = f"split on {result['instances'] // 2} pair(s) ({result['batching']})"
    if result.get("mode") == "disaggregate":
        setup = (f"{result['prefill_instances']}P ({result.get('prefill_batching')}) + "
                 f"{result['instances'] - result['prefill_instances']}D ({result['batching']})")
    if result.get("kv_pressure"):
        setup += f", --kv-pressure {result['kv_pressure']['mode']}"
    title = f"{result['model']} on {result['instances']} x {result['hardware']}, {setup} (simulated)"
    records, slo = BP.records_of(result), BP.slo_of(result)
    out = [BP.plot_cdfs(records, slo, f"{stem}_cdf.png", title),
           plot_instance_timelines(result["timelines"], f"{stem}_instances.png", title,
                                   (result.get("kv_pressure") or {}).get("events"))]
    if result.get("handoffs"):
        out.append(plot_handoffs(result, f"{stem}_handoffs.png", title))
    if result.get("splits"):
        out.append(plot_splits(result, f"{stem}_splits.png", title))
    if result.get("capacity_search"):
        out.append(BP.plot_capacity(result["capacity_search"], f"{stem}_capacity.png", title))
    return out
