"""The performance page's record of a GPU check (``benchmarks/gpu_check.py --record`` / ``--summarize``):
the rows ``tidal bench report`` shows, made from the check's report (``gpu_check.json``)."""

from __future__ import annotations

import json


def figures(report: dict) -> list[list[str]]:
    """The performance page's rows (``tidal bench report``'s ``figures`` record) from a check's report."""
    rows: list[list[str]] = []

    def res(stage: str, tree: str | None = None) -> dict:
        entry = report.get(stage) or {}
        entry = entry.get(tree) or {} if tree else entry
        return entry.get("result") or {}

    def commit(r: dict) -> str:
        return (r.get("tree") or {}).get("commit") or "?"

    k = res("kernels")
    if k.get("copy_tb_s"):
        rows.append(["device-to-device copy (read + write)", f"{k['copy_tb_s']:.2f} TB/s"])
    for key, r in k.items():
        if not key.startswith("tokens"):
            continue
        t = key.removeprefix("tokens")
        plural = "" if t == "1" else "s"
        fused = [f"{name} {r[name]['fused_us']:.1f} us (torch's ops {r[name]['torch_us']:.1f})"
                 for name in ("add_rms_norm", "rope_write_kv", "silu_mul") if name in r]
        differ = sum(v["differ"] for name in ("add_rms_norm", "rope_write_kv", "silu_mul") if name in r
                     for v in ([r[name]] + [r[name][x] for x in ("residual", "q", "k", "v") if x in r[name]])
                     if "differ" in v)
        rows.append([f"fused kernels, {t} token{plural} ({k.get('dtype')}, 8B shape)",
                     "; ".join(fused) + f"; elements differing from torch's ops: {differ}"])
        mm = r.get("matmul") or {}
        cells = []
        for name, m in mm.items():
            cell = f"{name} {m['us']:.1f} us = {m['tb_s']:.2f} TB/s"
            if m.get("skinny_us"):
                cell += f" (Triton split-K {m['skinny_us']:.1f} us = {m['skinny_tb_s']:.2f} TB/s)"
            cells.append(cell)
        if cells:
            rows.append([f"cuBLAS products, {t} row{plural} (weight read rate)", "; ".join(cells)])
    st = res("steps")
    for mode, r in st.items():
        if not isinstance(r, dict) or "batch1" not in r:
            continue
        for b in ("batch1", "batch32"):
            x = r.get(b) or {}
            if not x:
                continue
            line = (f"{x['step_ms_median']:.2f} ms a step ({x['hbm_fraction'] * 100:.0f} % of 4.8 TB/s for the "
                    f"weights), engine step {x['engine_step_ms_median']:.2f} ms, analytic model x{x['vs_analytic']}")
            kern = x.get("kernels")
            if kern and kern.get("top"):
                top = ", ".join(f"{name.split('(')[0][:40]} {us:.0f}" for name, us, _ in kern["top"][:6])
                line += (f"; GPU kernels {kern['per_step_us_total'] / 1e3:.2f} ms in {kern['kernels_per_step']:.0f} "
                         f"launches a step, the largest (us a step): {top}")
            rows.append([f"decode step, {st.get('shape')} bf16, {mode}, batch {b.removeprefix('batch')} "
                         f"(tidal {commit(st)})", line])
    off = report.get("offline") or {}
    trees = [t for t in ("before", "after", "after-cublas", "after-async") if t in off] if "after" in off else []
    base = res("offline", "before").get("summary") if "before" in off else None
    for t in trees:
        r = res("offline", t)
        if not r:
            continue
        cells = []
        for w, v in (r.get("summary") or {}).items():
            tok = (v.get("output_tok_s") or {}).get("tidal")
            b = ((base or {}).get(w, {}).get("output_tok_s") or {}).get("tidal")
            cells.append(f"({w}) {tok:.1f}" + (f" = {tok / b:.2f}x before" if b and t != "before" else ""))
        rows.append([f"tidal bench offline, out tok/s, tree {t} (tidal {commit(r)})", "; ".join(cells)])
    p = res("parity")
    for mode in ("graphs", "eager"):
        if mode in p:
            rows.append([f"float32 greedy tokens equal to transformers, 1B shape, {mode} (tidal {commit(p)})",
                         f"{p[mode]['equal']}/{p[mode]['of']} prompts ({p[mode]['attention']} attention)"])
    sv = res("serve")
    modes = [m for m in sv if m != "tree"]
    if modes:
        rows.append([f"tidal serve answers equal to one instance, 1B shape (tidal {commit(sv)})",
                     "; ".join(f"{m} {sv[m]['equal_to_one_instance']}/{sv[m]['of']}" for m in modes)])
        seeded = [m for m in modes if "seeded_of" in sv[m]]
        if seeded:
            rows.append([f"tidal serve seeded sampling equal to one instance, 1B shape (tidal {commit(sv)})",
                         "; ".join(f"{m} {sv[m]['seeded_equal_to_one_instance']}/{sv[m]['seeded_of']}"
                                   for m in seeded)])
    pr = res("profile")
    if pr.get("fit_lines"):
        grid = "quick grid" if "--quick" in pr.get("command", "") else "full grid and live steps"
        rows.append([f"tidal profile, 8B shape bf16, {grid} (tidal {commit(pr)})", " ".join(pr["fit_lines"])])
    return rows


def write_record(report: dict, dst: str, machine_from: str | None, notes: str | None, title: str | None = None) -> int:
    """A ``figures`` record of this check for ``tidal bench report``: its rows, the command, the date, and the
    machine of an offline JSON of the same run (so that it sits with that machine's runs on the page); returns
    how many rows it has."""
    machine = {"gpu": report.get("gpu")}
    if machine_from:
        with open(machine_from) as f:
            machine = json.load(f).get("machine") or machine
    started = report.get("started", "")
    record = {"benchmark": "benchmarks/gpu_check.py", "title": title or f"GPU check on {report.get('gpu')}",
              "command": "python " + " ".join(report.get("argv", [])),
              "date": started.replace(" ", "T") + "+00:00" if started else None, "machine": machine,
              "versions": {"torch": report.get("torch")}, "figures": figures(report)}
    if notes:
        record["notes"] = notes
    with open(dst, "w") as f:
        json.dump(record, f, indent=1)
    return len(record["figures"])
