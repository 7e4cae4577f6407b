"""KunServe's real column (2 CPU instances, several seeds): the runs' order and record, the
refusals of a record the claims cannot read, the cells and the README's figures per seed. The
runs themselves take minutes (``benchmarks/kunserve_serve.py``); here they are stood in for."""

import os
from dataclasses import replace

import pytest


def _kunserve_real(p99_by_seed):
    """A made-up kunserve_real.json: per seed, each system's P99 TTFT (2,000 ms where not given)."""
    from tidal.experiments.kunserve_real import SYSTEMS, RealSetup

    rows = [{"system": name, "key": key, "seed": seed, "ttft_p99_ms": p99.get(name, 2000.0), "goodput_tok_s": 50.0,
             "tpot_p50_ms": 30.0} for seed, p99 in p99_by_seed.items() for key, (name, _) in SYSTEMS.items()]
    setup = replace(RealSetup(), rate=0.5, kv_cache_memory=str(3 * 1024**2)).__dict__
    return {"setup": setup, "rows": rows, "complete": True,
            "regime": {"capacity": 1.25, "max_window_rate": 1.0, "max_window_share": 0.8, "num_blocks": 100,
                       "floor_blocks": 31, "unlimited_mean_blocks": 50.0, "unlimited_peak_blocks": 150}}


def test_kunserve_real_cell_reads_the_real_rows_per_seed():
    """The real column from the real runs' rows, paired by seed; a direction holds only on every seed
    (the runs themselves take minutes: benchmarks/kunserve_serve.py)."""
    from tidal.experiments.kunserve_claims import real_cell
    from tidal.experiments.kunserve_runs import DROP, SWAP, VLLM

    real = _kunserve_real({0: {VLLM: 9000.0, SWAP: 800.0, DROP: 1000.0}, 1: {VLLM: 3000.0, SWAP: 3000.0, DROP: 1500.0},
                           2: {VLLM: 4000.0, SWAP: 2020.0, DROP: 2000.0}})
    cell = real_cell(real, VLLM)
    assert "1,000 ms / 1,500 ms / 2,000 ms vs 9,000 ms / 3,000 ms / 4,000 ms per seed: 9.00x, 2.00x, 2.00x lower " \
           "(median 2.00x)" in cell and cell.endswith("(direction holds: yes)")
    # swap: 0.80x, 2.00x, 1.01x: the last is within the 2 % margin, so it holds on 1 of 3 seeds
    assert real_cell(real, SWAP).endswith("(direction holds: **no**, 1 of 3 seeds)")
    assert "24 burstgpt-shaped requests a seed at 0.5 req/s" in cell and "KV 3.0 MiB each" in cell
    assert "busiest 20 s window 1.00 req/s = 80% of the measured 1.25 req/s capacity" in cell
    assert "= 100 blocks, 2x vLLM's mean in use; vLLM's peak with a large pool is 150% of it" in cell
    assert "seeds 0, 1, 2 on a 2-core machine" in cell
    floor = {**real, "regime": {**real["regime"], "num_blocks": 31, "floor_blocks": 31, "unlimited_mean_blocks": 5.1}}
    assert "the floor of one longest request (2x vLLM's mean in use, 5 blocks, is less)" in real_cell(floor, VLLM)
    # a seed some system lacks is left out of the pairing
    partial = {**real, "rows": [r for r in real["rows"] if not (r["seed"] == 1 and r["system"] == SWAP)]}
    assert "9.00x, 2.00x lower" in real_cell(partial, VLLM) and "seeds 0, 2 on" in real_cell(partial, VLLM)


def test_kunserve_real_record_refuses_a_cut_off_an_old_or_an_incomplete_run():
    from tidal.experiments.kunserve_real import check_record
    from tidal.experiments.kunserve_runs import DROP, SWAP

    real = _kunserve_real({0: {}, 1: {}})
    assert check_record(real, "r.json") is real
    with pytest.raises(ValueError, match="r.json: the run was cut off after 8 runs"):
        check_record({**real, "complete": False}, "r.json")
    with pytest.raises(ValueError, match="from before the real runs had seeds"):
        check_record({**real, "rows": {DROP: real["rows"][0]}}, "r.json")
    with pytest.raises(ValueError, match=r"seed 1 lacks InferCept-like \(preempt: swap\)"):
        check_record({**real, "rows": [r for r in real["rows"] if not (r["seed"] == 1 and r["system"] == SWAP)]},
                     "r.json")
    with pytest.raises(ValueError, match="not a kunserve_real.json"):
        check_record({"rows": []}, "r.json")


def test_kunserve_real_runs_every_system_of_a_seed_before_the_next(tmp_path, monkeypatch):
    """The real runs' order (a seed's systems, then the next seed's), each run's seed in its JSON's
    name, the rows so far handed on after each run, and the record: timelines out, events counted,
    unfinished until the end; an unknown system is refused before any server starts."""
    from tidal.experiments import kunserve_real as R

    calls = []

    def fake(key, setup, seed, out_json, *a):
        calls.append((key, seed, os.path.basename(out_json)))
        return {"system": key, "key": key, "seed": seed, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "tpot_p50_ms": 1.0,
                "tpot_p99_ms": 2.0, "goodput_tok_s": 1.0, "events": [{"kind": "drop"}, {"kind": "drop"}],
                "timeline": [{"t": 0.0}]}

    monkeypatch.setattr(R, "run_system", fake)
    seen = []
    setup = R.RealSetup(rate=0.5, kv_cache_memory="1MiB", seeds=(3, 4))
    rows = R.run(["preempt", "drop"], setup, str(tmp_path / "d" / "r"), log=lambda m: None,
                 on_row=lambda got: seen.append(len(got)))
    assert [(c[0], c[1]) for c in calls] == [("preempt", 3), ("drop", 3), ("preempt", 4), ("drop", 4)]
    assert calls[1][2] == "r_drop_s3.json" and (tmp_path / "d").is_dir() and seen == [1, 2, 3, 4]
    rec = R.record("cmd", setup, {}, rows[:3], False)
    assert rec["complete"] is False and rec["setup"]["seeds"] == [3, 4] and len(rec["rows"]) == 3
    assert "timeline" not in rec["rows"][0] and rec["rows"][1]["num_events"] == 2
    assert rec["rows"][1]["event_kinds"] == ["drop"]
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        R.run(["nope"], setup, str(tmp_path / "r"), log=lambda m: None)
    with pytest.raises(ValueError, match="resolve"):
        R.run(["drop"], R.RealSetup(), str(tmp_path / "r"), log=lambda m: None)


def test_kunserve_readme_line_gives_the_real_ratios_over_the_seeds():
    from tidal.experiments import kunserve_claims as C
    from tidal.experiments.kunserve_runs import DROP, MIGRATE, SWAP, VLLM

    real = _kunserve_real({0: {VLLM: 3000.0, SWAP: 900.0, MIGRATE: 1000.0, DROP: 1000.0},
                           1: {VLLM: 1500.0, SWAP: 1200.0, MIGRATE: 1000.0, DROP: 1000.0}})
    a = {"setup": {"seeds": [0, 1]}, "datasets": {"burstgpt": {"regime": {"compute_bound": False}}}}
    line = C.readme_line([], a, None, real)
    assert ("on 2 CPU instances (the shrunken-pool regime, seeds 0, 1) P99 TTFT 1.50-3.00x recompute's, "
            "0.90-1.20x swapping's, 1.00x migration's over KunServe's.") in line


def test_a_page_read_from_recorded_simulator_runs_says_so():
    """``--reuse-sim``: the command's seconds are not the simulator's; the page says where its runs came from."""
    from tidal.experiments.reproduce import Report

    assert "; the simulator runs read from the JSON their own commands wrote)." in Report(
        "p", "t", "", False, command="c", reused_sim=True).markdown()
    assert "read from the JSON" not in Report("p", "t", "", False, command="c").markdown()


def test_the_real_column_is_drawn_from_the_record(tmp_path):
    """``kunserve_real.png``: a PNG is written from the record, whatever seeds it holds."""
    from tidal.experiments.kunserve_plots import plot_real

    path = plot_real(_kunserve_real({0: {}, 3: {}}), str(tmp_path / "kunserve_real.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000
