"""The printed table and the PNG chart of ``tidal bench offline``."""

from __future__ import annotations

import os
from typing import Any

from tidal.bench.offline_systems import ALL_SYSTEMS


# ============================================================================ output
def _fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "-"
    return format(x, spec)


def format_report(report: dict[str, Any]) -> str:
    lines = []
    m = report["machine"]
    lines.append(f"command: {report['command']}")
    lines.append(f"machine: {m['cores']} cores ({m['cpu_model']}), torch {m['torch']}, {m['num_threads']} threads, "
                 f"dtype {m['dtype']}" + (f", transformers {m['transformers']}" if "transformers" in m else "")
                 + (f", llama_cpp {m['llama_cpp']}" if "llama_cpp" in m else ""))
    if m.get("isa"):
        used = f"; torch's kernels {m['torch_cpu_capability']}" if m.get("torch_cpu_capability") else ""
        limits = " ".join(f"{k}={v}" for k, v in m.get("isa_limits", {}).items())
        lines.append(f"         ISA: {' '.join(m['isa'])}{used}{f' (limited: {limits})' if limits else ''}; "
                     f"load average at start {m.get('loadavg')}")
    mod = report["model"]
    lines.append(f"model: {mod['path']} ({mod['architecture']}, {mod['num_params'] / 1e6:.1f}M params, "
                 f"{mod['linear_params'] / 1e6:.1f}M in matmuls incl. lm_head)")
    for name, s in report["systems"].items():
        if s["status"] != "ok":
            lines.append(f"  {name:11s} SKIPPED: {s['reason']}")
        else:
            st = ", ".join(f"{k}={v}" for k, v in s["settings"].items())
            lines.append(f"  {name:11s} loaded in {s['load_s']:.1f} s; {st}")
    for wname, w in report["workloads"].items():
        lines.append("")
        lines.append(f"workload {wname}: {w['description']} ({w['prompt_tokens']} prompt tokens, "
                     f"{w['expected_output_tokens']} output tokens)")
        hdr = (f"  {'system':12s}{'wall s':>9s}{'out tok/s':>11s}{'decode tok/s':>14s}{'decode est':>12s}"
               f"{'prefill s':>11s}{'tokens':>9s}{'=tidal':>9s}{'others':>8s}  notes")
        lines.append(hdr)
        for name, row in w["results"].items():
            if row["status"] == "failed":
                lines.append(f"  {name:12s} FAILED: {row['reason']}")
                continue
            match = "-"
            if "greedy_match_requests" in row:
                match = f"{row['greedy_match_requests']}/{w['num_requests']}"
            notes = report["systems"][name].get("notes", "")
            if row["status"] == "wrong_length":
                notes = f"WRONG LENGTH (expected {row['expected_output_tokens']}); " + notes
            if row.get("reason"):
                notes = row["reason"] + "; " + notes
            lines.append(f"  {name:12s}{_fmt(row['wall_s'], '.2f'):>9s}{_fmt(row['output_tok_s']):>11s}"
                         f"{_fmt(row.get('decode_tok_s')):>14s}{_fmt(row.get('decode_tok_s_est')):>12s}"
                         f"{_fmt(row.get('prefill_s'), '.2f'):>11s}{row['output_tokens']:>9d}{match:>9s}"
                         f"{_fmt(row.get('other_cores_median'), '.2f'):>8s}  {notes}")
    lines.append("")
    lines.append("columns: wall s = median wall time of a run; decode tok/s = tidal: its decode-only steps, peers: "
                 "= decode est; decode est = (output - 1/request) / (wall - prefill-only wall); =tidal = requests "
                 "whose greedy tokens equal tidal's; others = cores kept busy by other processes during the runs")
    busy = [row.get("other_cores_median") or 0.0 for w in report["workloads"].values()
            for row in w["results"].values()]
    if busy and max(busy) > 0.25:
        lines.append(f"WARNING: other processes used up to {max(busy):.2f} of {m['cores']} cores during the runs: "
                     "the timings are perturbed (with all cores in use, one busy neighbour can slow a run "
                     "several-fold)")
    lines.append("")
    lines.append("ratios, tidal / peer (output tok/s; decode est in brackets):")
    for wname, w in report["workloads"].items():
        r = w.get("ratios") or {}
        if not r.get("output_tok_s"):
            lines.append(f"  {wname}: - (no tidal row or no peer)")
            continue
        parts = []
        for peer, x in r["output_tok_s"].items():
            d = r["decode_tok_s_est"].get(peer)
            parts.append(f"tidal/{peer} {x:.2f}x" + (f" [{d:.2f}x]" if d else ""))
        if "best_peer" in r:  # none when every other system is a tidal variant (tidal-compile, tidal-float)
            parts.append(f"tidal/best peer ({r['best_peer']}) {r['tidal_over_best_peer']:.2f}x")
        lines.append(f"  {wname}: " + ";  ".join(parts))
    lines.append("")
    pk = report.get("peak")
    if pk:
        lines.append(f"matmul peak ({pk['dtype']}, {m['num_threads']} threads; median of {pk['samples']}, the better of "
                     f"{len(pk.get('runs', [])) or 1} measurements): square "
                     f"{'x'.join(map(str, pk['square']['shape']))} {pk['square']['gflops']:.1f} GFLOP/s; skinny "
                     f"{'x'.join(map(str, pk['skinny']['shape']))} (x @ W^T) {pk['skinny']['gflops']:.1f} GFLOP/s")
        for r in pk.get("runs", []):
            oc = r.get("other_cores")
            lines.append(f"  measured {r['when']}: square {r['square']['gflops']:.1f}, skinny "
                         f"{r['skinny']['gflops']:.1f} GFLOP/s"
                         + (f" (other processes: {oc:.2f} cores)" if oc is not None else ""))
    pf = report.get("peak_fraction", {})
    if pf.get("status") == "ok":
        lines.append(f"tidal decode step at batch {pf['batch']} (workload b): median {pf['median_step_s'] * 1e3:.2f} ms "
                     f"over {pf['num_steps']} steps, mean context {pf['mean_context']:.0f}, "
                     f"{pf['flops_per_step'] / 1e9:.2f} GFLOP/step -> {pf['gflops']:.1f} GFLOP/s = "
                     f"{100 * pf['fraction_of_square_peak']:.1f}% of the square-matmul peak, "
                     f"{100 * pf['fraction_of_skinny_peak']:.1f}% of the skinny-matmul peak (a step also runs "
                     f"the wide lm_head matmul, so it can beat the skinny shape)")
    else:
        lines.append(f"peak fraction: {pf.get('status', 'skipped')} ({pf.get('reason', '')})")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wnames = list(report["workloads"])
    systems = [s for s in ALL_SYSTEMS if any(
        report["workloads"][w]["results"].get(s, {}).get("output_tok_s") for w in wnames)]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(wnames) + 2), 4.5))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        vals = [report["workloads"][w]["results"].get(s, {}).get("output_tok_s") or 0.0 for w in wnames]
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(wnames))]
        bars = ax.bar(xs, vals, width, label=s)
        for b, v in zip(bars, vals, strict=True):
            if v:
                ax.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(wnames)))
    ax.set_xticklabels([f"{w}: {report['workloads'][w]['num_requests']} req" for w in wnames])
    ax.set_ylabel("output tokens / s")
    m = report["machine"]
    ax.set_title(f"offline throughput, {report['model'].get('name') or 'model'}, {m['dtype']}, "
                 f"{m['num_threads']} threads", fontsize=10)
    ax.legend()
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
