"""The GPU check's performance-page records (benchmarks/results/*-gpu-check-*.json) are what
``benchmarks/gpu_check.py --summarize`` makes of the raw reports kept in benchmarks/gpu/: the page's GPU
figures come from those artifacts through that command, not from a hand edit."""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gpu_record():
    spec = importlib.util.spec_from_file_location("gpu_record", os.path.join(ROOT, "benchmarks", "gpu_record.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REPORTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "gpu", "*-gpu-check-*.json")))


@pytest.mark.parametrize("report", REPORTS, ids=os.path.basename)
def test_record_is_the_summary_of_its_report(gpu_record, report, tmp_path):
    record_path = os.path.join(ROOT, "benchmarks", "results", os.path.basename(report))
    with open(record_path) as f:
        record = json.load(f)
    with open(report) as f:
        raw = json.load(f)
    assert record["figures"] == gpu_record.figures(raw)
    dst = tmp_path / "r.json"
    gpu_record.write_record(raw, str(dst), None, record.get("notes"), record.get("title"))
    again = json.loads(dst.read_text())
    assert {k: again[k] for k in ("figures", "command", "date", "title", "notes")} == \
           {k: record[k] for k in ("figures", "command", "date", "title", "notes")}


def test_there_are_reports_and_every_row_names_a_figure(gpu_record):
    assert len(REPORTS) >= 2
    for report in REPORTS:
        with open(report) as f:
            rows = gpu_record.figures(json.load(f))
        assert rows and all(len(r) == 2 and r[0] and r[1] for r in rows)


def test_figures_of_a_report_with_a_baseline(gpu_record):
    """The offline rows give each tree's out tok/s and its ratio to the baseline's."""
    summary = {"b": {"output_tok_s": {"tidal": 100.0}}}
    report = {"offline": {"before": {"result": {"summary": summary, "tree": {"commit": "aaa"}}},
                          "after": {"result": {"summary": {"b": {"output_tok_s": {"tidal": 130.0}}},
                                               "tree": {"commit": "bbb"}}}},
              "serve": {"result": {"one": {"equal_to_one_instance": 6, "of": 6},
                                   "split": {"equal_to_one_instance": 5, "of": 6}, "tree": {"commit": "bbb"}}}}
    rows = dict(gpu_record.figures(report))
    assert rows["tidal bench offline, out tok/s, tree before (tidal aaa)"] == "(b) 100.0"
    assert rows["tidal bench offline, out tok/s, tree after (tidal bbb)"] == "(b) 130.0 = 1.30x before"
    assert rows["tidal serve answers equal to one instance, 1B shape (tidal bbb)"] == "one 6/6; split 5/6"
