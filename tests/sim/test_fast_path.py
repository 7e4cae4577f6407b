"""The simulator's fast path (decode-only steps run ahead of the event loop) changes nothing:
the same records, timelines, instance stats and simulated time as one event per step."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest

from tidal.config import SchedulerConfig
from tidal.sim.build import ClusterSpec, build_simulator
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
