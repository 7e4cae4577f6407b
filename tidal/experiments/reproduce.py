"""``tidal reproduce PAPER``: a paper's headline result regenerated, in the simulator, against that
paper's baselines implemented in tidal (each named after what it stands for).

Papers: ``bucketserve`` (:mod:`tidal.experiments.repro_bucketserve`), ``pang``
(:mod:`tidal.experiments.repro_pang`), ``kunserve`` (:mod:`tidal.experiments.repro_kunserve`, wrapping ``tidal
bench sim-kunserve``) and ``dynaserve`` (:mod:`tidal.experiments.repro_dynaserve`, wrapping ``tidal bench
sim-dynaserve``). Each writes to ``--output`` (default ``results/reproduce``):
``PAPER.json`` (every number), PNG figures shaped like the paper's (same axes) and ``PAPER.md``,
the table ``claim | paper | tidal simulated | tidal real | why they differ``. ``--quick`` runs a
smaller setup (fewer requests, rates and rows) that finishes in under two minutes on two cores;
the tests run it and check the direction of each claim. ``--results-md FILE`` also puts the
table and figures into FILE (``docs/results.md``), in the paper's own section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.common.machine import machine_info
from tidal.common.results import command_line
from tidal.metrics import SLO, summarize
from tidal.workload import RequestSpec

PROG = "tidal reproduce"


REAL_NOT_RUN = ("not run: the real engine here is a shared 2-core CPU, where none of the paper's models "
                "(13B-70B) fit and no engine timings are taken")


VERDICTS = ("holds", "fails", "tie", "n/a")


MARGIN_PAST_BRACKET = 0.02  # a capacity ratio must clear its search's bracket by this much more


def judge(per_seed: Sequence[float] | None, margin: float = 0.02, tolerance: float = 0.0,
          identical: bool = False) -> str:
    """A claim's verdict from its per-seed ratios (technique over baseline, > 1 = the paper's way).

    ``holds``: every seed's ratio clears ``1 + margin`` and the margin is wider than the search's
    ``tolerance`` (a capacity bracket of 4 % cannot tell 2 % apart); ``fails``: every seed is on the
    wrong side (ratio < 1); ``tie`` otherwise (seeds disagree, or a seed inside the margin); ``n/a`` when
    the two sides are identical by construction (``identical``), or there is no ratio at all.
    """
    if identical or not per_seed:
        return "n/a"
    if margin > tolerance and all(r > 1.0 + margin for r in per_seed):
        return "holds"
    if all(r < 1.0 for r in per_seed):
        return "fails"
    return "tie"


@dataclass
class Claim:
    """One row of the table. ``holds`` (legacy): whether tidal's simulated numbers go the paper's
    way; a claim built with ``per_seed`` (one ratio a seed, > 1 = the paper's way) is judged by
    :func:`judge` instead, and ``verdict`` is what the page and the JSON show."""

    claim: str
    paper: str
    simulated: str
    holds: bool
    why: str
    real: str = REAL_NOT_RUN
    per_seed: list[float] | None = None
    margin: float = 0.02
    tolerance: float = 0.0
    identical: bool = False  # the two sides are the same run by construction: n/a, never holds
    verdict: str = ""

    def __post_init__(self) -> None:
        if not self.verdict:
            if self.per_seed is not None or self.identical:
                self.verdict = judge(self.per_seed, self.margin, self.tolerance, self.identical)
            else:
                self.verdict = "holds" if self.holds else "fails"
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")
        self.holds = self.verdict == "holds"

    def row(self) -> str:
        mark = self.verdict if self.verdict == "holds" else f"**{self.verdict}**"
        seeds = ""
        if self.per_seed:
            seeds = f"; per seed {', '.join(f'{r:.2f}x' for r in self.per_seed)}"
        return f"| {self.claim} | {self.paper} | {self.simulated} (verdict: {mark}{seeds}) | {self.real} | {self.why} |"


@dataclass
class Report:
    paper: str
    title: str
    setup: str
    quick: bool
    data: dict[str, Any] = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)  # file names, next to the JSON
    wall_time_s: float = 0.0
    command: str = ""
    reused_sim: bool = False  # --reuse-sim: the simulator runs were read from their recorded JSON, not run

    def to_dict(self) -> dict[str, Any]:
        return {"paper": self.paper, "title": self.title, "setup": self.setup, "quick": self.quick,
                "command": self.command, "wall_time_s": self.wall_time_s, "reused_sim": self.reused_sim,
                "machine": machine_info(),
                "data": self.data, "figures": self.figures,
                "claims": [c.__dict__ for c in self.claims]}

    def markdown(self, figure_dir: str = "") -> str:
        lines = [f"## {self.title}", "", self.setup, "",
                 f"Command: `{self.command}` ({self.wall_time_s:.0f} s on this machine"
                 f"{', quick setup' if self.quick else ''}"
                 f"{'; the simulator runs read from the JSON their own commands wrote' if self.reused_sim else ''}).",
                 "",
                 "| claim | paper | tidal simulated | tidal real | why they differ |", "|---|---|---|---|---|"]
        lines += [c.row() for c in self.claims]
        lines.append("")
        for f in self.figures:
            lines += [f"![{f}]({os.path.join(figure_dir, f) if figure_dir else f})", ""]
        return "\n".join(lines)


class Progress:
    """One line per finished run, with the time so far (long runs show they are moving)."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.t0 = enabled, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"  [{time.perf_counter() - self.t0:6.1f} s] {msg}", flush=True)


def run_sim(spec_kwargs: dict[str, Any], specs: Sequence[RequestSpec], slo: SLO | None = None) -> dict[str, Any]:
    """One simulator run: the summary (throughputs, latencies, attainment) plus preemptions and
    the policies' states."""
    from tidal.sim.build import ClusterSpec, build_simulator

    res = build_simulator(ClusterSpec(**spec_kwargs), list(specs)).run()
    out = summarize(res.records, slo=slo)
    out["simulated_time_s"] = res.simulated_time_s
    out["num_preemptions"] = sum(i["num_preemptions"] for i in res.instances)
    out["policy_states"] = [i["policy_state"] for i in res.instances]
    return out


def server_rps(summary: dict[str, Any]) -> float:
    """Completed requests per second of the run (BucketServe's "server RPS")."""
    d = summary.get("duration_s") or 0.0
    return summary["completed"] / d if d > 0 else 0.0


def capacity_from_sweep(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The highest x whose attainment is >= ``target`` on a sweep [(x, attainment)], linearly
    interpolated to where the curve crosses the target after it (None: never met)."""
    pts = sorted(points)
    best = None
    for i, (x, a) in enumerate(pts):
        if a >= target:
            best = x
            if i + 1 < len(pts) and pts[i + 1][1] < target:
                x2, a2 = pts[i + 1]
                best = x + (x2 - x) * (a - target) / (a - a2)
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


MARGIN = 1.02  # "A beats B" needs A above B by more than this factor (2 %, beyond rounding and noise)


def beats(a: float | None, b: float | None) -> bool:
    """``a`` beats ``b`` by more than :data:`MARGIN` (None counts as 0)."""
    return (a or 0.0) > MARGIN * (b or 0.0)


def fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def holds_on_seeds(wins: Sequence[bool]) -> str:
    """A real direction's verdict over paired seeds: it holds only when it holds on every seed."""
    return "yes" if all(wins) else f"**no**, {sum(wins)} of {len(wins)} seeds" if len(wins) > 1 else "**no**"


def ratio_span(xs: Sequence[float]) -> str:
    """Per-seed ratios as one range, lowest to highest (one figure when they round alike)."""
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def claims_range(claims: Sequence[Claim], prefix: str, contains: str
                 ) -> tuple[float, float, float, float, int, int] | None:
    """(lowest and highest median ratio, lowest and highest seed, claims that hold, claims) of the
    claims whose name starts with ``prefix`` and contains ``contains`` (a README line's figures)."""
    import statistics

    cs = [c for c in claims if c.claim.startswith(prefix) and contains in c.claim and c.per_seed]
    if not cs:
        return None
    meds = [statistics.median(c.per_seed) for c in cs if c.per_seed]
    seeds = [x for c in cs for x in (c.per_seed or [])]
    return min(meds), max(meds), min(seeds), max(seeds), sum(c.verdict == "holds" for c in cs), len(cs)


def vs_paper(lo: float, hi: float, paper_lo: float, paper_hi: float) -> str:
    """How a measured range ``lo``-``hi`` stands against the paper's (never put beside it unsaid)."""
    if hi < paper_lo:
        return "smaller than the paper's"
    if lo > paper_hi:
        return "larger than the paper's"
    return "overlapping the paper's"


def fmt_rate(x: float | None) -> str:
    """A capacity (req/s) in a claim; "none" when no rate met the SLO."""
    return "none" if x is None else f"{x:.2f}"


def bench_parser(add_parser: Callable[[argparse._SubParsersAction], None]) -> argparse.ArgumentParser:
    """A parser for one ``tidal bench`` command (``bench NAME ...``): a paper's run goes through the
    bench command's own flags and defaults."""
    p = argparse.ArgumentParser(prog="tidal")
    bench = p.add_subparsers(dest="command").add_parser("bench").add_subparsers(dest="bench_command")
    add_parser(bench)
    return p


def run_or_reuse(args: argparse.Namespace, add_parser: Callable[[argparse._SubParsersAction], None], argv: list[str],
                 out: str, log: Progress) -> dict[str, Any]:
    """:func:`run_bench`, or with ``--reuse-sim`` the JSON already at ``out`` (it records the command
    that wrote it)."""
    if getattr(args, "reuse_sim", False) and os.path.exists(out):
        log(f"reusing {out} (written by its own command)")
        with open(out) as f:
            return json.load(f)
    return run_bench(add_parser, argv, out, log)


def all_reused(args: argparse.Namespace, names: Sequence[str]) -> bool:
    """``--reuse-sim`` and every one of ``names`` already in ``--output``: no simulator run here."""
    return bool(getattr(args, "reuse_sim", False)) and all(os.path.exists(os.path.join(args.output, n)) for n in names)


def run_bench(add_parser: Callable[[argparse._SubParsersAction], None], argv: list[str], out: str,
              log: Progress) -> dict[str, Any]:
    """Run ``tidal bench ...`` (``argv``, writing its JSON to ``out``) through its own parser and
    return that JSON: a paper's run is the bench command's, with its flags and defaults."""
    bench = bench_parser(add_parser).parse_args([*argv, "--output", out])
    log(f"tidal {' '.join(argv[:2])} -> {out}")
    saved, sys.argv = sys.argv, ["tidal", *argv, "--output", out]  # the command it records is its own
    try:
        if bench.func(bench) != 0:
            raise RuntimeError(f"tidal {' '.join(argv[:2])} failed")
    finally:
        sys.argv = saved
    with open(out) as f:
        return json.load(f)


PAPERS: dict[str, Callable[[argparse.Namespace, Progress], Report]] = {}


def _papers() -> dict[str, Callable[[argparse.Namespace, Progress], Report]]:
    if not PAPERS:
        from tidal.experiments import repro_bucketserve, repro_dynaserve, repro_kunserve, repro_pang

        PAPERS["bucketserve"] = repro_bucketserve.reproduce
        PAPERS["pang"] = repro_pang.reproduce
        PAPERS["kunserve"] = repro_kunserve.reproduce
        PAPERS["dynaserve"] = repro_dynaserve.reproduce
    return PAPERS


def write_results_md(path: str, report: Report, figure_dir: str) -> None:
    """Put ``report``'s section into ``path`` (between markers of its paper), keeping the others."""
    head = ("# Reproduced results\n\nGenerated by `tidal reproduce all --output docs/results --results-md docs/results.md` (or one PAPER at a time); "
            "every number below comes from the runs named in its section: the simulator's, and the real engine's "
            "in the 'tidal real' column.\n")
    text = head
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    begin, end = f"<!-- reproduce:{report.paper}:begin -->", f"<!-- reproduce:{report.paper}:end -->"
    section = f"{begin}\n{report.markdown(figure_dir)}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


def runs_real(args: argparse.Namespace) -> bool:
    """``--real`` / ``--no-real`` as given, else on for a full run and off with ``--quick``."""
    real = getattr(args, "real", None)
    return real if real is not None else not args.quick


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="regenerate a paper's headline result against its baselines (simulator)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("paper", help="bucketserve | pang | kunserve | dynaserve | all (each in turn)")
    p.add_argument("--quick", action="store_true", help="a small setup that finishes in under two minutes")
    p.add_argument("--output", default="results/reproduce", help="directory for PAPER.json, PAPER.md and figures")
    p.add_argument("--results-md", default=None, help="also write the table and figures into this Markdown file")
    p.add_argument("--real", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the claims that fit this CPU on the real engine at small scale (bucketserve, "
                        "kunserve, dynaserve; default: on, off with --quick)")
    p.add_argument("--real-json", default=None, metavar="PATH",
                   help="dynaserve: the real column from a recorded `python benchmarks/dynaserve_serve.py` run's "
                        "JSON instead of running it again (about 7 minutes a layout here); kunserve: from a recorded "
                        "kunserve_real.json (`tidal reproduce kunserve`'s or `python benchmarks/kunserve_serve.py`'s)")
    p.add_argument("--reuse-sim", action="store_true",
                   help="dynaserve, kunserve: read the simulator runs already in --output (each JSON records the "
                        "command that wrote it) instead of running them again (hours on two cores)")
    p.add_argument("--no-plots", action="store_true", help="write no figures")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    papers = _papers()
    if args.paper != "all" and args.paper not in papers:
        print(f"{PROG}: error: unknown paper {args.paper!r}; available: {', '.join(papers)}, all", file=sys.stderr)
        return 2
    os.makedirs(args.output, exist_ok=True)
    command = command_line(PROG)
    print(f"command: {command}", flush=True)
    for paper in papers if args.paper == "all" else [args.paper]:  # all: each paper's section in turn
        _reproduce_one(paper, papers[paper], args, command)
    return 0


def _reproduce_one(paper: str, fn: Callable[[argparse.Namespace, Progress], Report], args: argparse.Namespace,
                   command: str) -> None:
    t0 = time.perf_counter()
    report = fn(args, Progress(not args.no_progress))
    report.wall_time_s = time.perf_counter() - t0
    report.command = command
    with open(os.path.join(args.output, f"{paper}.json"), "w") as f:
        json.dump(report.to_dict(), f, indent=1, default=str)
    with open(os.path.join(args.output, f"{paper}.md"), "w") as f:
        f.write(report.markdown() + "\n")
    if args.results_md:
        rel = os.path.relpath(args.output, os.path.dirname(os.path.abspath(args.results_md)) or ".")
        write_results_md(args.results_md, report, rel)
    print("\n" + report.markdown())
    print(f"\nwall time {report.wall_time_s:.1f} s; wrote {args.output}/{paper}.json, .md"
          + (f" and {len(report.figures)} figures" if report.figures else ""), flush=True)
