"""vLLM + PP (KunServe's Sec. 5.1 baseline): pipelines formed at time 0 from consecutive instances;
and a pipeline's idle stage gap (the calibrated pipeline cost), by hand."""

from __future__ import annotations

import pytest

from tidal.cluster.pressure import ChunkCost, ModelMemory
from tidal.cluster.router import build_router
from tidal.config import ConfigError, SchedulerConfig
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim.build import ClusterSpec, build_simulator
from tidal.sim.instance import SimInstance
from tidal.sim.links import LinkSpec
from tidal.sim.pipeline import PipelineCostModel, group_blocks
from tidal.sim.pressure import PressureConfig
from tidal.sim.simulator import ClusterSimulator
from tidal.sim.static_pipeline import StaticPipelineHandler
from tidal.workload import RequestSpec

MODEL = ModelMemory(num_layers=4, layer_bytes=640, kv_bytes_per_token=4)
LINK = LinkSpec("test", bandwidth=1e9, latency_s=0.0)


class Constant:
    name = "constant"

    def __init__(self, dt: float):
        self.dt = dt

    def step_time(self, plan):
        return self.dt if plan.chunks else 0.0


def _cfg(**kw) -> PressureConfig:
    return PressureConfig("preempt", LINK, MODEL, hidden_bytes=8, chunk_cost=ChunkCost(1.0, 0.0, 0.0), **kw)


def _instances(n, blocks=32):
    return [SimInstance(i, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256), blocks, 16, Constant(0.01),
                        4096) for i in range(n)]


def test_pairs_run_as_pipelines_from_the_start_and_the_odd_one_alone():
    insts = _instances(5)
    handler = StaticPipelineHandler(_cfg(lookahead=False), 2)
    specs = [RequestSpec(0.01 * i, 100, 20) for i in range(30)]
    sim = ClusterSimulator(insts, build_router("llumnix"), specs, pressure=handler)
    res = sim.run()
    assert all(r.success and r.counted_tokens == s.output_len for r, s in zip(res.records, specs, strict=True))
    groups = res.pressure["groups"]
    assert [g["group"] for g in groups] == [[0, 1], [2, 3]]
    assert [g["layers"] for g in groups] == [{0: [0, 2], 1: [2, 4]}, {2: [0, 2], 3: [2, 4]}]
    # each pool grew by the weights its stages do not hold: 2 x 32 blocks + 4 layers x 640 B / 64 B
    assert {g["num_blocks"] for g in groups} == {group_blocks(insts[:2], {0: (0, 2), 1: (2, 4)}, _cfg())} == {104}
    assert set(res.routed) <= {0, 2, 4}  # a group's later stage takes no request; the fifth runs alone
    assert 4 in res.routed and all(g["steps"] > 0 for g in groups)
    assert not {"drop", "restore", "exchange"} & set(res.pressure["counts"])  # it never changes its layout
    assert sim.instances == insts  # the simulator's list is back as it began


def test_cluster_spec_builds_vllm_pp_and_checks_it():
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a800-80g", instances=4, pipeline_parallel=2, link="ib-hdr",
                       scheduler=SchedulerConfig(max_num_batched_tokens=2048), lookahead=False)
    sim = build_simulator(spec, [RequestSpec(0.1 * i, 500, 50) for i in range(16)])
    assert isinstance(sim.pressure, StaticPipelineHandler) and not sim.pressure.cfg.lookahead
    res = sim.run()
    assert res.pressure["mode"] == "pp" and len(res.pressure["groups"]) == 2
    assert all(r.success for r in res.records)
    with pytest.raises(ConfigError, match="preempt on their own"):
        ClusterSpec(instances=4, pipeline_parallel=2, kv_pressure="drop")
    with pytest.raises(ConfigError, match="pipeline_parallel must be >= 1"):
        ClusterSpec(instances=4, pipeline_parallel=0)
    with pytest.raises(ValueError, match="at least 2 stages"):
        StaticPipelineHandler(_cfg(), 1)


def test_a_stage_gap_is_idle_time_in_every_microbatch():
    """Two stages, two equal microbatches of t: no bubble without a gap; with a gap g per stage per
    microbatch the period is t + 2g and the stages idle 2g of it."""
    chunks = tuple(ScheduledChunk(f"r{i}", (0,) * 4, 0, (), True, SamplingParams(max_tokens=4)) for i in range(2))
    plan = StepPlan(1, chunks, BatchComposition.of(list(chunks)))
    t, g = 0.02, 0.003
    base = PipelineCostModel(Constant(t), [0.5, 0.5], _cfg(lookahead=False), overhead_s=0.0)
    gapped = PipelineCostModel(Constant(t), [0.5, 0.5], _cfg(lookahead=False, stage_gap_s=g), overhead_s=0.0)
    transfer = LINK.chunk_time(4 * 8)
    assert base.step_time(plan) == pytest.approx(max(t, t + transfer))
    assert gapped.step_time(plan) == pytest.approx(max(t + 2 * g, t + 2 * g + transfer))
    assert base.bubble() == pytest.approx(1 - t / max(t, t + transfer))
    assert gapped.bubble() == pytest.approx(1 - t / (t + 2 * g + transfer))
    assert gapped.bubble() > base.bubble()
