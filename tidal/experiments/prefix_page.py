"""The generated page and plots of ``tidal bench sim-prefix`` (from its JSON only: the same JSON always
gives the same page)."""

from __future__ import annotations

import os
from typing import Any

from tidal.common.plots import pyplot, save_figure


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _ms(d: dict[str, Any] | None, key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v:,.0f}"


def _cap(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    v = c.get("capacity_rps")
    if v is None:
        return "none in range"
    return f">= {v:.2f} (the range's top)" if c.get("first_failing_rps") is None else f"{v:.2f}"


def summary_lines(res: dict[str, Any]) -> list[str]:
    lines = [f"{res['model']} on {res['instances']} x {res['hardware']}; SLO {res['slo']} for {res['target']:.0%}"]
    for w in res["workloads"]:
        lines.append(f"{w['workload']}: {w['num_requests']} requests at {w['trace_rate']:.2f}/s")
        for row in w.get("caching", []):
            r, pc = row["at_trace_rate"], row["at_trace_rate"].get("prefix_cache") or {}
            lines.append(f"  caching {row['setup']:<28} hit {_pct(pc.get('hit_rate'))} (unbounded as routed "
                         f"{_pct(pc.get('unbounded_hit_rate_as_routed'))}); TTFT p50/p99 "
                         f"{_ms(r['ttft_ms'], 'p50')} / {_ms(r['ttft_ms'], 'p99')} ms; capacity {_cap(row['capacity'])}")
        routing = w.get("routing")
        if routing:
            for name, d in routing["routers"].items():
                lines.append(f"  routing {name:<20} capacity {_cap(d['capacity'])}; "
                             + ", ".join(f"{rate:g}/s: hit {_pct((s.get('prefix_cache') or {}).get('hit_rate'))} "
                                         f"p99 TTFT {_ms(s['ttft_ms'], 'p99')} ms"
                                         for rate, s in zip(routing["rates"], d["sweep"], strict=True)))
    for c in res.get("claims") or []:
        lines.append(f"claim {c['workload']}: {c['claim']}: "
                     + ", ".join("-" if r is None else f"{r:.2f}x" for r in c["per_seed"]) + f" -> {c['verdict']}")
    return lines


def routing_checks(res: dict[str, Any], base: str = "least-outstanding", mine: str = "cache-aware") -> list[str]:
    """The comparisons issue 52 asks for, read off the sweep: cache-aware's hit rate against one LRU of the
    cluster's combined capacity, P99 TTFT at the rate where least-outstanding first misses the SLO, capacity."""
    routing = res.get("routing")
    if not routing or base not in routing["routers"] or mine not in routing["routers"]:
        return []
    rates, b, m = routing["rates"], routing["routers"][base], routing["routers"][mine]
    target = res.get("target", 0.9)
    out = []
    fr = []
    for rate, s in zip(rates, m["sweep"], strict=True):
        pc = s.get("prefix_cache") or {}
        comb = pc.get("lru_hit_rate_pool_and_host_combined", pc.get("lru_hit_rate_pool_combined"))
        if comb:
            fr.append(f"{rate:g}/s {pc['hit_rate'] / comb:.2f}")
    if fr:
        out.append(f"{mine}'s hit rate over one LRU of the cluster's combined capacity, by rate: {', '.join(fr)}")
    miss = next((k for k, s in enumerate(b["sweep"]) if (s.get("slo_attainment") or 0) < target), None)
    if miss is None:
        out.append(f"{base} meets the SLO at every rate of the sweep")
    else:
        pb, pm = (b["sweep"][miss]["ttft_ms"] or {}).get("p99"), (m["sweep"][miss]["ttft_ms"] or {}).get("p99")
        lost = sum(s.get("failed") or 0 for s in (b["sweep"][miss], m["sweep"][miss]))
        if pb and pm:
            out.append(f"at {rates[miss]:g}/s, where {base} first misses the SLO ({_pct(b['sweep'][miss]['slo_attainment'])}"
                       f" attainment): P99 TTFT {pm:,.0f} ms against {pb:,.0f} ms ({pm / pb:.2f}x); "
                       f"{lost} requests failed in the two runs")
            slow = [band for band in m["sweep"][miss].get("by_prompt_length") or []
                    if band.get("within_ttft_slo") is not None and band["within_ttft_slo"] < target]
            if slow:
                n = sum(band["requests"] for band in slow)
                total = sum(band["requests"] for band in m["sweep"][miss]["by_prompt_length"])
                out.append(f"there, {n / total:.0%} of the requests have prompts in bands where fewer than {target:.0%} "
                           f"meet the TTFT SLO under {mine} ("
                           + ", ".join(f"{band['from']:,}{'+' if band['to'] is None else '-' + format(band['to'], ',')}: "
                                       f"{_pct(band['within_ttft_slo'])}" for band in slow)
                           + "): their prefill, where no instance holds their prefix, alone exceeds the SLO, so the "
                             "P99 is theirs whatever the routing")
    own = res.get("trace_rate")
    k = next((i for i, r in enumerate(rates) if own and abs(r - own) <= 0.01 * own), None)
    if k is not None:
        pb, pm = (b["sweep"][k]["ttft_ms"] or {}).get("p99"), (m["sweep"][k]["ttft_ms"] or {}).get("p99")
        if pb and pm:
            out.append(f"at the workload's own rate ({rates[k]:g}/s): P99 TTFT {pm:,.0f} ms against {pb:,.0f} ms "
                       f"({pb / pm:.2f}x lower), hit rate {_pct((m['sweep'][k].get('prefix_cache') or {}).get('hit_rate'))}"
                       f" against {_pct((b['sweep'][k].get('prefix_cache') or {}).get('hit_rate'))}")
    cb, cm = (b["capacity"] or {}).get("capacity_rps"), (m["capacity"] or {}).get("capacity_rps")
    bounded = all((c["capacity"] or {}).get("first_failing_rps") is not None for c in (b, m))
    if cb and cm and bounded:
        out.append(f"capacity {cm:.2f} against {cb:.2f}/s: {cm / cb:.2f}x")
    else:
        out.append(f"capacity: {base} {_cap(b['capacity'])}, {mine} {_cap(m['capacity'])} (req/s)")
    return out


def readme_line(res: dict[str, Any], base: str = "least-outstanding", mine: str = "cache-aware") -> str:
    """The figures of README's cache-aware routing line, read off the result: per conversation seed the hit
    rate and P99 TTFT against ``base`` at the workload's own rate and the share of one LRU of the cluster's
    combined capacity; on the trace that share at the rates below its own, and the P99 TTFT at its own."""
    def span(xs: list[float], fmt: str) -> str:
        lo, hi = format(min(xs), fmt), format(max(xs), fmt)
        return lo if lo == hi else f"{lo}-{hi}"

    def per_seed(family_is_trace: bool, claim_start: str) -> list[float]:
        return [r for c in res.get("claims") or [] if (c["workload"] == "trace") == family_is_trace
                and c["claim"].startswith(claim_start) for r in c["per_seed"] if r is not None]

    def bound_share(w: dict[str, Any], keep) -> list[float]:
        out = []
        for rate, sw in zip(w["routing"]["rates"], w["routing"]["routers"][mine]["sweep"], strict=True):
            pc = sw.get("prefix_cache") or {}
            comb = pc.get("lru_hit_rate_pool_and_host_combined")
            if comb and keep(rate, w["trace_rate"]):
                out.append(100 * pc["hit_rate"] / comb)
        return out

    conv = [w for w in res["workloads"] if w.get("seed") is not None and w.get("routing")]
    trace = [w for w in res["workloads"] if w.get("seed") is None and w.get("routing")]
    hits = per_seed(False, f"{mine} routing hits more")
    p99 = per_seed(False, f"{mine} routing lowers P99")
    share = [x for w in conv for x in bound_share(w, lambda r, own: abs(r - own) <= 0.01 * own)]
    t_share = [x for w in trace for x in bound_share(w, lambda r, own: r < own * 0.99)]
    t_p99 = per_seed(True, f"{mine} routing lowers P99")
    return (f"simulated conversations hit {span(hits, '.2f')}x {base}'s cached tokens ({span(share, '.0f')} % of one "
            f"LRU of the whole cluster) with {span(p99, '.1f')}x lower P99 TTFT per seed; on the Mooncake trace "
            f"{span(t_share, '.0f')} % of that bound below its own rate and {span(t_p99, '.1f')}x lower P99 TTFT at it")


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.split(":")[0].split(".")[0])


def workload_slug(w: dict[str, Any]) -> str:
    """A workload's name in its figures' file names (a conversation workload's seed included)."""
    return _slug(w["workload"]) + (f"_seed{w['seed']}" if w.get("seed") is not None else "")


def write_plots(res: dict[str, Any], out_dir: str) -> list[str]:
    files: list[str] = []
    for w in res["workloads"]:
        files += _plots(w, out_dir, workload_slug(w), res["slo"])
    return files


def _plots(res: dict[str, Any], out_dir: str, slug: str, slo: str) -> list[str]:
    plt = pyplot()
    files = []
    caching = res.get("caching")
    if caching:
        fig, ax = plt.subplots(figsize=(8, 4))
        names = [row["setup"] for row in caching]
        got = [(row["at_trace_rate"].get("prefix_cache") or {}).get("hit_rate") or 0 for row in caching]
        bound = [(row["at_trace_rate"].get("prefix_cache") or {}).get("unbounded_hit_rate") or 0 for row in caching]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [100 * g for g in got], width=0.4, label="hit (pool + host tier)")
        ax.bar([x + 0.2 for x in xs], [100 * b for b in bound], width=0.4, label="unbounded cache")
        ax.set_xticks(list(xs), names, rotation=15)
        ax.set_ylabel("prompt tokens served from cache (%)")
        ax.legend()
        files.append(save_figure(plt, fig, os.path.join(out_dir, f"prefix_caching_{slug}.png")))
    routing = res.get("routing")
    if routing:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for name, d in routing["routers"].items():
            rates = routing["rates"]
            axes[0].plot(rates, [(s["ttft_ms"] or {}).get("p99") or 0 for s in d["sweep"]], marker="o", label=name)
            axes[1].plot(rates, [100 * (s.get("slo_attainment") or 0) for s in d["sweep"]], marker="o", label=name)
            axes[2].plot(rates, [100 * ((s.get("prefix_cache") or {}).get("hit_rate") or 0) for s in d["sweep"]],
                         marker="o", label=name)
        axes[0].set_ylabel("P99 TTFT (ms)")
        axes[0].set_yscale("log")
        axes[1].set_ylabel(f"SLO attainment (%), {slo}")
        axes[2].set_ylabel("prefix-cache hit rate (%)")
        for ax in axes:
            ax.set_xlabel("request rate (req/s)")
            ax.legend()
        files.append(save_figure(plt, fig, os.path.join(out_dir, f"prefix_routing_{slug}.png")))
    return [os.path.basename(f) for f in files]


def _ratio_q(q: dict[str, Any] | None) -> str:
    if not q or not q.get("count"):
        return "-"
    return f"{q['p50']:.2f} ({q['p10']:.2f}-{q['p90']:.2f})"


def write_page(res: dict[str, Any], path: str, figures: list[str], out_dir: str) -> None:
    rel = os.path.relpath(out_dir, os.path.dirname(os.path.abspath(path)) or ".")
    L = ["# Prefix caching and cache-aware routing, measured", "",
         "Generated by `" + res["command"] + "` (do not edit; rerun it). Simulated: "
         f"{res['model']} on {res['instances']} x {res['hardware']}, {res['kv_blocks_per_instance']:,} KV blocks of "
         f"16 tokens an instance. SLO: {res['slo']} (ms; tbt: a request's P99 gap) for {res['target']:.0%} of the "
         f"requests. {res['wall_time_s']:.0f} s of simulation.", ""]
    L += claims_table(res.get("claims") or [])
    for w in res["workloads"]:
        L += _section(w, [f for f in figures if f.endswith(f"_{workload_slug(w)}.png")], rel)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(L))


def claims_table(claims: list[dict[str, Any]]) -> list[str]:
    """The judged claims: per-seed ratios and the verdict (holds: every seed clears the margin; fails:
    every seed on the wrong side; tie otherwise; n/a: a side has no figure, e.g. no capacity)."""
    if not claims:
        return []
    L = ["## Claims, judged per seed", "",
         f"A verdict holds when every seed's ratio clears 1 + {claims[0]['margin']:g} (and a capacity's margin is wider "
         "than its search's bracket), fails when every seed is below 1, and is a tie otherwise; n/a when a side has "
         "no figure (no rate met the SLO).", "",
         "| workload | claim | ratio | per seed | verdict |", "|---|---|---|---|---|"]
    for c in claims:
        seeds = ", ".join("-" if r is None else f"{r:.2f}x" for r in c["per_seed"])
        v = c["verdict"] if c["verdict"] == "holds" else f"**{c['verdict']}**"
        L.append(f"| {c['workload']} | {c['claim']} | {c['ratio']} | {seeds} | {v} |")
    return L + [""]


def _section(res: dict[str, Any], figures: list[str], rel: str) -> list[str]:
    L = [f"## {res['workload']}", "",
         f"{res['num_requests']} requests (mean prompt {res.get('input_mean', 0):,.0f} tokens, mean output "
         f"{res.get('output_mean', 0):,.0f}) at {res['trace_rate']:.2f}/s of their own; the working set (every "
         f"distinct full block) is {res['working_set_gib_per_instance']:.0f} GiB an instance.", ""]
    caching = res.get("caching")
    if caching:
        L += ["### Prefix caching (least-outstanding routing)", "",
              "Hit rates are shares of prompt tokens (first admissions). Bounds on the same requests in the same order: "
              "an LRU of each instance's capacity on the requests routed to it (what its cache could hit), an "
              "unbounded cache per instance as routed, and one unbounded cache for the cluster (the reuse the trace "
              "holds at all).", "",
              "| setup | hit rate (pool / host tier) | LRU as routed | unbounded as routed | unbounded | "
              "TTFT p50 / p99 ms (trace rate) | capacity (req/s) |", "|---|---|---|---|---|---|---|"]
        for row in caching:
            r, pc = row["at_trace_rate"], row["at_trace_rate"].get("prefix_cache") or {}
            lru = pc.get("lru_hit_rate_pool_and_host_as_routed") or pc.get("lru_hit_rate_pool_as_routed")
            L.append(f"| {row['setup']} | {_pct(pc.get('hit_rate'))} ({_pct(pc.get('pool_hit_rate'))} / "
                     f"{_pct(pc.get('host_hit_rate'))}) | {_pct(lru)} | {_pct(pc.get('unbounded_hit_rate_as_routed'))} | "
                     f"{_pct(pc.get('unbounded_hit_rate'))} | {_ms(r['ttft_ms'], 'p50')} / {_ms(r['ttft_ms'], 'p99')} | "
                     f"{_cap(row['capacity'])} |")
        L.append("")
        if caching[0].get("sweep"):
            rates = res["caching_rates"]
            L += ["Across the routing study's rates (least-outstanding routing): hit rate / P99 TTFT (ms) / attainment.",
                  "", "| setup | " + " | ".join(f"{r:g}/s" for r in rates) + " |", "|---|" + "---|" * len(rates)]
            for row in caching:
                L.append(f"| {row['setup']} | " + " | ".join(
                    f"{_pct((s.get('prefix_cache') or {}).get('hit_rate'))} / {_ms(s['ttft_ms'], 'p99')} / "
                    f"{_pct(s.get('slo_attainment'))}" for s in row["sweep"]) + " |")
            L.append("")
    routing = res.get("routing")
    if routing:
        L += ["### Routing (prefix caching on, a host tier of "
              f"{routing['host_tier_gib']:.0f} GiB an instance)", "",
              "TTFT realized / predicted: cache-aware's prediction for the instance it chose, replayed from each "
              "decision's record, against the TTFT the request then had.", "",
              "| router | rate (req/s) | hit rate | one LRU of the cluster (pools + host tiers) | TTFT p50 / p99 ms | "
              "ITL p99 ms | attainment | busiest / mean instance work | TTFT realized / predicted, p50 (p10-p90) |",
              "|---|---|---|---|---|---|---|---|---|"]
        for name, d in routing["routers"].items():
            for rate, s in zip(routing["rates"], d["sweep"], strict=True):
                pc = s.get("prefix_cache") or {}
                comb = pc.get("lru_hit_rate_pool_and_host_combined", pc.get("lru_hit_rate_pool_combined"))
                lm = s.get("load_max_over_mean")
                L.append(f"| {name} | {rate:g} | {_pct(pc.get('hit_rate'))} | {_pct(comb)} | "
                         f"{_ms(s['ttft_ms'], 'p50')} / {_ms(s['ttft_ms'], 'p99')} | {_ms(s['itl_ms'], 'p99')} | "
                         f"{_pct(s.get('slo_attainment'))} | {'-' if lm is None else f'{lm:.2f}'} | "
                         f"{_ratio_q((s.get('ttft_prediction') or {}).get('all'))} |")
        L += ["", "| router | capacity (req/s) |", "|---|---|"]
        L += [f"| {name} | {_cap(d['capacity'])} |" for name, d in routing["routers"].items()]
        L.append("")
    checks = routing_checks(res)
    if checks:
        L += ["### What the routing comparison shows", ""]
        L += [f"- {line}" for line in checks]
        L.append("")
    band_src = (caching or [{}])[0].get("at_trace_rate") if caching else None
    if routing:
        band_src = routing["routers"][next(iter(routing["routers"]))]["sweep"][0]
    if band_src and band_src.get("by_prompt_length"):
        L += ["### Where the TTFT bound binds", "",
              "TTFT by prompt length" + (" (the routing sweep's lowest rate, first router)" if routing else "") +
              ": a prompt's prefill alone on one instance sets a floor that only a cache hit lowers.", "",
              "| prompt tokens | requests | TTFT p50 ms | within the TTFT SLO |", "|---|---|---|---|"]
        for b in band_src["by_prompt_length"]:
            span = f"{b['from']:,}+" if b["to"] is None else f"{b['from']:,}-{b['to']:,}"
            p50 = "-" if b["ttft_p50_ms"] is None else f"{b['ttft_p50_ms']:,.0f}"
            L.append(f"| {span} | {b['requests']} | {p50} | {_pct(b['within_ttft_slo'])} |")
        L.append("")
    for f in figures:
        L += [f"![{f}]({rel}/{f})", ""]
    return L


__all__ = ["claims_table", "readme_line", "summary_lines", "write_page", "write_plots"]
