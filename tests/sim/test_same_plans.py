"""Same code, same plans: the engine and the simulator, fed the same requests and the same step
times (recorded from the engine), produce the same sequence of step plans.

The engine runs a model on a virtual clock that advances by each step's measured time; the
simulator replays those times through :class:`ReplayCostModel`. Adaptive policies learn from the
step times, so they see the same inputs in both shells.

A plan depends on token counts and step times, not on the weights (every request runs to its
``max_tokens``), so the engine runs a 4-layer random-weight Llama (conftest's ``tiny_llama``), and
its measured step times are scaled by ``TIME_SCALE`` into the default model's range (tens of ms),
where the SLA policies' 40 ms target binds.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tidal.cluster.router import build_router
from tidal.core.sampling import SamplingParams
from tidal.sim.cost_model import ReplayCostModel
from tidal.sim.instance import SimInstance
from tidal.sim.simulator import ClusterSimulator
from tidal.workload import RequestSpec


def _workload(n: int = 12, seed: int = 3) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.03, size=n))
    t[:3] = 0.0  # a burst at t=0: several arrivals at the same instant
    return [RequestSpec(float(t[i]), int(rng.integers(20, 140)), int(rng.integers(3, 20))) for i in range(n)]


TIME_SCALE = 20.0


def _run_engine(make_engine, specs: list[RequestSpec], engine_kwargs: dict, prompts: list[list[int]] | None = None):
    vclock = [0.0]
    engine = make_engine(**engine_kwargs)
    engine.clock = lambda: vclock[0]
    plans, times = [], []
    execute = engine.runner.execute

    def timed(plan):
        res = execute(plan)
        res.step_time_s *= TIME_SCALE  # the policies inside the engine observe the scaled time too
        if plan.chunks:  # an empty plan costs nothing in the simulator either
            plans.append(plan.describe())
            times.append(res.step_time_s)
            vclock[0] += res.step_time_s
        return res

    engine.runner.execute = timed
    rng = np.random.default_rng(0)
    nxt = 0
    while nxt < len(specs) or engine.has_unfinished_requests():
        while nxt < len(specs) and specs[nxt].arrival_s <= vclock[0]:
            s = specs[nxt]
            engine.add_request(str(nxt), None, SamplingParams(temperature=0.0, max_tokens=s.output_len,
                                                               ignore_eos=True),
                               prompt_token_ids=prompts[nxt] if prompts is not None
                               else rng.integers(100, 40000, size=s.prompt_len).tolist(),
                               arrival_time=s.arrival_s)
            nxt += 1
        if not engine.has_unfinished_requests():
            vclock[0] = specs[nxt].arrival_s
            continue
        engine.step()
    return engine, plans, times


class _Recording(ReplayCostModel):
    def __init__(self, times):
        super().__init__(times)
        self.plans = []

    def step_time(self, plan):
        self.plans.append(plan.describe())
        return super().step_time(plan)


CASES = {
    "continuous-recompute": dict(batching="continuous", num_blocks_override=24, max_num_batched_tokens=64),
    "continuous-swap": dict(batching="continuous", num_blocks_override=24, max_num_batched_tokens=64,
                            preemption_mode="swap", swap_space="64MiB"),
    "sla": dict(batching="sla", tbt_slo_ms=40.0, max_num_batched_tokens=96),
    "bucket+memory+sla": dict(batching="bucket+memory+sla", tbt_slo_ms=40.0, num_blocks_override=40,
                              max_num_batched_tokens=96),
    "slo-compose": dict(batching="slo-compose", tbt_slo_ms=40.0, max_num_batched_tokens=128),
    "static": dict(batching="static", max_num_seqs=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_and_simulator_make_the_same_plans(make_tiny_engine, case):
    kwargs = dict(CASES[case])
    specs = _workload()
    engine, engine_plans, times = _run_engine(make_tiny_engine, specs, kwargs)
    assert len(engine_plans) > 10
    sc = engine.config.scheduler
    model = _Recording(times)
    inst = SimInstance(0, replace(sc),
                       engine.kv_manager.num_blocks, engine.kv_manager.block_size, model, engine.max_model_len,
                       num_host_blocks=engine.kv_manager.host_pool.num_blocks,
                       enable_caching=engine.kv_manager.enable_caching)  # a recompute re-hits its own blocks
    result = ClusterSimulator([inst], build_router("round-robin"), specs).run()
    assert model.plans == engine_plans
    assert model.calls == len(times)
    assert all(r.success for r in result.records)
    assert [r.output_tokens for r in result.records] == [s.output_len for s in specs]
    assert inst.kv.num_free_blocks == inst.kv.num_blocks
    if "recompute" in case or "swap" in case:
        assert engine.scheduler.num_preemptions > 0 and inst.scheduler.num_preemptions == engine.scheduler.num_preemptions


def test_engine_and_simulator_hit_the_same_prefixes(make_tiny_engine, smol_tokenizer):
    """Mooncake-style requests: the engine gets each hash id's 512 tokens (equal ids, equal tokens),
    the simulator only the ids (its blocks named from them); with a pool small enough to evict, both
    hit the same prefixes at the same steps, so their plans are the same, step for step."""
    from tidal.workload import materialize

    rng = np.random.default_rng(7)
    chains = [[1, 2], [1, 2, 3], [1, 4], [5], [1, 2, 3, 6], [5, 7], [1, 2], [8, 9], [1, 4, 10], [5, 7, 11]]
    specs = []
    t = 0.0
    for ids in chains:
        t += float(rng.exponential(0.05))
        n = 512 * (len(ids) - 1) + int(rng.integers(40, 500))
        specs.append(RequestSpec(t, n, int(rng.integers(3, 12)), hash_ids=ids))
    prompts = [s.prompt_token_ids for s in materialize(specs, smol_tokenizer, "ids")]
    kwargs = dict(batching="continuous", num_blocks_override=260, max_num_batched_tokens=512)
    engine, engine_plans, times = _run_engine(make_tiny_engine, specs, kwargs, prompts)
    hits = engine.scheduler.prefix_hits
    assert hits > 0 and engine.scheduler.prefix_queries == sum(s.prompt_len for s in specs)
    sc = engine.config.scheduler
    model = _Recording(times)
    inst = SimInstance(0, replace(sc), engine.kv_manager.num_blocks, engine.kv_manager.block_size, model,
                       engine.max_model_len, enable_caching=True)
    result = ClusterSimulator([inst], build_router("round-robin"), specs).run()
    assert inst.scheduler.prefix_hits == hits
    from tidal.core.block_hash import block_hashes
    from tidal.metrics.prefix import prefix_bounds

    unbounded = prefix_bounds([(block_hashes(p, 16), len(p)) for p in prompts], 16)["unbounded_hit_rate"]
    assert hits < unbounded * sum(len(p) for p in prompts)  # the pool evicted prefixes a later request wanted
    assert model.plans == engine_plans
    assert all(r.success for r in result.records)
