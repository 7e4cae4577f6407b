"""PNG plots of a ``tidal sim`` result: latency CDFs and attainment vs rate (the bench's own
plots) and per-instance timelines of KV use, queue length and batch size."""

from __future__ import annotations

import os
from typing import Any

from tidal.common import plots as BP

MAX_LINES = 8  # instances drawn one by one; beyond that the mean and the max are drawn


def plot_instance_timelines(timelines: list[dict[str, Any]], path: str, title: str = "") -> str:
    plt = BP.pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    panels = (("kv_usage", "KV cache used (%)", 100.0), ("waiting", "queue length (requests)", 1.0),
              ("batch_size", "batch size (requests in step)", 1.0))
    for ax, (key, label, scale) in zip(axes, panels, strict=True):
        if len(timelines) <= MAX_LINES:
            for i, tl in enumerate(timelines):
                ax.plot(tl["t"], [v * scale for v in tl[key]], linewidth=0.8, label=f"instance {i}")
        else:
            import numpy as np

            grid = np.linspace(0, max((tl["t"][-1] for tl in timelines if tl["t"]), default=1.0), 500)
            vals = np.array([np.interp(grid, tl["t"], tl[key]) if tl["t"] else np.zeros_like(grid)
                             for tl in timelines]) * scale
            ax.plot(grid, vals.mean(axis=0), label=f"mean of {len(timelines)} instances")
            ax.plot(grid, vals.max(axis=0), linewidth=0.7, label="max")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=7, ncol=2)
    axes[-1].set_xlabel("simulated time (s)")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_sim_plots(result: dict[str, Any], json_path: str) -> list[str]:
    stem = os.path.splitext(json_path)[0]
    title = (f"{result['model']} on {result['instances']} x {result['hardware']}, {result['batching']} "
             f"(simulated)")
    records, slo = BP.records_of(result), BP.slo_of(result)
    out = [BP.plot_cdfs(records, slo, f"{stem}_cdf.png", title),
           plot_instance_timelines(result["timelines"], f"{stem}_instances.png", title)]
    if result.get("capacity_search"):
        out.append(BP.plot_capacity(result["capacity_search"], f"{stem}_capacity.png", title))
    return out
