"""``tidal bench sim-auto``: the regime trace, the rate search, the per-seed judgements, and a tiny
run of the command that writes its JSON, figures and page (the full run is the lead's, not CI's)."""

from __future__ import annotations

import json
import math

import pytest

from tests.workload.test_workloads import needs_traces
from tidal.experiments import auto_trace as AT
from tidal.experiments.sim_auto import judge_paper, judge_trace, verdict


def test_verdicts_need_every_seed():
    assert verdict([True, True, True]) == "holds" and verdict([False] * 3) == "fails"
    assert verdict([True, False, True]) == "tie" and verdict([]) == "tie"


def _run(p99_by_phase: dict[str, float], whole: float, lost: int = 0) -> dict:
    return {"phases": {ph: {"ttft_p99_ms": v} for ph, v in p99_by_phase.items()},
            "whole": {"ttft_p99_ms": whole, "lost": lost}}


def test_trace_judgement_per_phase_and_over_the_trace():
    # two seeds; in phase a drop is best (100) and auto 104 (within 5 %) then 120 (not)
    runs = {"recompute": [_run({"a": 300}, 900), _run({"a": 300}, 900)],
            "swap": [_run({"a": 200}, 500), _run({"a": 200}, 500)],
            "migrate": [_run({"a": 150}, 700), _run({"a": 150}, 700)],
            "drop": [_run({"a": 100}, 240), _run({"a": 100}, 230)],
            "auto": [_run({"a": 104}, 200), _run({"a": 120}, 200, lost=1)]}
    j = judge_trace(runs, ["a"])
    seeds = j["phases"]["a"]["per_seed"]
    assert [s["best_fixed"] for s in seeds] == ["drop", "drop"]
    assert [s["auto_over_best"] for s in seeds] == pytest.approx([1.04, 1.2])
    assert j["phases"]["a"]["verdict"] == "tie"
    assert j["whole"]["recompute"]["verdict"] == "holds" and j["whole"]["recompute"]["per_seed"] == [4.5, 4.5]
    assert j["whole"]["drop"]["verdict"] == "tie"  # 1.2 and 1.15
    assert j["lost"]["auto"] == [0, 1] and j["no_loss"] == "tie"


def test_one_best_names_a_fixed_response_near_the_best_in_every_phase():
    from tidal.experiments.sim_auto import one_best

    def r(a, b):
        return {"phases": {"a": {"ttft_p99_ms": a}, "b": {"ttft_p99_ms": b}}}
    # swap is best in a and 4 % over the best in b; drop is best in b but 50 % over in a
    runs = {"recompute": r(300, 300), "swap": r(100, 104), "migrate": r(200, 200), "drop": r(150, 100)}
    assert one_best(runs, ["a", "b"]) == ["swap"]
    runs["swap"] = r(100, 106)  # now no response is within 5 % everywhere: the regimes differ
    assert one_best(runs, ["a", "b"]) == []
    runs["migrate"] = r(None, 100)  # a phase without a P99 is never near the best
    assert one_best(runs, ["a", "b"]) == []


def test_the_hindsight_schedule_is_each_phase_s_best_fixed_response():
    from tidal.experiments.sim_auto import hindsight_schedules

    def r(a, b):
        return {"phases": {"a": {"ttft_p99_ms": a}, "b": {"ttft_p99_ms": b}}, "whole": {"ttft_p99_ms": 1, "lost": 0}}
    runs = {"recompute": [r(300, 90)], "swap": [r(100, 104)], "migrate": [r(100, 200)], "drop": [r(150, None)],
            "auto": [r(1, 1)]}
    # a: swap and migrate tie (the first of FIXED is kept); b: recompute; a phase without a P99 never wins
    assert hindsight_schedules(judge_trace(runs, ["a", "b"]), ["a", "b"]) == [("swap", "recompute")]


def test_a_bound_is_judged_as_auto_and_states_how_far_it_is_from_the_bar():
    from tidal.experiments.auto_page import _bound_trace, best_over

    fixed = {"recompute": [_run({"a": 300}, 900), _run({"a": 300}, 900)],
             "swap": [_run({"a": 200}, 500), _run({"a": 200}, 250)],
             "migrate": [_run({"a": 150}, 700), _run({"a": 150}, 700)],
             "drop": [_run({"a": 100}, 240), _run({"a": 100}, 230)]}
    bound = [_run({"a": 100}, 200), _run({"a": 100}, 220)]
    j = judge_trace({**fixed, "auto": bound}, ["a"])
    # the best fixed over the bound: 240 / 200 on seed 0 (drop), 230 / 220 on seed 1 (drop)
    assert best_over(j) == pytest.approx([1.2, 230 / 220])
    text = "\n".join(_bound_trace({"bounds": {"hindsight": {"schedules": [["drop"], ["drop"]], "runs": bound,
                                                             "judged": j}}}, {}))
    assert "Its schedule per seed: drop / drop." in text and "a 1.00 / 1.00" in text
    assert "1.20 / 1.05: at least 1.2x on 1 of 2 seeds" in text


def test_service_rate_is_output_tokens_over_the_runs_span():
    from types import SimpleNamespace as N

    from tidal.experiments.auto_runs import service_rate

    recs = [N(arrival_s=1.0, end_s=3.0, output_tokens=10), N(arrival_s=2.0, end_s=11.0, output_tokens=30),
            N(arrival_s=5.0, end_s=None, output_tokens=0)]
    assert service_rate(recs) == pytest.approx(40 / 10.0)
    assert service_rate([N(arrival_s=1.0, end_s=None, output_tokens=0)]) is None


def test_a_runs_pipeline_groups_give_its_layout_cost():
    from tidal.experiments.auto_page import layout_of
    from tidal.experiments.auto_runs import pipeline_groups

    raw = [{"group": [2, 0], "formed_s": 10.0, "ended_s": 20.0, "bubble_ratio": 0.1},
           {"group": [2, 0, 4, 5], "formed_s": 20.0, "ended_s": None, "bubble_ratio": 0.2}]  # never split
    groups = pipeline_groups(raw, 100.0)
    assert groups == [[2, 10.0, 20.0, 0.1], [4, 20.0, 100.0, 0.2]]
    got = layout_of({"groups": groups, "span_s": [0.0, 100.0]}, 8)
    # stage-seconds in groups: 2 x 10 + 4 x 80 = 340 of 8 x 100; bubbles weighted by them: (20 x 0.1 + 320 x 0.2) / 340
    assert got["deepest"] == 4 and (got["formed_s"], got["ended_s"]) == (20.0, 100.0)
    assert got["grouped_share"] == pytest.approx(340 / 800) and got["bubble"] == pytest.approx(66 / 340)
    assert layout_of({"span_s": [0.0, 100.0]}, 8) is None and layout_of({"groups": groups}, 8) is None


def test_kunserve_datasets_show_their_runs_groups_and_limit_spells():
    from tidal.experiments.auto_page import kunserve_layouts

    ks = {"sharegpt": {"runs": {"recompute": [{}], "drop": [{"groups": [[2, 10.0, 50.0, 0.1]], "span_s": [0.0, 100.0]}],
                                "auto-limit": [{"limits": [["limit", 30.0], ["limit-over", 80.0]]}]}},
          "longbench": {"runs": {"recompute": [{}], "drop": [{}]}}}
    lines = [x for x in kunserve_layouts(ks, 8) if x]
    # 2 stages x 40 s of 8 instances x 100 s: 10 % grouped, a tenth of it idle
    assert lines[0].startswith("sharegpt: Pipeline groups, per seed") and \
        lines[0].endswith("drop 2 stages from 10 s to 50 s, 10% grouped, bubbles 10%.")
    assert lines[1] == "sharegpt: KunServe's limit signal (Sec. 4.4), per seed: auto-limit off drops at 30 s, back on at 80 s."
    assert len(lines) == 2  # longbench formed no group and ran no limit


def test_paper_judgement_follows_whoever_wins():
    # P99 TTFT (lower is better): seed 0 drop beats recompute, auto within 5 % of drop; seed 1 drop loses and
    # auto is 10 % worse than recompute
    runs = {"auto": [{"p": 103.0}, {"p": 110.0}], "drop": [{"p": 100.0}, {"p": 130.0}],
            "recompute": [{"p": 200.0}, {"p": 100.0}]}
    j = judge_paper(runs, "drop", "recompute", "p", higher_better=False)
    assert [s["against"] for s in j["per_seed"]] == ["drop", "recompute"]
    assert j["per_seed"][0]["auto_vs"] == pytest.approx(100 / 103) and j["verdict"] == "tie"
    # capacity (higher is better)
    runs = {"auto": [{"c": 5.0}], "memory+sla": [{"c": 5.1}], "static": [{"c": 4.0}]}
    assert judge_paper(runs, "memory+sla", "static", "c", higher_better=True)["verdict"] == "holds"


def test_the_rate_search_brackets_the_rule():
    # demand grows 10 % per req/s; the queue keeps up below 9 req/s: the rule binds at 6 req/s (60 %)
    got = AT.search_rate(lambda r: {"mean_kv_demand": 0.1 * r, "keeps_up": r < 9}, 2.0, 0.6, tolerance=0.02,
                         max_probes=20)
    assert got["rate"] <= 6.0 and (got["bracket"][1] - got["rate"]) / got["bracket"][1] <= 0.02
    with pytest.raises(AT.TraceError, match="no rate"):
        AT.search_rate(lambda r: {"mean_kv_demand": 1.0, "keeps_up": True}, 2.0, 0.6, max_probes=3)


@needs_traces
def test_a_regime_trace_puts_each_phase_in_its_window():
    specs, phases = AT.regime_trace({"chat": 4.0, "long": 1.0, "code": 4.0}, 30.0, 1, 32768)
    assert [p.name for p in phases] == ["chat", "long", "code"] and phases[1].start_s == 30.0
    for p in phases:
        mine = [s for s in specs if p.start_s <= s.arrival_s < p.end_s]
        assert mine and all(AT.phase_of(phases, s.arrival_s) == p.name for s in mine)
    long = [s for s in specs if 30.0 <= s.arrival_s < 60.0]
    code = [s for s in specs if s.arrival_s >= 60.0]
    assert min(s.prompt_len for s in long) > 0 and max(s.prompt_len + s.output_len for s in specs) <= 32768
    assert sum(s.output_len for s in code) / len(code) < 100  # short completions
    again, _ = AT.regime_trace({"chat": 4.0, "long": 1.0, "code": 4.0}, 30.0, 1, 32768)
    assert [(s.arrival_s, s.prompt_len) for s in again] == [(s.arrival_s, s.prompt_len) for s in specs]
    other, _ = AT.regime_trace({"chat": 4.0, "long": 1.0, "code": 4.0}, 30.0, 2, 32768)
    assert [s.prompt_len for s in other] != [s.prompt_len for s in specs]  # another seed, another window


@needs_traces
def test_the_command_writes_its_json_figures_and_page(tmp_path, capsys, monkeypatch):
    from tidal.cli import main

    out, page = tmp_path / "auto", tmp_path / "auto.md"
    assert main(["bench", "sim-auto", "--parts", "trace", "--seeds", "1", "--phase-duration", "6", "--probes", "1",
                 "--output", str(out), "--page", str(page), "--no-progress"]) == 0
    res = json.loads((out / "auto_sim.json").read_text())
    level = res["trace"]["levels"]["paper rule"]
    assert set(level["runs"]) == {"recompute", "swap", "migrate", "drop", "auto", "auto-nodrop", "auto-limit"}
    # the labelled ablation: auto over three responses, judged as auto is against the same fixed runs
    assert level["runs"]["auto-nodrop"][0]["techniques"] == ["recompute", "swap", "migrate"]
    assert level["runs"]["auto"][0]["techniques"] == ["recompute", "swap", "migrate", "drop"]
    assert set(level["ablations"]["auto-nodrop"]["whole"]) == {"recompute", "swap", "migrate", "drop"}
    # the second: all four responses, drops undone at KunServe's limit signal; its spells are recorded
    assert level["runs"]["auto-limit"][0]["techniques"] == ["recompute", "swap", "migrate", "drop"]
    assert isinstance(level["runs"]["auto-limit"][0]["limits"], list) and "limits" not in level["runs"]["auto"][0]
    assert res["setup"]["ablations"].keys() == {"auto-nodrop", "auto-limit"}
    assert "KunServe's limit signal (Sec. 4.4), per seed: auto-limit " in page.read_text()
    for rs in level["runs"].values():
        assert set(rs[0]["phases"]) == {"chat", "long", "code"} and rs[0]["whole"]["lost"] == 0
    assert not math.isnan(level["judged"]["phases"]["chat"]["per_seed"][0]["auto_over_best"])
    # every run but drop's carries its audit (a passive predictor's, or auto's own choices)
    assert all(isinstance(level["runs"][s][0]["audit"], list) for s in ("recompute", "swap", "migrate", "auto"))
    assert "audit" not in level["runs"]["drop"][0]
    text = page.read_text()
    assert "## A trace that changes regime" in text and "auto_timeline.png" in text
    assert isinstance(level["judged"]["one_best"][0], list) and level["runs"]["swap"][0]["service_tok_s"] > 0
    assert "Output tokens served per second over the run" in text and "in every phase, per seed" in text
    assert "**ablation (ours): tidal auto without drop**" in text
    # the hindsight bound: each phase's best fixed response pinned at the phase's start; it runs auto's machinery
    hb = level["bounds"]["hindsight"]
    assert hb["schedules"] == [[level["judged"]["phases"][ph]["per_seed"][0]["best_fixed"] for ph in ("chat", "long",
                                                                                                      "code")]]
    assert set(hb["judged"]["whole"]) == {"recompute", "swap", "migrate", "drop"} and hb["runs"][0]["whole"]["lost"] == 0
    assert hb["runs"][0]["techniques"] == ["recompute", "swap", "migrate", "drop"]
    pinned_to = {c[2] for c in hb["runs"][0]["choices"]}
    assert pinned_to <= set(hb["schedules"][0])  # every onset took its phase's response (or one it could run)
    assert "**bound (ours): each phase's best fixed response, pinned after the fact** (`hindsight`" in text
    assert (out / "auto_timeline.png").is_file() and (out / "auto_phases.png").is_file()
    page.unlink()
    assert main(["bench", "sim-auto", "--output", str(out), "--page", str(page), "--replot"]) == 0  # from the JSON
    assert page.read_text() == text
    assert main(["bench", "sim-auto", "--output", str(tmp_path / "none"), "--replot"]) == 2
    assert main(["bench", "sim-auto", "--parts", "nope"]) == 2
    assert "--parts" in capsys.readouterr().err
    # every schedule, pinned, on the same trace: the per-phase-best one gives the bound's figure again
    assert main(["bench", "sim-auto", "--output", str(out), "--page", str(page), "--all-schedules",
                 "--schedule-levels", "paper rule", "--no-progress"]) == 0
    sch = json.loads((out / "auto_schedules.json").read_text())
    (runs,) = sch["levels"]["paper rule"]["runs"]
    assert len(runs) == 64 and len({tuple(r["schedule"]) for r in runs}) == 64
    (j,) = sch["levels"]["paper rule"]["judged"]
    assert j["hindsight_p99_ms"]["here"] == j["hindsight_p99_ms"]["recorded"] == hb["runs"][0]["whole"]["ttft_p99_ms"]
    assert j["best_p99_ms"] == min(r["ttft_p99_ms"] for r in runs) and j["best_p99_ms"] <= j["hindsight_p99_ms"]["here"]
    fixed = {s: level["runs"][s][0]["whole"]["ttft_p99_ms"] for s in ("recompute", "swap", "migrate", "drop")}
    assert j["best_fixed_p99_ms"] == min(fixed.values()) and j["ratio"] == j["best_fixed_p99_ms"] / j["best_p99_ms"]
    assert "**Every schedule** (64: each of the four fixed responses for each of the 3 phases" in page.read_text()
    assert "gives the bound's figure again on every seed" in page.read_text()
    assert main(["bench", "sim-auto", "--output", str(out), "--all-schedules", "--schedule-levels", "nope"]) == 2
    assert "no level 'nope' in the run" in capsys.readouterr().err
    # the same command again resumes: the level-seed pairs already in auto_schedules.json are read, none run
    import tidal.experiments.parallel as P

    def no_runs(fn, calls, jobs, on_done=None):
        assert not calls, f"{len(calls)} schedule runs where every pair was read back"
        return []
    monkeypatch.setattr(P, "run_all", no_runs)
    assert main(["bench", "sim-auto", "--output", str(out), "--page", str(page), "--all-schedules",
                 "--schedule-levels", "paper rule", "--no-progress"]) == 0
    again = json.loads((out / "auto_schedules.json").read_text())
    assert again["read_back"] == [["paper rule", 0]] and again["levels"] == sch["levels"]
    assert again["wall_time_before_s"] == pytest.approx(sch["wall_time_s"])
    assert "on seeds 0 (seed 0 read back from an earlier run in `auto_schedules.json`))" in page.read_text()
    monkeypatch.undo()
    # a later run of the trace leaves the old schedules off its page: they were run on another trace
    res["trace"]["levels"]["paper rule"]["runs"]["swap"][0]["whole"]["ttft_p99_ms"] = 1.0
    (out / "auto_sim.json").write_text(json.dumps(res))
    assert main(["bench", "sim-auto", "--output", str(out), "--page", str(page), "--replot"]) == 0
    assert "**Every schedule**" not in page.read_text() and "was run on another trace" in capsys.readouterr().err


def test_every_schedule_is_judged_by_its_best_against_the_best_fixed_response():
    """--all-schedules' judgement per seed: the schedule with the least whole-trace P99 (a run without
    one counts as never finishing), the best fixed response's from the level's own runs, their ratio,
    and the schedules reaching the bar."""
    from tidal.experiments.auto_schedules import all_schedules, judge

    scheds = all_schedules(["chat", "long", "code"])
    assert len(scheds) == 64 and scheds[0] == ("recompute",) * 3 and scheds[-1] == ("drop",) * 3

    def run(p99):
        return {"whole": {"ttft_p99_ms": p99}}
    level = {"runs": {"recompute": [run(100.0)], "swap": [run(90.0)], "migrate": [run(None)], "drop": [run(120.0)]}}
    got = [{"schedule": list(s), "ttft_p99_ms": v, "lost": 0} for s, v in zip(scheds[:3], (None, 80.0, 70.0),
                                                                           strict=True)]
    (j,) = judge(level, [got], [5], 1.2)
    assert j["seed"] == 5 and j["best"] == list(scheds[2]) and j["best_p99_ms"] == 70.0
    assert j["best_fixed"] == "swap" and j["ratio"] == pytest.approx(90 / 70) and j["schedules_reaching_bar"] == 1
    assert j["schedules"] == 3


def test_the_audit_table_gives_each_response_its_median_ratio_per_seed():
    from tidal.experiments.auto_page import _audit_table

    run = lambda rows: {"audit": rows}  # noqa: E731
    d = {"runs": {"swap": [run([[1.0, 0, "swap", 2.0, 1.0], [2.0, 1, "swap", 1.0, 3.0], [3.0, 0, "swap", 1.0, 2.0]]),
                           run([])],
                  "drop": [{}, {}],
                  "auto": [run([[1.0, 0, "drop", 1.0, 1.5]]), run([[1.0, 0, "swap", 4.0, 2.0]])]}}
    rows = _audit_table(d)
    assert rows[2:] == ["| swap | swap | 3 / 0 | 2.00 / - |", "| auto | drop | 1 / 0 | 1.50 / - |",
                        "| auto | swap | 0 / 1 | - / 0.50 |"]


def test_drops_before_learning_counts_the_drops_before_drop_is_first_scaled():
    from tidal.experiments.auto_page import drops_before_learning

    run = {"choices": [[1.0, 0, "drop"], [2.0, 1, "swap"], [3.0, 2, "drop"], [9.0, 3, "drop"]],
           "choice_reasons": ["drop predicted 1 s, least (next: swap 2 s)",
                              "swap predicted 2 s, least (next: drop 3 s)",
                              "drop predicted 1 s, least (next: swap 2 s (2 x 1 learned))",  # swap's scale, not drop's
                              "drop predicted 2 s (1 x 2 learned), least (next: swap 3 s)"]}
    assert drops_before_learning(run) == 2
    assert drops_before_learning({"choices": [[1.0, 0, "swap"]], "choice_reasons": ["swap ..."]}) is None


def test_the_readme_line_is_read_off_the_committed_json():
    """README's auto line says what docs/results/auto/auto_sim.json says (regenerated with the page)."""
    import pathlib

    from tidal.experiments.auto_page import readme_line

    root = pathlib.Path(__file__).resolve().parents[2]
    line = readme_line(json.loads((root / "docs/results/auto/auto_sim.json").read_text()))
    assert line.startswith(("recommended.", "not recommended."))
    assert " ".join(line.split()) in " ".join((root / "README.md").read_text().split())


def test_the_readme_line_recommends_only_when_every_claim_holds():
    from tidal.experiments.auto_page import readme_line

    def level(verdict):
        return {"judged": {"phases": {"a": {"verdict": verdict, "per_seed": [{"auto_over_best": 1.0}]}},
                           "whole": {"swap": {"verdict": verdict, "per_seed": [1.25]},
                                     "drop": {"verdict": verdict, "per_seed": [2.0]}},
                           "one_best": [["swap"]]}}
    assert readme_line({"trace": {"levels": {"paper rule": level("holds")}}}).startswith("recommended.")
    line = readme_line({"trace": {"levels": {"paper rule": level("tie")}}})
    assert line.startswith("not recommended.") and "in every phase in 1 of 1 load-seed pairs" in line
    assert "1.00-1.00x the best fixed choice's per phase and 0.80-0.80x over the trace" in line  # 1 / 1.25
    # with the hindsight bound, the line says on how many pairs it meets the bar (instead of one_best's count)
    lv = level("tie") | {"bounds": {"hindsight": {"judged": {"whole": {"swap": {"per_seed": [1.1]},
                                                                       "drop": {"per_seed": [1.3]}}}}}}
    line = readme_line({"trace": {"levels": {"paper rule": lv}}})
    assert "each phase's best, pinned in hindsight, beats them all by 1.2x in 0 of 1 load-seed pairs" in line
