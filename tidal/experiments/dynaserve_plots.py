"""The figures of DynaServe's runs beyond the grid: where the sequences go, Fig. 10 and Fig. 11."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def plot_extra(extra: dict[str, Any], out_dir: str) -> list[str]:
    from tidal.common.plots import pyplot

    plt = pyplot()
    files = []
    ab = extra.get("alpha_beta")
    if ab:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        keys = list(ab[0]["runs"])
        w = 0.8 / (2 * len(ab))
        for k, d in enumerate(ab):
            for j in range(2):
                ax.bar(np.arange(len(keys)) + (2 * k + j) * w, [d["runs"][key]["mean_running"][j] for key in keys], w,
                       color="tab:red" if j == 0 else "tab:blue", alpha=1.0 - 0.25 * k,
                       label=f"instance {j} (seed {d['seed']})")
        ax.set_xticks(np.arange(len(keys)) + 0.4 - w / 2, keys, fontsize=8)
        ax.set_ylabel("mean running sequences")
        ax.set_title("Mini Reasoning (14B) at fixed roles' capacity: instance 0 is every request's alpha with "
                     "fixed roles", fontsize=8)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        files.append("dynaserve_alpha_beta.png")
        fig.savefig(os.path.join(out_dir, files[-1]), dpi=100)
        plt.close(fig)
    f10 = extra.get("fig10")
    if f10:
        wins = f10["windows"]
        step = f10.get("interval_s", 360.0) / 60
        fig, axes = plt.subplots(1, len(wins), figsize=(4.5 * len(wins), 3.6), squeeze=False)
        for ax, win in zip(axes[0], wins, strict=True):
            for name in (f10["coloc"], "disagg", f10["headline"]):
                per = win["systems"][name]["goodput_per_interval"]
                ax.plot([step * (i + 1) for i in range(len(per))], per, marker="o", label=name,
                        linewidth=1.8 if name == f10["headline"] else 1.0)
            ax2 = ax.twinx()
            ax2.bar([step * (i + 1) for i in range(len(win["input_per_interval"]))], win["input_per_interval"],
                    width=0.6 * step, color="gray", alpha=0.15)
            ax2.set_ylabel("mean prompt (tokens)", fontsize=7)
            ax.set_xlabel("minute")
            ax.set_ylabel("goodput (tok/s)")
            ax.set_title(f"window from minute {win['start_s'] / 60:g}", fontsize=9)
            ax.legend(fontsize=7)
        fig.suptitle(f"Fig. 10: real-time replay ({f10['trace']}), 14B, goodput every {step:g} minutes", fontsize=9)
        fig.tight_layout()
        files.append("dynaserve_fig10.png")
        fig.savefig(os.path.join(out_dir, files[-1]), dpi=100)
        plt.close(fig)
    f11 = extra.get("fig11")
    if f11:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        xs = f11["cdf_ms"]
        for s in f11["seeds"]:
            ax.plot(xs, s["with"]["cdf"], color="tab:red", alpha=0.8, label=f"with SLO-aware (seed {s['seed']})")
            ax.plot(xs, s["without"]["cdf"], color="tab:gray", alpha=0.8, ls="--", label=f"without (seed {s['seed']})")
        ax.axvline(100, color="k", lw=0.8, ls=":")
        ax.set_xlabel("TBT (ms)")
        ax.set_ylabel("CDF of gaps between tokens")
        ax.set_title(f"Fig. 11: SLO-aware batching, 14B {f11['workload']} at DynaServe's capacity", fontsize=9)
        ax.legend(fontsize=6)
        fig.tight_layout()
        files.append("dynaserve_fig11.png")
        fig.savefig(os.path.join(out_dir, files[-1]), dpi=100)
        plt.close(fig)
    return files
