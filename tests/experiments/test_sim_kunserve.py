"""``tidal bench sim-kunserve``: its bursty arrivals, its workloads, and one short run end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.workload.test_workloads import needs_traces
from tidal.cli import build_parser
from tidal.experiments import kunserve_runs as K
from tidal.experiments import sim_kunserve as S


def test_bursty_arrivals_keep_the_mean_rate_and_burst_per_window():
    t = S.bursty_arrivals(np.random.default_rng(0), 4000.0, 5.0)
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 4000
    assert abs(len(t) / 4000.0 - 5.0) / 5.0 < 0.15  # the window factors have mean 1
    counts = np.histogram(t, bins=np.arange(0, 4000 + 1, S.WINDOW_S))[0]
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


def test_one_short_run_writes_every_system_per_seed_and_the_ratios(tmp_path, capsys):
    out = tmp_path / "k.json"
    args = build_parser().parse_args(["bench", "sim-kunserve", "--datasets", "longbench", "--duration", "20",
                                      "--rate", "10", "--seeds", "6,4,5", "--probes", "1", "--probe-duration", "10",
                                      "--systems", "vllm,vllm-pp,drop,calibrated", "--fit-gaps", "0,16",
                                      "--no-shrunken-pool", "--jobs", "2", "--output", str(out), "--no-plots",
                                      "--no-progress"])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    d = r["datasets"]["longbench"]
    labels = {S.KEYS[k] for k in ("vllm", "vllm-pp", "drop", "calibrated")}
    assert set(d["systems"]) == labels and d["rate"] == 10 and d["seeds"] == [6, 4, 5]
    g = d["regime"]  # the rate was given; the pool is the default one (0.9 of the GPU)
    assert g["search"] is None and g["rate_source"] == "given (--rate)" and g["gpu_memory_share"] > 0.8
    assert g["num_blocks"] == K.default_blocks("a") and len(g["per_seed"]) == 3 and g["capacity"]["capacity"] > 0
    assert g["compute_bound"] == (g["capacity"]["capacity"] < 10) and 0.2 < g["freed_over_pool"]["2"] < 0.5
    for s in d["systems"].values():
        assert len(s["per_seed"]) == 3
        for n, run in zip(d["num_requests"], s["per_seed"], strict=True):
            assert run["completed"] + run["failed"] == n and run["lost"] == n - run["completed"]
            assert "timelines" not in run and "requests" not in run
        assert s["median"]["ttft_ms"]["p99"] == sorted(x["ttft_ms"]["p99"] for x in s["per_seed"])[1]
    pp = d["systems"][S.KEYS["vllm-pp"]]["per_seed"][0]
    assert pp["pressure"]["mode"] == "pp" and pp["bubble_ratio"] is not None  # pipelines from the start
    assert not d["systems"][S.KEYS["vllm"]]["per_seed"][0]["participation"]["drops"]  # only drop drops
    # the per-seed ratios every claim is judged on, computed from the per-seed runs
    drop = d["systems"][K.DROP]["per_seed"]
    for base in (S.KEYS["vllm"], S.KEYS["vllm-pp"]):
        want = [b["ttft_ms"]["p99"] / x["ttft_ms"]["p99"] for b, x in zip(d["systems"][base]["per_seed"], drop,
                                                                          strict=True)]
        assert d["ratios"]["p99_ttft"][base] == pytest.approx(want)
    assert "lookahead_p99_ttft" not in d["ratios"] and len(d["slo"]["attainment_ratio"]) == 3
    assert set(d["slo"]["mean_violation"]) == {S.KEYS["vllm"], S.KEYS["vllm-pp"], K.DROP}
    fit = r["pipeline_fit"]  # the stage gap fitted between the grid's ends, and the calibrated runs with it
    assert fit["dataset"] == "longbench" and fit["targets"] == {"lookahead": 0.083, "token-count": 0.219}
    assert 0.0 <= fit["gap_s"] <= 0.016 and [g for g, _ in fit["grid"]["lookahead"]] == [0.0, 0.016]
    cal = d["systems"][K.CALIBRATED]["per_seed"]
    assert all(x["bubble_ratio"] is None or x["bubble_ratio"] >= y["bubble_ratio"] - 0.02 for x, y in zip(cal, drop,
                                                                                                       strict=True)
               if y["bubble_ratio"] is not None)
    # the first seed's per-instance timelines of every system, beside the JSON
    tl = json.loads((tmp_path / "k_timelines.json").read_text())
    assert r["timelines_json"] == "k_timelines.json" and set(tl["datasets"]["longbench"]) <= labels
    for label, s in tl["datasets"]["longbench"].items():
        assert len(s["instances"]) == 8 and s["participation"] == d["systems"][label]["per_seed"][0]["participation"]
        for inst in s["instances"]:
            assert len(inst["t"]) == len(inst["kv_usage"]) == len(inst["waiting"]) and 0 < len(inst["t"]) <= 400
    assert r["setup"]["hardware"] == "a800-80g" and r["setup"]["link"] == "ib-hdr" and r["setup"]["router"] == "llumnix"
    text = capsys.readouterr().out
    assert "KunServe (drop)" in text and "12.7-72.2x" in text


def test_cluster_b_runs_the_72b_at_tp4_and_the_extreme_burst(tmp_path):
    out = tmp_path / "b.json"
    args = build_parser().parse_args(["bench", "sim-kunserve", "--cluster", "b", "--duration", "30", "--rate", "2",
                                      "--seeds", "0,1,2", "--probes", "1", "--probe-duration", "20", "--systems",
                                      "vllm,drop", "--extreme-s", "30", "--jobs", "2", "--output", str(out),
                                      "--no-plots", "--no-progress"])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert (r["setup"]["model"], r["setup"]["hardware"], r["setup"]["tp"], r["setup"]["instances"]) == (
        "qwen-2.5-72b", "h800-80g", 4, 4) and r["setup"]["link"] == "ib-ndr"
    assert list(r["datasets"]) == ["longbench"] and "shrunken_pool" not in r["datasets"]["longbench"]
    ex = r["extreme_burst"]
    assert ex["dataset"] == "longbench" and ex["extreme_s"] == 30 and len(ex["per_seed"]) == 3
    for e in ex["per_seed"]:
        assert e["burst_start_s"] % 20 == 0 and e["burst_start_s"] < 30
        lo, hi = e["slo"]["window_s"]
        assert lo == e["burst_start_s"] and hi == (e["drop_limit_s"] if e["drop_limit_s"] is not None else lo + 30)
        for lim, cens in ((e["vllm_limit_s"], e["vllm_limit_censored"]), (e["drop_limit_s"], e["drop_limit_censored"])):
            assert (lim is None) == cens and (lim is None or lim >= e["burst_start_s"])
        assert e["sustain_ratio"] > 0 and e["freed_over_pool"] >= 0


@pytest.mark.parametrize("argv,needle", [
    (["--datasets", "alpaca"], "unknown dataset 'alpaca'"),
    (["--systems", "vllm,drop,sarathi"], "unknown system 'sarathi'"),
    (["--systems", "swap,drop"], "--systems needs vllm and drop"),
    (["--seeds", "0,0"], "--seeds needs distinct seeds"),
    (["--seeds", "a"], "comma lists of numbers"),
])
def test_bad_arguments_are_one_line(capsys, argv, needle):
    args = build_parser().parse_args(["bench", "sim-kunserve", *argv])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
