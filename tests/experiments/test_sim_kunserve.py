"""``tidal bench sim-kunserve``: its bursty arrivals, its workloads, and one short run end to end."""

from __future__ import annotations

import json

import numpy as np

from tests.workload.test_workloads import needs_traces
from tidal.cli import build_parser
from tidal.experiments import sim_kunserve as K


def test_bursty_arrivals_keep_the_mean_rate_and_burst_per_window():
    t = K.bursty_arrivals(np.random.default_rng(0), 4000.0, 5.0)
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 4000
    assert abs(len(t) / 4000.0 - 5.0) / 5.0 < 0.15  # the window factors have mean 1
    counts = np.histogram(t, bins=np.arange(0, 4000 + 1, K.WINDOW_S))[0]
    # a Gamma(2) rate per window: counts vary far more than a Poisson process's (cv 1 / sqrt(100) = 0.1)
    assert counts.std() / counts.mean() > 0.5
    assert counts.max() > 2 * counts.mean()  # bursts of more than twice the mean rate


def test_workloads_have_the_papers_lengths():
    lb = K.workload("longbench", 600.0, 2.0, 0)
    assert 5000 < np.mean([s.prompt_len for s in lb]) < 6500 and max(s.prompt_len for s in lb) <= 16384
    bg = K.workload("burstgpt", 300.0, 4.0, 0)
    assert 500 < np.mean([s.prompt_len for s in bg]) < 800


@needs_traces
def test_sharegpt_has_the_real_lengths_capped_at_4k():
    sg = K.workload("sharegpt", 300.0, 4.0, 0)  # the real ShareGPT lengths, inputs capped at 4K as in the paper
    assert max(s.prompt_len for s in sg) <= 4096 and np.mean([s.prompt_len for s in sg]) > 100


def test_one_short_run_writes_every_system_and_the_ratios(tmp_path, capsys):
    out = tmp_path / "k.json"
    args = build_parser().parse_args(["bench", "sim-kunserve", "--datasets", "longbench", "--duration", "30",
                                      "--rate", "6", "--jobs", "2", "--output", str(out), "--no-plots", "--no-progress"])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    d = r["datasets"]["longbench"]
    assert set(d["systems"]) == set(K.SYSTEMS) and d["rate"] == 6
    g = d["regime"]  # the rate was given; the pool is 2x vLLM's mean KV in use with an unlimited pool
    assert g["capacity"] is None and g["num_blocks"] == round(2 * g["unlimited_mean_blocks"])
    assert g["unlimited_peak_blocks"] >= g["unlimited_mean_blocks"] > 0
    for s in d["systems"].values():
        assert s["completed"] + s["failed"] == d["num_requests"] and "timelines" not in s
        assert s["lost"] == d["num_requests"] - s["completed"]
        p = s["participation"]
        assert p["throttled_never_in_a_drop"] == sorted(set(p["throttled"]) - set(p["in_a_drop"]))
    assert not d["systems"]["vLLM (preempt: recompute)"]["participation"]["drops"]  # only drop drops
    # the per-instance timelines of every system, beside the JSON
    tl = json.loads((tmp_path / "k_timelines.json").read_text())
    assert r["timelines_json"] == "k_timelines.json"
    for label, s in tl["datasets"]["longbench"].items():
        assert len(s["instances"]) == K.INSTANCES and s["participation"] == d["systems"][label]["participation"]
        for inst in s["instances"]:
            assert len(inst["t"]) == len(inst["kv_usage"]) == len(inst["waiting"]) and 0 < len(inst["t"]) <= 400
            assert all(b >= a for a, b in zip(inst["t"], inst["t"][1:], strict=False))
    assert set(d["p99_ttft_gain_over"]) == set(K.BASELINES)
    assert r["setup"]["hardware"] == "a800-80g" and r["setup"]["link"] == "ib-hdr"
    text = capsys.readouterr().out
    assert "KunServe (drop)" in text and "12.7-72.2x" in text


def test_an_unknown_dataset_is_one_line(capsys):
    args = build_parser().parse_args(["bench", "sim-kunserve", "--datasets", "alpaca"])
    assert args.func(args) == 2
    assert "unknown dataset 'alpaca'" in capsys.readouterr().err
