"""``scheduling="prefill-first"`` in the simulator: the same Scheduler, so no simulated step mixes
prefill and decode, every request finishes with its tokens, and recomputes cost prefill-only steps."""

from __future__ import annotations

import numpy as np

from tidal.config import SchedulerConfig
from tidal.sim.build import ClusterSpec, build_simulator
from tidal.workload import RequestSpec


def run(scheduling: str, specs: list[RequestSpec]):
    spec = ClusterSpec(model="llama-2-7b", hardware="a100-40g", instances=1, num_blocks=300,
                       scheduler=SchedulerConfig(scheduling=scheduling, max_num_seqs=64, max_num_batched_tokens=2048))
    sim = build_simulator(spec, specs)
    plans = []
    sched = sim.instances[0].scheduler
    schedule = sched.schedule

    def recording(now):
        plans.append(schedule(now))
        return plans[-1]

    sched.schedule = recording
    return sim.run(), plans


def test_simulated_prefill_first_never_mixes_and_finishes_everything():
    rng = np.random.default_rng(3)
    specs = [RequestSpec(float(t), int(p), int(o)) for t, p, o in
             zip(np.cumsum(rng.exponential(0.02, 200)), rng.integers(8, 600, 200), rng.integers(1, 300, 200),
                 strict=True)]
    res, plans = run("prefill-first", specs)
    assert all(r.success for r in res.records)
    assert [r.output_tokens for r in res.records] == [s.output_len for s in specs]
    assert res.instances[0]["num_preemptions"] > 0  # 300 blocks of 16: the pool is tight
    recomputes = 0
    for p in plans:
        decodes = [c.is_decode for c in p.chunks]
        assert all(decodes) or not any(decodes), f"step {p.step_id} mixes prefill and decode"
        recomputes += sum(1 for c in p.chunks if not c.is_decode and c.output_index > 0)
        assert all(c.start == 0 for c in p.chunks if not c.is_decode)  # whole prefills
    assert recomputes > 0
    # the chunked default on the same trace does mix them
    _, chunked = run("chunked", specs)
    assert any(len({c.is_decode for c in p.chunks}) == 2 for p in chunked)
