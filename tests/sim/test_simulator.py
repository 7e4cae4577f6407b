"""The simulator's loop, routers and request accounting, on hand-checkable cost models."""

from __future__ import annotations

import pytest

from tidal.cluster.router import (
    KVAwareRouter,
    LeastOutstandingRouter,
    RoundRobinRouter,
    RouteRequest,
    build_router,
)
from tidal.config import SchedulerConfig
from tidal.metrics import summarize
from tidal.sim.build import ClusterSpec, build_simulator
from tidal.sim.instance import SimInstance
from tidal.sim.loop import Event, EventLoop
from tidal.sim.simulator import ClusterSimulator
from tidal.workload import RequestSpec


class Constant:
    name = "constant"

    def __init__(self, dt: float):
        self.dt = dt
        self.plans = []

    def step_time(self, plan):
        self.plans.append(plan)
        return self.dt


def _instances(n, dt=0.01, blocks=256, **sched):
    return [SimInstance(i, SchedulerConfig(**sched), blocks, 16, Constant(dt), 2048) for i in range(n)]


# ---------------------------------------------------------------------------- loop
class _Note(Event):
    __slots__ = ("log", "tag", "then", "priority")

    def __init__(self, time, log, tag, priority=0, then=()):
        super().__init__(time)
        self.log, self.tag, self.then = log, tag, then
        self.priority = priority

    def fire(self, loop):
        self.log.append((loop.now, self.tag))
        return list(self.then)


def test_loop_orders_by_time_then_priority_then_insertion():
    log = []
    loop = EventLoop()
    loop.push(_Note(2.0, log, "late"))
    loop.push(_Note(1.0, log, "b", priority=1))
    loop.push(_Note(1.0, log, "a", priority=0))
    loop.push(_Note(1.0, log, "c", priority=1))
    loop.push(_Note(0.5, log, "spawn", then=[_Note(1.0, log, "child", priority=0)]))
    loop.run()
    assert [t for _, t in log] == ["spawn", "a", "child", "b", "c", "late"]
    assert loop.now == 2.0 and loop.num_fired == 6


def test_loop_refuses_events_in_the_past_and_stops_at_until():
    log = []
    loop = EventLoop()
    loop.push(_Note(1.0, log, "x"))
    loop.push(_Note(5.0, log, "y"))
    loop.run(until=2.0)
    assert [t for _, t in log] == ["x"]
    with pytest.raises(ValueError, match="in the past"):
        loop.push(_Note(0.5, log, "z"))


# ---------------------------------------------------------------------------- routers
class _Load:
    def __init__(self, outstanding, free, total=100, queued=0):
        self.num_outstanding, self.num_free_blocks, self.num_blocks = outstanding, free, total
        self.queued_block_demand, self.block_size = queued, 16


def test_routers():
    req = RouteRequest("r", 160, 10)  # 11 blocks
    loads = [_Load(3, 50), _Load(1, 20), _Load(1, 90, queued=80), _Load(2, 60)]
    rr = RoundRobinRouter()
    assert [rr.route(req, loads) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    assert LeastOutstandingRouter().route(req, loads) == 1  # tie 1/2 -> lower index
    assert KVAwareRouter().route(req, loads) == 3  # 60 free beats 50; instance 2's free blocks are spoken for
    with pytest.raises(ValueError, match="available: round-robin"):
        build_router("random")


# ---------------------------------------------------------------------------- requests
def test_one_request_timing_by_hand():
    inst = _instances(1, dt=0.01)
    specs = [RequestSpec(0.5, 100, 5)]
    res = ClusterSimulator(inst, RoundRobinRouter(), specs).run()
    rec = res.records[0]
    assert rec.success and rec.output_tokens == 5
    assert rec.ttft_s == pytest.approx(0.01)  # the whole prompt in one step, first token sampled
    assert rec.e2e_s == pytest.approx(0.05)
    assert rec.itl_s == pytest.approx([0.01] * 4)
    assert res.simulated_time_s == pytest.approx(0.55)
    assert inst[0].kv.num_free_blocks == inst[0].kv.num_blocks


def test_chunked_prefill_and_batching_by_hand():
    inst = _instances(1, dt=0.02, max_num_batched_tokens=64)
    specs = [RequestSpec(0.0, 100, 3), RequestSpec(0.0, 10, 2)]
    res = ClusterSimulator(inst, RoundRobinRouter(), specs).run()
    plans = [[(c.request_id, c.num_tokens) for c in p.chunks] for p in inst[0].cost_model.plans]
    # step 1: 64 of request 0; step 2: its last 36 + all 10 of request 1, both sample
    assert plans[:3] == [[("0", 64)], [("0", 36), ("1", 10)], [("0", 1), ("1", 1)]]
    a, b = res.records
    assert a.ttft_s == pytest.approx(0.04) and b.ttft_s == pytest.approx(0.04)
    assert b.e2e_s == pytest.approx(0.06) and a.e2e_s == pytest.approx(0.08)


def test_too_long_requests_are_refused_and_counted_failed():
    inst = _instances(2)
    specs = [RequestSpec(0.0, 100, 10), RequestSpec(0.1, 2040, 100), RequestSpec(0.2, 50, 5)]
    res = ClusterSimulator(inst, RoundRobinRouter(), specs, max_model_len=2048).run()
    ok = [r.success for r in res.records]
    assert ok == [True, False, True]
    assert res.records[1].error == "context" and res.routed[1] == -1
    s = summarize(res.records)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"context": 1}


def test_requests_beyond_the_kv_pool_are_rejected_not_crashing():
    inst = _instances(1, blocks=4)  # 64 tokens of KV
    specs = [RequestSpec(0.0, 100, 4), RequestSpec(0.0, 20, 4)]
    res = ClusterSimulator(inst, RoundRobinRouter(), specs).run()
    assert [r.success for r in res.records] == [False, True]
    assert res.records[0].error == "rejected"


def test_runs_are_deterministic_and_conserve_requests():
    import numpy as np

    rng = np.random.default_rng(1)
    specs = [RequestSpec(float(t), int(p), int(o)) for t, p, o in
             zip(np.cumsum(rng.exponential(0.05, 300)), rng.integers(8, 900, 300), rng.integers(1, 200, 300),
                 strict=True)]

    def once():
        spec = ClusterSpec(model="llama-2-7b", hardware="a100-40g", instances=3, num_blocks=300,
                           router="kv-aware", scheduler=SchedulerConfig(batching="sla", tbt_slo_ms=30))
        sim = build_simulator(spec, specs)
        res = sim.run()
        assert all(i.kv.num_free_blocks == i.kv.num_blocks for i in sim.instances)
        return res

    a, b = once(), once()
    assert [(r.ttft_s, r.e2e_s, r.output_tokens) for r in a.records] == \
           [(r.ttft_s, r.e2e_s, r.output_tokens) for r in b.records]
    assert all(r.success for r in a.records)
    assert [r.output_tokens for r in a.records] == [s.output_len for s in specs]
    assert sum(i["num_preemptions"] for i in a.instances) > 0  # 300 blocks: the pool is tight
    assert sorted(set(a.routed)) == [0, 1, 2]
