"""What ``tidal bench sim-kunserve`` reads off its runs, by hand: the SLO-violation curves (Fig. 13's
last column), the stage-gap fit to Sec. 5.3's bubbles, and the extreme burst's arrivals and memory
limits (Fig. 16)."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.experiments import kunserve_extreme as X
from tidal.experiments import kunserve_pipeline_fit as PF
from tidal.experiments import kunserve_slo as SLO


def test_slo_curves_scale_the_best_baselines_p50_and_count_misses():
    reqs = {
        "A": {"ttft": [1.0, 1.0, 3.0, None], "tpot": [0.1, 0.1, 0.1, None]},  # P50 TTFT 1.0, TPOT 0.1; one unfinished
        "B": {"ttft": [2.0, 2.0, 2.0, 2.0], "tpot": [0.05, 0.05, 0.05, 0.5]},  # P50 TTFT 2.0, TPOT 0.05 (the lowest)
        "T": {"ttft": [1.0, 1.5, 2.5, 1.0], "tpot": [0.05, 0.2, None, 0.05]},  # the technique; one single-token reply
    }
    c = SLO.curves(reqs, ["A", "B"], scales=(1, 2, 3))
    assert c["ref_p50_ttft_s"] == 1.0 and c["ref_p50_tpot_s"] == 0.05  # each the lowest among the baselines
    # scale 1: SLO 1.0 s / 0.05 s: A misses all (TPOT 0.1 > 0.05, unfinished), B all (TTFT 2.0), T 2 of 4
    # scale 2 (2 s / 0.1 s): A's 3 s and its unfinished one miss; scale 3: only the unfinished one
    assert c["systems"]["A"]["violation"] == [1.0, 0.5, 0.25]
    assert c["systems"]["B"]["violation"] == [1.0, 0.25, 0.25]  # its TPOT 0.5 misses up to scale 9
    assert c["systems"]["T"]["violation"] == [0.5, 0.5, 0.25]  # 2.5 s with no TPOT passes at 3; TPOT 0.2 at 4
    ratio, best, red = SLO.attainment_ratio(c, "T", ["A", "B"])
    assert best == "B" and red == pytest.approx(np.mean([1.0, 0.25, 0.25]) - np.mean([0.5, 0.5, 0.25]))
    assert ratio == pytest.approx((1 - np.mean([0.5, 0.5, 0.25])) / (1 - np.mean([1.0, 0.25, 0.25])))
    with pytest.raises(ValueError, match="at least one baseline"):
        SLO.curves(reqs, ["C"])


def test_the_stage_gap_fit_is_least_squares_on_the_interpolated_bubbles():
    # bubbles grow linearly with the gap: lookahead 2 %/ms from 0, token-count from 10 %; the targets (8.3, 21.9)
    # sit 13.6 points apart, the curves 10 apart: the fit splits the 3.6-point miss evenly
    grid = [0.0, 0.004, 0.008]
    pts = {"lookahead": [(g, 20 * g) for g in grid], "token-count": [(g, 0.1 + 20 * g) for g in grid]}
    fit = PF.fit_stage_gap(pts)
    want = ((0.083 + 0.219 - 0.1) / 2) / 20  # least squares of (20g - .083)^2 + (.1 + 20g - .219)^2
    assert fit["gap_s"] == pytest.approx(want, abs=1e-5)
    assert fit["error"]["lookahead"] == pytest.approx(-fit["error"]["token-count"], abs=1e-4)
    assert not fit["at_grid_edge"] and fit["grid"]["lookahead"] == [[g, b] for g, b in pts["lookahead"]]
    none = PF.fit_stage_gap({"lookahead": [(0.0, None), (0.004, None)], "token-count": pts["token-count"]})
    assert none["gap_s"] is None and "lookahead" in none["reason"]


def test_the_extreme_burst_replays_the_first_window_of_twice_the_mean():
    w = X.WINDOW_S
    # 1 req/s for 3 windows, 3 req/s in the fourth, 1 req/s after: mean 1.4 req/s over 100 s; the fourth is >= 2x
    times = np.sort(np.concatenate([np.arange(0, 3 * w, 1.0), 3 * w + np.arange(0, w, 1 / 3), np.arange(4 * w, 5 * w)]))
    assert X.first_burst(times, 5 * w) == 3
    ext, start = X.extreme_times(times, 5 * w, extreme_s=2.5 * w)
    assert start == 3 * w
    assert np.array_equal(ext[ext < start], times[times < start])  # as it was until the burst
    after = ext[ext >= start]
    assert len(after) == 60 + 60 + 30 and after.max() < start + 2.5 * w  # the burst's 60 arrivals, 2.5 times
    assert np.allclose(after[60:120] - w, after[:60])
    flat = np.arange(0, 5 * w, 1.0)  # no window of 2x the mean: the busiest (the first of equals)
    assert X.first_burst(flat, 5 * w) == 0


def test_memory_limits_freed_bytes_and_the_window_slo():
    ev = [{"kind": "throttle", "time": 5.0, "instances": [0]},  # before the burst: not counted
          {"kind": "throttle", "time": 32.0, "instances": [1]},
          {"kind": "drop", "time": 33.0, "instances": [0, 1], "freed_bytes": 100},
          {"kind": "autoscale", "time": 40.0, "instances": [0], "reason": "KV use still rising after a drop"},
          {"kind": "drop", "time": 50.0, "instances": [0, 1, 2, 3], "freed_bytes": 50},
          {"kind": "autoscale", "time": 61.0, "instances": [2], "reason": "throttled and no drop plan"},
          {"kind": "drop", "time": 70.0, "instances": [4, 5], "freed_bytes": 7}]
    assert X.memory_limit(ev, 20.0, "preempt") == 32.0
    assert X.memory_limit(ev, 20.0, "drop") == 61.0  # not the rising-use signal: no plan left
    assert X.memory_limit(ev, 62.0, "drop") is None
    assert X.freed(ev, 61.0) == (2, 150) and X.freed(ev, None) == (3, 157)
    reqs = {"arrival": [0.0, 10.0, 11.0, 12.0, 30.0], "ttft": [9.0, 1.0, None, 6.0, 1.0],
            "tpot": [0.1, 0.1, None, 0.1, 0.1]}
    w = X.window_slo(reqs, 10.0, 20.0, ttft_slo=5.0, tpot_slo=0.2)
    assert w["requests"] == 3 and w["attainment"] == pytest.approx(1 / 3) and w["max_ttft_s"] == float("inf")
    assert X.window_slo(reqs, 40.0, 50.0, 5.0, 0.2) == {"requests": 0, "attainment": None, "max_ttft_s": None}
