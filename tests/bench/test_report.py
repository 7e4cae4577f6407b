"""``tidal bench report``: docs/performance.md and the README's table come from benchmarks/results/*.json
and nothing else; runs group by machine, newest first, superseded runs below the current ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.bench import offline as ob
from tidal.bench import report as R
from tidal.cli import main

REPO = Path(__file__).resolve().parents[2]
XEON = {"cpu_model": "Intel Xeon Test", "isa": ["avx2", "avx512f"], "cores": 2, "dtype": "float32", "device": "cpu"}
EPYC = {"cpu_model": "AMD EPYC Test", "isa": ["avx2"], "cores": 4, "dtype": "float32", "device": "cpu"}


def test_committed_page_and_readme_table_are_what_the_committed_json_gives():
    runs = R.load_runs(str(REPO / "benchmarks" / "results"))
    assert len(runs) >= 10 and {r.kind for r in runs} >= {"offline", "figures"}
    assert (REPO / "docs" / "performance.md").read_text() == R.render_page(runs)
    readme = (REPO / "README.md").read_text()
    assert R.render_readme_block(runs) in readme
    assert R.splice(readme, R.render_readme_block(runs), "README.md") == readme


def test_check_mode_on_the_repository(monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["bench", "report", "--check"]) == 0


def _offline_run(machine: dict, date: str, walls: dict[str, dict[str, list[float]]]) -> dict:
    """A report shaped by `tidal bench offline`'s own code: rows from its _summarize, ratios from _ratios."""
    workloads = {}
    for w in ob.make_workloads(list(walls), vocab_size=1000):
        rows = {}
        for system, ws in walls[w.name].items():
            raw = {"wall": ws, "prefill": [], "tokens": [w.expected_output_tokens] * len(ws), "dec_toks": [],
                   "dec_secs": [], "steps": [], "other_cores": [None] * len(ws)}
            rows[system] = ob._summarize(system, w, raw, None, {})
        workloads[w.name] = {**w.summary(), "results": rows, "ratios": ob._ratios(rows)}
    systems = {s: {"status": "ok"} for w in walls.values() for s in w}
    return {"command": "tidal bench offline --repeats 2", "date": date, "tidal": {"version": "0.1.0", "commit": "abc"},
            "machine": machine, "systems": systems, "workloads": workloads}


def _write(folder: Path, name: str, data: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))


def test_page_groups_by_machine_newest_first_and_supersedes_by_workload(tmp_path):
    res = tmp_path / "results"
    _write(res, "old.json", _offline_run(XEON, "2026-01-01", {"b": {"tidal": [10.0, 12.0], "hf": [20.0, 30.0]},
                                                             "c": {"tidal": [2.0], "llamacpp": [3.0]}}))
    _write(res, "new.json", _offline_run(XEON, "2026-02-01T10:00:00+00:00",
                                         {"b": {"tidal": [5.0, 5.0], "hf": [20.0, 15.0], "llamacpp": [40.0, 30.0]}}))
    _write(res, "epyc.json", _offline_run(EPYC, "2026-01-15", {"a": {"tidal": [40.0], "hf": [100.0]}}))
    runs = R.load_runs(str(res))
    assert [r.path for r in runs] == ["old.json", "epyc.json", "new.json"]  # oldest first
    page = R.render_page(runs)

    # the Xeon (newest run) comes before the EPYC; within it the new run, then the old one
    xeon, epyc = page.index("## Intel Xeon Test, 2 cores, AVX-512"), page.index("## AMD EPYC Test, 4 cores, AVX2")
    assert xeon < epyc
    new, old = page.index("(../benchmarks/results/new.json)"), page.index("(../benchmarks/results/old.json)")
    assert xeon < new < old < epyc
    # the old run still holds the newest (c), so it stays current: no superseded section for the Xeon
    assert "### Superseded" not in page[xeon:epyc]
    # (b): medians 5.0 against hf 17.5 / llama.cpp 35.0 -> 3.50x hf; per repeat min peer / tidal: 4.00x, 3.00x
    new_block = page[new:old]
    assert "| (b) batch 32 x 128 -> 128 | 819.2 (5.00 s) | 234.1 (17.50 s) | 117.0 (35.00 s) | **3.50x** transformers" \
        in new_block
    assert "| 4.00x, 3.00x |" in new_block
    assert "tidal 0.1.0 abc" in new_block

    # the summary: the Xeon's newest (b) and its (c) from the older run; the EPYC's (a)
    table = R.summary_table(runs)
    assert table[2].startswith("| Intel Xeon Test, 2 cores, AVX-512, float32 | - | **3.50x** transformers "
                               "(2026-02-01T10:00:00+00:00) | **1.50x** llama.cpp (2026-01-01) |")
    assert table[3] == "| AMD EPYC Test, 4 cores, AVX2, float32 | **2.50x** transformers (2026-01-15) | - | - |"

    # a newer (c) on the Xeon supersedes the old run entirely
    _write(res, "newest.json", _offline_run(XEON, "2026-03-01", {"c": {"tidal": [1.0], "llamacpp": [3.0]}}))
    page = R.render_page(R.load_runs(str(res)))
    sup = page.index("### Superseded (1 run, newest first)")
    assert page.index("(../benchmarks/results/newest.json)") < page.index("(../benchmarks/results/new.json)") < sup
    assert sup < page.index("(../benchmarks/results/old.json)") < page.index("## AMD EPYC Test")


def test_non_default_workload_shapes_stay_out_of_the_summary(tmp_path):
    data = _offline_run(XEON, "2026-01-01", {"b": {"tidal": [1.0], "hf": [2.0]}})
    data["workloads"]["b"]["num_requests"] = 2  # --num-requests 2
    _write(tmp_path, "small.json", data)
    runs = R.load_runs(str(tmp_path))
    assert len(R.summary_table(runs)) == 2  # the header only
    assert "| (b) batch of 32, prompts of 128 tokens" in R.render_page(runs)


def test_figures_and_sim_records(tmp_path):
    _write(tmp_path, "fig.json", {"benchmark": "kernels", "title": "kernels against torch", "command": None,
                                  "date": "2026-01-01", "machine": EPYC, "figures": [["Q4_1 at 1 token", "5.4x"]],
                                  "recorded": {"how": "transcribed by hand", "order": 1}, "notes": "a note"})
    _write(tmp_path, "fig2.json", {"benchmark": "kernels", "title": "kernels, again", "command": "python k.py",
                                   "date": "2026-01-02", "machine": EPYC, "figures": [["Q4_1 at 1 token", "6.0x"]]})
    _write(tmp_path, "sim.json", {"command": "tidal sim --duration 3600", "date": "2026-01-03", "machine": EPYC,
                                  "simulated_time_s": 3600.0, "wall_time_s": 12.0, "speedup": 300.0})
    runs = R.load_runs(str(tmp_path))
    assert [r.kind for r in runs] == ["figures", "figures", "sim"]
    page = R.render_page(runs)
    assert "| 3600 s | 12.0 s | **300x** real time |" in page
    assert "| Q4_1 at 1 token | 6.0x |" in page and "*Recorded*: transcribed by hand." in page
    # the second kernels record supersedes the first; the sim run is a benchmark of its own
    sup = page.index("### Superseded")
    assert page.index("kernels, again") < sup < page.index("kernels against torch")
    assert page.index("tidal sim") < sup
    marked = {"benchmark": "old", "date": "2026-01-04", "machine": EPYC, "figures": [["x", "1"]], "superseded": True}
    _write(tmp_path, "marked.json", marked)
    current = R.current_runs(R.load_runs(str(tmp_path)))
    assert current == {"fig2.json", "sim.json"}  # "marked" would be current (a benchmark of its own) unmarked


def test_a_written_figures_record_is_on_the_page(tmp_path, capsys):
    from tidal.common.results import write_figures

    rec = write_figures(str(tmp_path / "bench.json"), "prefix caching: a test", "A test of figures",
                        "python benchmarks/x.py", [["TTFT cached / uncached", 0.036]], "a note", {"on": [1.0]})
    assert "  TTFT cached / uncached: 0.036" in capsys.readouterr().out
    (run,) = R.load_runs(str(tmp_path))
    assert run.kind == "figures" and run.data == rec and rec["command"].startswith("python benchmarks/x.py")
    assert "| TTFT cached / uncached | 0.036 |" in R.render_page([run])


@pytest.mark.parametrize("content, message", [
    ("{not json", "not readable JSON"),
    ('{"command": "x"}', "neither a `tidal bench offline` report"),
    ('{"workloads": {}, "systems": {}, "partial": true}', "a partial report"),
])
def test_a_bad_results_file_is_a_one_line_error(tmp_path, capsys, content, message):
    res = tmp_path / "results"
    res.mkdir()
    (res / "bad.json").write_text(content)
    rc = main(["bench", "report", "--results", str(res), "--output", str(tmp_path / "p.md"), "--readme", ""])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "bad.json" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.md").exists()


def test_writes_then_checks_and_needs_the_readme_markers(tmp_path, capsys):
    res = tmp_path / "results"
    _write(res, "r.json", _offline_run(EPYC, "2026-01-01", {"c": {"tidal": [1.0], "llamacpp": [2.0]}}))
    page, readme = tmp_path / "docs" / "performance.md", tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{R.README_BEGIN}\nstale\n{R.README_END}\nafter\n")
    args = ["bench", "report", "--results", str(res), "--output", str(page), "--readme", str(readme)]
    assert main([*args, "--check"]) == 1  # nothing written yet
    assert not page.exists() and "stale" in readme.read_text()
    assert main(args) == 0
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("\nafter\n")
    assert "| AMD EPYC Test, 4 cores, AVX2, float32 | - | - | **2.00x** llama.cpp (2026-01-01) |" in text
    assert page.read_text() == R.render_page(R.load_runs(str(res)))
    assert main([*args, "--check"]) == 0
    capsys.readouterr()
    readme.write_text("# no markers\n")
    assert main(args) == 2
    assert "has no" in capsys.readouterr().err


def test_run_stamp_names_the_date_and_the_commit():
    import subprocess
    from datetime import datetime

    from tidal.common.results import run_stamp

    stamp = run_stamp()
    assert datetime.fromisoformat(stamp["date"]).tzinfo is not None
    assert stamp["tidal"]["version"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: the commit is HEAD's
        assert head.stdout.startswith(stamp["tidal"]["commit"]) and isinstance(stamp["tidal"]["dirty"], bool)


def test_a_failed_system_is_a_cell_that_keeps_the_table():
    assert R._cell({"status": "failed", "reason": "RuntimeError: a|b"}) == "failed: RuntimeError: a/b"
    assert R._cell(None) == "-"
    assert R._cell({"status": "ok", "output_tok_s": 10.0, "wall_s": 2.5}) == "10.0 (2.50 s)"


def _chaos_run(mode: str, backend: str, lost: int, left_after_stop: list[int]) -> dict:
    from tidal.bench import soak

    s = {"duration_s": 60.2, "sent": 100, "completed": 70, "refused": 20, "refused_503": 20, "refused_429": 0,
         "failed": lost, "lost_streams": lost, "other_errors": 0, "leaked_kv_blocks": 0, "health_ok": True,
         "chaos": {"kills": 6, "back_after_s_mean": 9.04, "back_after_s_max": 12.0, "processes_left": 0,
                   "not_back": 0}}
    s["clean"] = soak.clean(s)
    return {"mode": mode, "backend": backend, "soak": s, "left_after_stop": left_after_stop, "server_exit_code": 0}


def test_a_chaos_soak_is_a_table_of_its_modes_with_the_totals(tmp_path):
    runs = [_chaos_run("colocate", "process", 0, []), _chaos_run("split", "ray", 2, [4242])]
    _write(tmp_path / "r", "chaos.json", {"benchmark": "tidal bench soak --chaos", "title": "chaos soak",
                                          "command": "python benchmarks/chaos_soak.py", "date": "2026-03-01",
                                          "machine": XEON, "runs": runs, "clean": False})
    loaded = R.load_runs(str(tmp_path / "r"))
    assert [r.kind for r in loaded] == ["chaos"]
    page = R.render_page(loaded)
    assert "| colocate | process | 60 | 6 | 9.0 / 12.0 | 100 | 70 | 20 | 0 | 0 | 0 | 0 | clean |" in page
    assert "| split | ray | 60 | 6 | 9.0 / 12.0 | 100 | 70 | 20 | 2 | 0 | 0 | 1 | **not clean** |" in page
    assert "| **all** | | 120 | 12 | | 200 | 140 | 40 | **2** | 0 | 0 | 1 | **not clean** |" in page
