"""The real runtime (``--mode split`` on 2 worker processes) and the simulator make the same
DynaServe split decisions (Alg. 1: pair, split point, probes) for the same request sequence.

Both shells drive a :class:`tidal.cluster.split.SplitPlanner` with the same parameters and the
same step-time model, and receive the same burst of requests at t=0 (the same prompt lengths and
max_tokens): before any request has progressed, the planner's ledgers hold exactly what it
committed itself, so every decision must come out the same. Each runtime decision is also asked
again of a fresh planner on its logged ledgers (``replay``): it is a function of what it saw.

What it does not prove: that later decisions agree once requests progress (the runtime learns of
progress from its workers' outputs at real times, the simulator on its modelled clock)."""

from __future__ import annotations

import asyncio

import numpy as np

from tests.runtime.test_cluster import ENGINE, settle, stop
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.split import SplitParams, SplitPlanner, replay
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams

N = 12
PARAMS = SplitParams(token_budget=64, max_num_seqs=256, epsilon_s=0.001)


def step_time(p: float, ctx: float, d: float) -> float:
    return 0.004 + 2e-4 * p + 5e-4 * d + 1e-7 * ctx * d


def _workload() -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(11)
    return [(rng.integers(100, 40000, size=int(rng.integers(12, 90))).tolist(), int(rng.integers(3, 10)))
            for _ in range(N)]


def _run_real(work):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM

    log = []
    llm = ClusterLLM(EngineConfig.from_kwargs(**ENGINE),
                     ClusterConfig(layout=ClusterLayout(2, "split"), threads_per_instance=1, layers_per_chunk=10,
                                   tokens_per_chunk=16), ENGINE,
                     splitter=SplitPlanner(PARAMS, step_time, recorder=log.append))
    llm.start()
    try:
        async def one(i: int) -> int:
            ids, max_tokens = work[i]
            n = 0
            async for o in llm.generate(None, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                        f"r{i}", prompt_token_ids=ids):
                n += len(o.outputs[0].delta_token_ids)
            return n

        async def burst():
            return await asyncio.gather(*[one(i) for i in range(N)])

        assert asyncio.run(burst()) == [m for _, m in work]
        settle(llm)
        pools = {r.index: (r.num_blocks, r.block_size) for r in llm.monitor.instances}
        return log, pools, llm.config.scheduler, llm.stats
    finally:
        stop(llm)


def _run_sim(work, pools, scheduler):
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware
    from tidal.sim.instance import SimInstance
    from tidal.sim.links import get_link
    from tidal.sim.models import get_model
    from tidal.sim.pd import HandoffConfig
    from tidal.sim.split import SplitSimulator
    from tidal.workload import RequestSpec

    arch, hw = get_model("smollm2-135m"), get_hardware("cpu")
    cost = AnalyticCostModel(arch, hw, dtype_bytes=4)
    instances = [SimInstance(i, scheduler, pools[i][0], pools[i][1], cost, arch.max_position_embeddings)
                 for i in range(2)]
    log = []
    sim = SplitSimulator(instances, SplitPlanner(PARAMS, step_time, recorder=log.append),
                         [RequestSpec(0.0, len(ids), m) for ids, m in work],
                         HandoffConfig.for_model(arch, 4, get_link("shm", hw), 1, 10, 16),
                         max_model_len=arch.max_position_embeddings, request_ids=[f"r{i}" for i in range(N)])
    return log, sim.run()


def test_runtime_and_simulator_make_the_same_split_decisions():
    work = _workload()
    real, pools, scheduler, stats = _run_real(work)
    sim, res = _run_sim(work, pools, scheduler)
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]

    def key(log):
        return [(r.decision.request_id, r.decision.pair, r.decision.prompt_len, r.decision.predicted_output,
                 r.decision.split, r.decision.probes, r.decision.cold_start) for r in log]

    assert len(real) == len(sim) == N
    assert key(real) == key(sim)
    assert any(r.decision.handoff for r in real) and real[0].decision.cold_start
    for r in real:  # each decision is a function of the ledgers it saw
        again = replay(r, step_time, PARAMS)
        assert (again.pair, again.split, again.probes) == (r.decision.pair, r.decision.split, r.decision.probes)
    # the runtime split what it planned to split, and moved KV for each of them
    assert stats["splits"] == sum(r.decision.handoff for r in real) and stats["kv_bytes_moved"] > 0
