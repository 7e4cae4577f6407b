"""``--kv-pressure auto`` on 2 real CPU workers with small pools under a burst: the answers are one
engine's, token for token; every choice is recorded with its predictions, shown on ``/admin/state``,
and replays; and the simulator, fed the same requests on the workers' pools, makes the same choices
and plans (the one ``AutoPressure`` object in both shells).

The workload is ``test_same_pressure_decisions``'s: instance 0 gets four long prompts (about 7
blocks each of its 10: one runs, the rest queue for memory) and instance 1 four short ones (never
throttled), so only instance 0 has an onset, and what it is offered does not hang on the instant:
a drop into the pair (instance 1 idles, so the group's queue runs on twice the compute), a
migration to instance 1, or a preemption that must wait for the memory to drain.

What it does not prove: that the predictions are the same numbers. The runtime prices a step with
the step times its workers report and sees only requests that streamed a token as running; the
simulator sees its instances live on a modelled clock. The predictions are compared by their choice.
"""

from __future__ import annotations

import asyncio
import time

from tests.runtime.shells import SIM_MODEL, leaked_segments, random_work, request_specs, sim_instances
from tests.runtime.test_cluster import shm_segments, wait_gone
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.pressure import AutoChoice, ControllerDecision, DropPlan
from tidal.cluster.pressure.choose import replay
from tidal.cluster.pressure.record import replay as replay_plan
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams

N = 8
ENGINE = dict(dtype="float32", num_blocks_override=10, max_num_batched_tokens=64, swap_space="4MiB")


def _workload():
    long, short = random_work(5, N // 2, (100, 113), (10, 13)), random_work(6, N // 2, (4, 8), (4, 8))
    return [r for pair in zip(long, short, strict=True) for r in pair]  # dispatched 0, 1, 0, 1, ...


def _params(m: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


def _burst_tokens(llm, work) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        ids, m = work[i]
        out: list[int] = []
        async for o in llm.generate(None, _params(m), f"r{i}", prompt_token_ids=ids):
            out += o.outputs[0].delta_token_ids
        return out

    async def burst() -> list[list[int]]:
        return await asyncio.gather(*[one(i) for i in range(len(work))])

    return asyncio.run(burst())


def _eq1():
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware
    from tidal.sim.models import get_model
    from tidal.sim.pipeline import analytic_eq1

    return analytic_eq1(AnalyticCostModel(get_model(SIM_MODEL), get_hardware("cpu"), dtype_bytes=4))


def _run_real(work):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    eq1 = _eq1()
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE, microbatch_cost=(eq1.alpha, eq1.beta, eq1.gamma)),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), threads_per_instance=1, layers_per_chunk=4,
                      kv_pressure="auto")))
    choices: list[AutoChoice] = []
    plans: list[ControllerDecision] = []
    llm.pressure.choices, llm.pressure.decisions = choices, plans.append
    before = shm_segments()
    llm.start()
    pids = [h.pid for h in llm.handles]
    try:
        pools = {r.index: (r.num_blocks, r.block_size) for r in llm.monitor.instances}
        tokens = _burst_tokens(llm, work)
        deadline = time.monotonic() + 30  # a drop's restore, then the tail's reload
        while time.monotonic() < deadline and llm.pressure.drop.dropped:
            time.sleep(0.1)
        state = llm.stats["cluster"]["kv_pressure"]
        return tokens, choices, plans, state, pools, llm.config.scheduler, llm.pressure.drop.model
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
    cfg = PressureConfig("auto", get_link("shm", hw), model, arch.hidden_size * 4, _eq1(), layers_per_chunk=4,
                         overhead_s=hw.step_overhead_s, host_bytes_per_s=hw.host_bandwidth)
    handler = build_pressure(cfg)
    specs, ids = request_specs(work)
    sim = ClusterSimulator(instances, build_router("least-outstanding"), specs, request_ids=ids,
                           layout=ClusterLayout(2, "colocate", 0), pressure=handler)
    plans: list[ControllerDecision] = []
    handler.auto.kun.decisions = plans.append  # type: ignore[attr-defined]  (an AutoHandler)
    res = sim.run()
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    return handler.choices, plans, res.pressure  # type: ignore[attr-defined]


def test_auto_on_real_workers_answers_as_one_engine_and_chooses_as_the_simulator(make_engine):
    from tidal import LLM

    work = _workload()
    tokens, real, real_plans, state, pools, scheduler, model = _run_real(work)

    # one engine with a pool that holds everything: the same greedy tokens, request by request
    ref = LLM.from_engine(make_engine(max_num_batched_tokens=64)).generate(
        [{"prompt_token_ids": ids} for ids, _ in work], [_params(m) for _, m in work])
    assert tokens == [o.outputs[0].token_ids for o in ref]

    # the choices: made at instance 0's onset, recorded whole, replayed from the record, shown live
    assert real and {c.index for c in real} == {0}
    for c in real:
        again = replay(AutoChoice.from_dict(c.to_dict()))
        assert again.choice == c.choice and set(c.predictions) == {"recompute", "swap", "migrate", "drop"}
    auto = state["auto"]
    assert state["mode"] == "auto" and auto["modes"] == {"0": real[-1].choice}
    assert [(c["index"], c["choice"]) for c in auto["choices"]] == [(c.index, c.choice) for c in real]
    assert state["events_total"]["choose"] == len(real)
    for d in real_plans:  # KunServe's plans under the gate replay too
        assert replay_plan(d, model) == d.plan

    # the simulator on the same requests and pools makes the same choices and the same plans
    sim, sim_plans, sim_pressure = _run_sim(work, pools, scheduler, model)
    assert [(c.index, c.choice) for c in sim] == [(c.index, c.choice) for c in real]
    assert [d.kind for d in sim_plans] == [d.kind for d in real_plans]
    for r, s in zip(real_plans, sim_plans, strict=True):
        if isinstance(r.plan, DropPlan):
            assert (r.plan.changed, r.plan.layers, r.plan.freed_bytes) == (s.plan.changed, s.plan.layers,
                                                                           s.plan.freed_bytes)
    assert sim_pressure["counts"]["choose"] == len(sim)
