"""``tidal sim --kv-pressure auto``: each response runs as its fixed mode does, no request is lost,
and every choice is recorded with its predictions and replays (tiny pools, constant step times)."""

from __future__ import annotations

import pytest

from tests.sim.test_kv_pressure import _burst, _cfg, _instances, _tokens_ok
from tidal.cluster.pressure import AutoChoice, AutoParams
from tidal.cluster.pressure.choose import replay
from tidal.cluster.router import build_router
from tidal.sim.pressure import build_pressure
from tidal.sim.simulator import ClusterSimulator
from tidal.workload import RequestSpec

# instance 0 gets the long requests, instance 1 stays nearly empty (round-robin over alternating sizes)
UNEVEN = [RequestSpec(0.0, 100, 60) if i % 2 == 0 else RequestSpec(0.0, 8, 2) for i in range(12)]


def _run(mode, specs, techniques=None, host_blocks=0):
    from dataclasses import replace

    cfg = _cfg(mode, host_bytes_per_s=1e6)
    if techniques is not None:
        cfg = replace(cfg, auto_params=AutoParams(techniques=techniques))
    insts = _instances(2, 32)
    if host_blocks:  # a host pool for swap (the builder gives every auto instance one)
        from tidal.core.kv_manager import KVCacheManager
        from tidal.core.scheduler import Scheduler

        for inst in insts:
            inst.kv = KVCacheManager(32, 16, host_blocks)
            inst.scheduler = Scheduler(inst.scheduler.config, inst.kv, inst.policy, 4096)
    sim = ClusterSimulator(insts, build_router("round-robin"), specs, pressure=build_pressure(cfg))
    return sim, sim.run()


def _times(res):
    return [(r.ttft_s, r.e2e_s) for r in res.records]


@pytest.mark.parametrize("fixed,technique,specs", [("preempt", "recompute", _burst()), ("migrate", "migrate", UNEVEN),
                                                   ("drop", "drop", _burst())])
def test_auto_held_to_one_response_runs_as_that_fixed_mode(fixed, technique, specs):
    _, ref = _run(fixed, specs)
    _, auto = _run("auto", specs, (technique,))
    assert _tokens_ok(auto, specs)
    assert _times(auto) == _times(ref)  # the same requests served at the same virtual times
    p = auto.pressure
    assert set(p["choice_counts"]) == {technique} and p["counts"]["choose"] == sum(p["choice_counts"].values())


def test_auto_swap_preempts_into_the_host_pool():
    specs = _burst(8)
    sim, res = _run("auto", specs, ("swap",), host_blocks=64)
    assert _tokens_ok(res, specs)
    assert res.pressure["choice_counts"].get("swap", 0) >= 1
    assert any(i.scheduler.preemption_mode == "swap" for i in sim.instances)


def test_every_choice_is_recorded_with_its_predictions_and_replays():
    specs = UNEVEN + [RequestSpec(0.5, 100, 60) for _ in range(6)]
    _, res = _run("auto", specs)
    assert _tokens_ok(res, specs)  # nothing lost, every token produced
    p = res.pressure
    assert p["choices"] and len(p["choices"]) == p["counts"]["choose"]
    events = [e for e in p["events"] if e["kind"] == "choose"]
    for d, e in zip(p["choices"], events, strict=True):
        c = AutoChoice.from_dict(d)
        assert replay(c).choice == d["choice"] == e["choice"]
        assert set(d["predictions"]) == {"recompute", "swap", "migrate", "drop"}
        assert d["predictions"][d["choice"]]["seconds"] is not None
    assert p["auto_params"] == AutoParams().to_dict()


def _audited(mode, specs, techniques=None):
    from dataclasses import replace

    cfg = replace(_cfg(mode, host_bytes_per_s=1e6), audit=True)
    if techniques is not None:
        cfg = replace(cfg, auto_params=AutoParams(techniques=techniques))
    sim = ClusterSimulator(_instances(2, 32), build_router("round-robin"), specs, pressure=build_pressure(cfg))
    return sim, sim.run()


@pytest.mark.parametrize("mode,specs,response", [("preempt", _burst(), "recompute"), ("migrate", UNEVEN, "migrate"),
                                                 ("auto", UNEVEN + [RequestSpec(0.5, 100, 60) for _ in range(6)], None)])
def test_the_audit_notes_each_onset_beside_what_happened_and_changes_nothing(mode, specs, response):
    """The audit (tidal.sim.auto_audit) predicts at auto's onsets and reads when the queue waiting at
    each had its first token: the run itself is the same run as without it."""
    _, plain = _run(mode, specs)
    sim, res = _audited(mode, specs)
    assert _times(res) == _times(plain)
    rows = res.pressure["audit"]
    assert rows and any(r["realized_s"] is not None for r in rows)
    if mode == "auto":  # auto's own choices are its notes
        assert [r["response"] for r in rows] == [c["choice"] for c in res.pressure["choices"]]
    else:
        assert {r["response"] for r in rows} == {response}
    for r in rows:
        assert set(r["predicted_s"]) == {"recompute", "swap", "migrate", "drop"} and r["waiting"] >= 0
        if r["realized_s"] is not None:  # the last first token among the requests waiting at the onset
            assert r["realized_s"] > 0
            assert any(abs(rec.arrival_s + rec.ttft_s - r["time"] - r["realized_s"]) < 1e-3
                       for rec in res.records if rec.ttft_s is not None)


def test_the_audit_summary_is_the_median_of_realized_over_predicted():
    from tidal.sim.auto_audit import summarize_audit

    rows = [{"response": "swap", "predicted_s": {"swap": 2.0}, "realized_s": 1.0},
            {"response": "swap", "predicted_s": {"swap": 1.0}, "realized_s": 3.0},
            {"response": "swap", "predicted_s": {"swap": 1.0}, "realized_s": 2.0},
            {"response": "drop", "predicted_s": {"drop": 1.0}, "realized_s": None}]
    assert summarize_audit(rows) == {"swap": {"onsets": 3, "realized": 3, "median_realized_over_predicted": 2.0},
                                     "drop": {"onsets": 1, "realized": 0, "median_realized_over_predicted": None}}
