"""The simulator's fast path (decode-only steps run ahead of the event loop) changes nothing:
the same records, timelines, instance stats and simulated time as one event per step."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import StepResult
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.sim.build import ClusterSpec, build_simulator
from tidal.sim.instance import SimInstance
from tidal.workload import RequestSpec


def _specs(n: int, rate: float, seed: int = 0) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    return [RequestSpec(float(t[i]), int(rng.integers(16, 900)), int(rng.integers(1, 300))) for i in range(n)]


def _run(fast: bool, specs, **sched):
    spec = ClusterSpec(model="llama-3-8b", hardware="a100-80g", instances=3, router=sched.pop("router", "kv-aware"),
                       num_blocks=sched.pop("num_blocks", None), swap_space=sched.pop("swap_space", 0),
                       timeline_interval_s=0.05,
                       scheduler=SchedulerConfig(**sched))
    sim = build_simulator(spec, specs)
    sim.fast_forward = fast
    res = sim.run()
    return res, [asdict(r) for r in res.records]


@pytest.mark.parametrize("sched", [
    {},  # plenty of KV
    {"num_blocks": 300, "router": "least-outstanding"},  # preemptions: the fast path must stand aside
    {"num_blocks": 300, "preemption_mode": "swap", "swap_space": 1 << 30, "max_num_seqs": 8},
    {"batching": "sla", "tbt_slo_ms": 30.0},  # not a passive policy: no fast path at all
])
def test_fast_path_changes_nothing(sched):
    specs = _specs(150, rate=12.0)
    slow, slow_records = _run(False, specs, **dict(sched))
    fast, fast_records = _run(True, specs, **dict(sched))
    assert fast_records == slow_records
    assert fast.simulated_time_s == slow.simulated_time_s
    assert fast.timelines == slow.timelines and fast.instances == slow.instances and fast.routed == slow.routed
    if not sched:
        assert fast.num_events < slow.num_events / 3  # it did run ahead
    if "num_blocks" in sched:
        assert sum(i["num_preemptions"] for i in fast.instances) > 0


def test_quiet_runs_take_over_the_decode_steps(monkeypatch):
    """Runs of decode steps that finish nobody go without per-step updates, and still change nothing."""
    ran = []
    quiet = SimInstance._run_quiet

    def counting(self, positions, room, now, before, on_run):
        steps = self.num_steps
        end = quiet(self, positions, room, now, before, on_run)
        if end != now:
            ran.append(self.num_steps - steps)
        return end

    specs = _specs(150, rate=12.0, seed=3)
    slow, slow_records = _run(False, specs)
    monkeypatch.setattr(SimInstance, "_run_quiet", counting)
    fast, fast_records = _run(True, specs)
    assert fast_records == slow_records and fast.timelines == slow.timelines and fast.instances == slow.instances
    assert len(ran) > 50 and sum(ran) > 2 * len(ran)  # runs of several steps each


def test_the_step_across_an_arrival_begins_without_a_plan(monkeypatch):
    """The decode-only step that ends after the next arrival is an event begun by begin_crossing
    (no schedule(), no plan) and ended by end_decodes, and still changes nothing."""
    crossed, planned = [], []
    crossing, schedule = SimInstance.begin_crossing, Scheduler.schedule

    def counting_crossing(self, now):
        dt = crossing(self, now)
        if dt is not None:
            crossed.append(now)
        return dt

    def counting_schedule(self, now):
        planned.append(now)
        return schedule(self, now)

    specs = _specs(150, rate=12.0, seed=5)
    slow, slow_records = _run(False, specs)
    monkeypatch.setattr(SimInstance, "begin_crossing", counting_crossing)
    monkeypatch.setattr(Scheduler, "schedule", counting_schedule)
    fast, fast_records = _run(True, specs)
    assert fast_records == slow_records and fast.timelines == slow.timelines and fast.instances == slow.instances
    assert fast.simulated_time_s == slow.simulated_time_s
    assert len(crossed) > 100  # most arrivals fall inside a decode-only step of some instance
    assert not set(crossed) & set(planned)  # those steps planned nothing


def _decoding(max_tokens: list[int], token_in_stop: bool = False):
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, 4))
    for i, m in enumerate(max_tokens):
        sp = SamplingParams(max_tokens=m, ignore_eos=True, stop_token_ids=[7] if token_in_stop else None)
        sched.add_request(Request(f"r{i}", list(range(100 + i, 105 + 2 * i)), sp))
    plan = sched.schedule(0.0)  # every prompt in one step: each takes its first token
    sched.update(plan, StepResult(plan.step_id, {c.request_id: 7 for c in plan.chunks}), 0.0)
    return sched


def test_decode_run_room_and_end_decode_run_match_step_by_step():
    a, b = _decoding([9, 6, 12]), _decoding([9, 6, 12])
    assert a.decode_run_room(7) == 6 - 1 - 1  # r1 has 5 tokens left; the fifth would finish it
    assert _decoding([9, 6], token_in_stop=True).decode_run_room(7) == 0  # the token stops a request
    steps = a.decode_run_room(7)
    for _ in range(steps):  # step by step through schedule and update
        plan = a.schedule(1.0)
        assert plan.composition.num_prefill_tokens == 0 and len(plan.chunks) == 3
        a.update(plan, StepResult(plan.step_id, {c.request_id: 7 for c in plan.chunks}), 1.0)
    start = b.decode_positions()
    for j in range(steps):  # the blocks as run_decodes' quiet runs take them, then the run at once
        b.kv.allocate_one_more([(rid, p + j) for rid, p in start])
    b.end_decode_run(steps, 7, 1.0)
    for ra, rb in zip(a.running, b.running, strict=True):
        assert (ra.request_id, ra.num_computed_tokens, ra.output_token_ids, ra.last_token_time) == \
            (rb.request_id, rb.num_computed_tokens, rb.output_token_ids, rb.last_token_time)
        assert a.kv.block_table(ra.request_id) == b.kv.block_table(rb.request_id)
    assert a.decode_run_room(7) == b.decode_run_room(7) == 0 and not any(r.is_finished for r in a.running)
    plan = b.schedule(2.0)  # the next step finishes r1
    ups = b.update(plan, StepResult(plan.step_id, {c.request_id: 7 for c in plan.chunks}), 2.0)
    assert [u.request_id for u in ups if u.finished] == ["r1"]
