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
