"""KunServe's memory-bound regime (issue 40): the capacity probe, the mean rate under it, the pool
sized from the mean KV in use, Azure arrivals, and the drop participation counts."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.experiments import kunserve_regime as R
from tidal.experiments import kunserve_runs as K
from tidal.experiments import kunserve_timelines as TL


def fluid_queue(capacity: float, instances: int = 2, dt: float = 0.5):
    """A cluster that serves ``capacity`` req/s: its queue grows at (rate - capacity) when over."""
    def run(rate: float, duration: float) -> list[dict]:
        t = np.arange(0.0, duration, dt)
        w = np.maximum(0.0, (rate - capacity) * t) / instances
        return [{"t": list(t), "waiting": list(w)} for _ in range(instances)]
    return run


@pytest.mark.parametrize("capacity", [3.3, 17.0, 55.0])
def test_the_probe_brackets_the_capacity_and_meets_its_definition(capacity):
    run = fluid_queue(capacity)
    p = R.probe_capacity(run, initial_rate=10.0, duration_s=120.0, probes=8)
    cap, over = p["capacity"], p["falls_behind_at"]
    assert over is not None and cap < over
    assert R.keeps_up(run(cap, 120.0), cap, 120.0)[0] and not R.keeps_up(run(over, 120.0), over, 120.0)[0]
    # the definition's tolerance: a queue growing by at most 3 % of the arrivals (plus one per instance) passes
    assert capacity * 0.9 <= cap <= capacity * 1.04 + 0.1


def test_the_probe_says_when_nothing_keeps_up():
    with pytest.raises(R.RegimeError, match="no rate the cluster keeps up with"):
        R.probe_capacity(fluid_queue(0.01), initial_rate=10.0, duration_s=60.0, probes=3)


def test_the_simulated_probe_finds_a_rate_it_keeps_up_with_and_more_it_does_not():
    p = R.probe_capacity(lambda r, d: K.probe_timelines("a", "longbench", 0, "llumnix", r, d), 4.0, 30.0, 3)
    cap = p["capacity"]
    assert [t["keeps_up"] for t in p["probes"]] == [t["rate"] <= cap for t in p["probes"]]
    ok = K.probe_timelines("a", "longbench", 1, "llumnix", 0.85 * cap, 45.0)  # other arrivals, a longer run
    assert R.keeps_up(ok, 0.85 * cap, 45.0)[0]
    over = K.probe_timelines("a", "longbench", 1, "llumnix", 1.7 * cap, 45.0)
    assert not R.keeps_up(over, 1.7 * cap, 45.0)[0]


def test_the_mean_rate_keeps_every_window_under_the_share_of_capacity():
    gen = lambda r: R.bursty_arrivals(np.random.default_rng(3), 300.0, r)  # noqa: E731
    rate, peak = R.rate_under_capacity(40.0, gen, 300.0)
    windows = R.window_rates(gen(rate), 300.0)
    assert windows.max() == pytest.approx(peak) and peak <= 0.85 * 40.0
    assert windows.max() > windows.mean() * 1.5  # the bursts remain: the mean is well under the peak
    assert R.window_rates(gen(rate * 1.05), 300.0).max() > 0.85 * 40.0  # a little more breaks it


def test_the_mean_rate_over_several_seeds_keeps_every_seeds_windows_under_the_share():
    """Several seeds' arrivals: the rate is one, and the busiest window of any seed is under the share."""
    gens = [lambda r, k=k: R.bursty_arrivals(np.random.default_rng(k), 300.0, r) for k in (3, 4, 5)]
    rate, peak = R.rate_under_capacity(40.0, lambda r: [g(r) for g in gens], 300.0)
    peaks = [R.window_rates(g(rate), 300.0).max() for g in gens]
    assert max(peaks) == pytest.approx(peak) and peak <= 0.85 * 40.0
    alone = [R.rate_under_capacity(40.0, g, 300.0)[0] for g in gens]
    assert rate <= min(alone) + 1e-9  # above a seed's own rate, that seed's busiest window is over the share


def test_the_demand_search_brackets_then_bisects_to_the_highest_rate_within_the_share():
    """The paper's 60 % rule on a demand that grows as rate / 10 (crossing 60 % at 6 req/s): up 1.5x
    from 2 until over, then halves the bracket until it is 3 % wide; every probe is kept."""
    s = R.DemandSearch(2.0)
    while (rate := s.next_rate()) is not None:
        s.record(rate, rate / 10)
    out = s.result()
    lo, hi = out["bracket"]
    assert lo <= 6.0 < hi and (hi - lo) / hi <= R.SEARCH_TOLERANCE and out["rate"] == lo
    rates = [p["rate"] for p in out["probes"]]  # sorted by rate
    assert rates[:3] == [2.0, 3.0, 4.5] and 6.75 in rates and rates == sorted(rates)
    assert all(p["within"] == (p["mean_kv_demand"] <= 0.6) for p in out["probes"]) and out["share"] == 0.6
    down = R.DemandSearch(10.0, max_probes=4)  # over the share from the start: it shrinks 1.5x
    while (rate := down.next_rate()) is not None:
        down.record(rate, rate / 10)
    assert [p["rate"] for p in down.result()["probes"]] == pytest.approx(sorted([10.0, 10 / 1.5, 10 / 1.5**2,
                                                                                  (10 / 1.5 + 10 / 1.5**2) / 2]))
    never = R.DemandSearch(1.0, max_probes=2)
    while (rate := never.next_rate()) is not None:
        never.record(rate, 0.9)
    with pytest.raises(R.RegimeError, match="at or under 60% of the pool"):
        never.result()
    with pytest.raises(ValueError):
        R.DemandSearch(0.0)


def _azure_csv(path, times):
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t in times:
        whole = int(t)
        rows.append(f"2023-11-16 18:{15 + whole // 60:02d}:{whole % 60:02d}.{int(round((t - whole) * 1e7)):07d},100,10")
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_azure_arrivals_rescale_a_trace_to_the_mean_rate_and_keep_its_gaps(tmp_path):
    rng = np.random.default_rng(0)
    times = np.cumsum(rng.gamma(0.3, 1.0 / 0.3, size=300))  # a bursty hour in miniature, ~1 req/s
    path = _azure_csv(tmp_path / "conv.csv", times)
    out = R.azure_arrivals(path, 60.0, 4.0)
    assert len(out) == 240 and out[0] == 0 and out[-1] < 60.0  # 4 req/s over 60 s
    orig = np.diff(np.round(times[:241], 6))
    assert np.allclose(np.diff(out), orig[:239] * (out[-1] / np.sum(orig[:239])), rtol=1e-4, atol=1e-6)
    with pytest.raises(R.RegimeError, match="holds 300 arrivals"):
        R.azure_arrivals(path, 60.0, 10.0)
    specs = K.workload("burstgpt", 60.0, 4.0, 0, "azure", path)  # lengths from the dataset, times from the trace
    assert [s.arrival_s for s in specs] == pytest.approx(list(out))
    assert 400 < np.mean([s.prompt_len for s in specs]) < 900


def test_a_missing_trace_is_a_clear_error(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "nope.csv")
    monkeypatch.setenv(R.AZURE_ENV, missing)
    with pytest.raises(R.RegimeError, match="--azure-trace PATH or set TIDAL_AZURE_TRACE"):
        R.azure_trace_path()
    from tidal.cli import build_parser

    args = build_parser().parse_args(["bench", "sim-kunserve", "--arrivals", "azure", "--datasets", "burstgpt"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.csv does not exist" in err


def test_the_pool_is_twice_the_time_mean_in_use():
    tl = [{"t": [0.0, 10.0, 20.0, 30.0], "kv_usage": [0.1, 0.3, 0.1, 0.9]},  # held: 0.1, 0.3, 0.1 for 10 s each
          {"t": [0.0, 30.0], "kv_usage": [0.2, 0.2]}]
    kv = R.kv_in_use(tl, 1000)
    assert kv["mean_blocks"] == pytest.approx((500 / 3 + 200) / 2) and kv["peak_blocks"] == pytest.approx(900)
    assert R.pool_blocks(kv["mean_blocks"]) == round(2 * kv["mean_blocks"])


def test_participation_counts_onsets_answered_by_a_drop():
    ev = [{"kind": "throttle", "time": 1.0, "instances": [0]},
          {"kind": "throttle", "time": 1.5, "instances": [3]},
          {"kind": "drop", "time": 2.0, "instances": [0, 1]},
          {"kind": "throttle", "time": 5.0, "instances": [0, 1]},  # the group throttles again: never answered
          {"kind": "throttle", "time": 6.0, "instances": [2]},
          {"kind": "drop", "time": 7.0, "instances": [2, 3]},  # answers 2's onset; 3's onset at 1.5 too (no later one)
          {"kind": "migrate", "time": 8.0, "instances": [1, 2]}]
    p = TL.participation(ev, 5)
    assert p["throttled"] == [0, 1, 2, 3] and p["in_a_drop"] == [0, 1, 2, 3]
    assert p["throttled_never_in_a_drop"] == []
    assert p["per_instance"]["0"] == {"throttle_onsets": 2, "drops": 1, "onsets_answered": 1}
    assert p["per_instance"]["1"] == {"throttle_onsets": 1, "drops": 1, "onsets_answered": 0}
    assert p["per_instance"]["3"] == {"throttle_onsets": 1, "drops": 1, "onsets_answered": 1}
    assert p["per_instance"]["4"] == {"throttle_onsets": 0, "drops": 0, "onsets_answered": 0}
    assert (p["throttle_onsets"], p["onsets_answered"]) == (5, 3)
    assert [d["instances"] for d in p["drops"]] == [[0, 1], [2, 3]]
    q = TL.participation([{"kind": "throttle", "time": 1.0, "instances": [4]}], 5)
    assert q["throttled_never_in_a_drop"] == [4] and q["onsets_answered"] == 0
    late = TL.participation([{"kind": "throttle", "time": 1.0, "instances": [4]},  # a drop long after: not an answer
                             {"kind": "drop", "time": 1.0 + TL.ANSWER_S, "instances": [3, 4]}], 5)
    assert late["onsets_answered"] == 0 and late["throttled_never_in_a_drop"] == []


def test_downsample_keeps_the_ends_and_at_most_the_points():
    tl = {"t": list(np.arange(1000.0)), "kv_usage": list(np.linspace(0, 1, 1000)), "waiting": list(range(1000))}
    d = TL.downsample(tl, 50)
    assert len(d["t"]) == 50 and d["t"][0] == 0 and d["t"][-1] == 999 and d["waiting"][-1] == 999
    assert d["kv_usage"][-1] == 1.0 and "running" not in d


def test_the_real_runs_arrivals_are_the_ones_bench_serve_sends():
    """The real run picks its rate on the arrivals ``tidal bench serve`` will send: the same options."""
    from dataclasses import replace

    from tidal import workload as W
    from tidal.bench.serve import _workload_options
    from tidal.cli import build_parser
    from tidal.experiments.kunserve_real import RealSetup

    s = replace(RealSetup(), rate=0.4)
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://x", "--workload", s.workload,
                                      "--max-input-len", str(s.max_input_len), "--max-output-len",
                                      str(s.max_output_len), "--num-requests", str(s.num_requests), "--rate", "0.4",
                                      "--burstiness", str(s.burstiness), "--seed", "2"])
    sent = [r.arrival_s for r in W.make_requests(_workload_options(args, args.rate, args.num_requests))]
    assert list(s.arrivals(0.4, 2)) == pytest.approx(sent) and len(sent) == s.num_requests
    assert list(s.arrivals(0.4, 1)) != pytest.approx(sent)  # the seed is the draw


def test_the_real_pool_is_read_from_the_sampled_state():
    from tidal.experiments.kunserve_real import kv_in_use

    samples = [{"t": t, "instances": [{"index": 0, "num_blocks": 100, "num_free_blocks": 100 - u0},
                                      {"index": 1, "num_blocks": 100, "num_free_blocks": 100 - u1}]}
               for t, u0, u1 in ((0.0, 10, 0), (1.0, 30, 20), (2.0, 50, 40))]
    kv = kv_in_use(samples)
    # instance 0 holds 10 then 30 for a second each (mean 20), instance 1 0 then 20 (mean 10)
    assert kv["mean_blocks"] == pytest.approx(15) and kv["peak_blocks"] == pytest.approx(50)
    assert kv["num_blocks"] == 100
    with pytest.raises(RuntimeError, match="no instance state"):
        kv_in_use([{"t": 0.0, "instances": []}])
