"""The policy benchmark's replay loop on the real engine: every request finishes with its length,
latencies are consistent, and policies that cap the batch really do."""

from __future__ import annotations

import pytest

from tidal.experiments.policies import make_jobs, run_policy
from tidal.metrics import SLO, summarize


@pytest.mark.parametrize("batching", ["static", "bucket+memory+sla"])
def test_replay_on_real_engine(make_engine, batching):
    jobs = make_jobs(6, rate=50.0, burstiness=1.0, seed=1, vocab=49152, long_frac=0.5,
                     short=(8, 16), long=(40, 60), out_short=(3, 5), out_long=(4, 6))
    engine = make_engine(batching=batching, tbt_slo_ms=10_000, max_num_seqs=4, max_num_batched_tokens=32)
    records, extra = run_policy(engine, jobs, progress=False)
    assert all(r.success for r in records)
    for r, j in zip(sorted(records, key=lambda r: r.index), jobs, strict=True):
        assert r.output_tokens == r.counted_tokens == j.output_len
        assert len(r.itl_s) == j.output_len - 1
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    assert extra["batch_cap_mean"] <= 4
    s = summarize(records, slo=SLO(tpot_s=10.0))
    assert s["completed"] == 6 and s["slo_attainment"] == 1.0
    assert 0.0 <= extra["padding_waste_mean"] < 1.0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
