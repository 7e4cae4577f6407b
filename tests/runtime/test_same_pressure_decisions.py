"""The real runtime (``--kv-pressure drop`` on 2 worker processes) and the simulator make the same
KunServe decisions -- throttle, drop plan, restore -- for the same request sequence.

A real pair with 10 KV blocks of 16 tokens each serves a burst of 8 requests at t=0: the
dispatcher alternates, so instance 0 gets four long prompts (about 7 blocks each: one runs, the
rest queue for memory) and instance 1 four short ones (one block each: never throttled). The
simulator serves the same requests on instances with the real workers' pools and scheduler
configuration and the same ``ModelMemory`` (the real model's layer and KV bytes); both split a
group's steps with the same Eq. 1 coefficients (the simulator's hardware model's, handed to the
workers as ``tidal serve --profile`` does). Both shells
log every controller event (``PressureDecision``) and every plan with the monitor view it was
made on (``tidal.cluster.pressure.record``).

What this proves:
- the same sequence of events in both: throttle (instance 0) -> drop -> exchange ->
  exchange-done -> restore -> restore-done, and the same plans: the drop merges (0, 1) with
  instance 0 as the head holding layers [0, 15) and instance 1 the tail with [15, 30), frees one
  copy of the decoder layers (30 x the real layer bytes), loads nothing; the restore gives each
  member all 30 layers back, loading what it dropped;
- the same freed-block arithmetic: the group's pool, as the restore's view reports it from the
  head, is the same number of blocks in both shells and equals ``(10 blocks + 15 layers' weights)
  // a block of 15 layers`` (the engine's ``drop_layers`` and the simulator's ``group_blocks``),
  against the same undropped 20 blocks of the 50 % rule (Sec. 4.4);
- every plan, in either shell, is what a fresh ``KunServeController`` answers on the logged view
  (``replay``): a plan is a function of what the monitor showed.

What it does not prove: that the plans are made at the same instants or on the same views.
The runtime's monitor hears a worker's status after its steps, at real times; the simulator's
sees its instances live on a modelled clock. So the throttle's shortage (the drop's
``demand_bytes``), the blocks in use when the restore is decided, which requests were in flight
at the drop, and every time differ, and are not compared; the workload is chosen so that only one
instance can throttle, which makes the plan's shape independent of the instant.
"""

from __future__ import annotations

import time

from tests.runtime.shells import (
    SIM_MODEL,
    leaked_segments,
    random_work,
    request_specs,
    serve_burst,
    sim_instances,
)
from tests.runtime.test_cluster import shm_segments, wait_gone
from tests.runtime.test_kunserve_runtime import _cluster
from tidal.cluster.pressure import ControllerDecision, DropPlan, PressureDecision, RestorePlan
from tidal.cluster.pressure.record import replay

N = 8
FLOW = ["throttle", "drop", "exchange", "exchange-done", "restore", "restore-done"]


def _workload() -> list[tuple[list[int], int]]:
    long, short = random_work(5, N // 2, (100, 113), (10, 13)), random_work(6, N // 2, (4, 8), (4, 8))
    return [r for pair in zip(long, short, strict=True) for r in pair]  # dispatched 0, 1, 0, 1, ...


def _eq1():
    """Eq. 1's coefficients both shells split a group's steps with: the simulator's, derived from its
    hardware model, given to the real workers as a profile would be (``tidal serve --profile``)."""
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware
    from tidal.sim.models import get_model
    from tidal.sim.pipeline import analytic_eq1

    return analytic_eq1(AnalyticCostModel(get_model(SIM_MODEL), get_hardware("cpu"), dtype_bytes=4))


def _run_real(work):
    eq1 = _eq1()
    llm = _cluster(microbatch_cost=(eq1.alpha, eq1.beta, eq1.gamma))
    plans: list[ControllerDecision] = []
    llm.pressure.decisions = plans.append
    before = shm_segments()
    llm.start()
    pids = [h.pid for h in llm.handles]
    try:
        pools = {r.index: (r.num_blocks, r.block_size) for r in llm.monitor.instances}  # undropped: before any step
        assert serve_burst(llm, work) == [m for _, m in work]
        deadline = time.monotonic() + 30  # the head's restore, then the tail's reload
        while time.monotonic() < deadline and not ("restore-done" in llm.pressure.counts
                                                   and not llm.pressure.dropped):
            time.sleep(0.1)
        events = [PressureDecision(e["kind"], e["time"], tuple(e["instances"]), {}) for e in llm.pressure.events]
        assert llm.pressure.snapshot()["microbatch_cost"] == "profiled"
        return plans, events, pools, llm.config.scheduler, llm.pressure.model
    finally:
        llm.shutdown()
        wait_gone(pids)
        assert not leaked_segments(before)


def _run_sim(work, pools, scheduler, model):
    from tidal.cluster.dispatch import ClusterLayout
    from tidal.cluster.router import build_router
    from tidal.sim.links import get_link
    from tidal.sim.pressure import PressureConfig, build_pressure
    from tidal.sim.simulator import ClusterSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    cfg = PressureConfig("drop", get_link("shm", hw), model, arch.hidden_size * 4, _eq1(), layers_per_chunk=4,
                         overhead_s=hw.step_overhead_s)
    handler = build_pressure(cfg)
    specs, ids = request_specs(work)
    sim = ClusterSimulator(instances, build_router("least-outstanding"), specs, request_ids=ids,
                           layout=ClusterLayout(2, "colocate", 0), pressure=handler)
    plans: list[ControllerDecision] = []
    handler.ctl.decisions = plans.append  # type: ignore[attr-defined]  (a DropHandler)
    res = sim.run()
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    return plans, handler.events


def test_runtime_and_simulator_make_the_same_drop_and_restore_decisions():
    work = _workload()
    real, real_events, pools, scheduler, model = _run_real(work)
    sim, sim_events = _run_sim(work, pools, scheduler, model)
    assert pools == {0: (10, 16), 1: (10, 16)}

    # the same events, in the same order, on the same instances
    assert [(e.kind, e.instances) for e in real_events] == [(e.kind, e.instances) for e in sim_events]
    assert [e.kind for e in real_events] == FLOW and real_events[0].instances == (0,)

    # the same plans: a drop of one copy into head (0) and tail (1), then the restore
    assert [d.kind for d in real] == [d.kind for d in sim] == ["drop", "restore"]
    (rd, rr), (sd, sr) = real, sim
    L, lb = model.num_layers, model.layer_bytes
    for d in (rd, sd):
        p = d.plan
        assert isinstance(p, DropPlan) and d.groups == ((0,), (1,))
        assert p.changed == ((0, 1),) and p.layers == {0: (0, L // 2), 1: (L // 2, L)}
        assert p.freed_bytes == {0: (L - L // 2) * lb, 1: (L // 2) * lb} and p.load_bytes == {}
        assert p.freed_total == L * lb and p.satisfied
        assert d.view(0).hol_block_demand > d.view(0).num_free_blocks  # throttled: its head of line did not fit
    assert isinstance(rr.plan, RestorePlan) and rr.plan == sr.plan
    assert rr.plan.load_bytes == {0: (L - L // 2) * lb, 1: (L // 2) * lb}

    # the freed-block arithmetic: the group's pool (seen through its head) and the undropped pools
    block = model.block_bytes(16)
    grown = (10 * block + (L - L // 2) * lb) * L // ((L // 2) * block)
    for d in (rr, sr):
        assert d.groups == ((0, 1),) and d.view(0).group == (0, 1)
        assert d.view(0).num_blocks == grown and d.base_blocks == {0: 10, 1: 10}
        assert 2 * (d.view(0).used_blocks + d.view(0).queued_block_demand) < 20  # Sec. 4.4's 50 % rule

    # every plan is the pure controller's answer on the view it was made on, in both shells
    for d in (*real, *sim):
        assert replay(d, model) == d.plan
