"""Step-time tails (``--step-jitter``): deterministic given a seed, the host term's mean as given,
the interference only on mixed steps, the planners' profile on the mean model."""

from __future__ import annotations

import statistics

import pytest

from tidal.config import SchedulerConfig
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim.build import ClusterSpec, build_simulator
from tidal.sim.jitter import FITTED, JitteredCostModel, JitterParams, with_jitter
from tidal.workload import RequestSpec

SP = SamplingParams(max_tokens=8)


class Flat:
    name = "flat"

    def step_time(self, plan):
        return 0.010


def _plan(prefill: int, decodes: int) -> StepPlan:
    chunks = ([ScheduledChunk("p", (0,) * prefill, 0, (), True, SP)] if prefill else []) + \
             [ScheduledChunk(f"d{i}", (0,), 100, (), True, SP) for i in range(decodes)]
    return StepPlan(0, tuple(chunks), BatchComposition.of(chunks))


def test_off_is_the_base_model_and_bad_params_are_refused():
    base = Flat()
    assert with_jitter(base, "off") is base
    assert isinstance(with_jitter(base, "fitted"), JitteredCostModel) or FITTED.is_off
    with pytest.raises(ValueError, match="step jitter"):
        with_jitter(base, "sometimes")
    with pytest.raises(ValueError, match="jitter"):
        JitterParams(seq_s=-1.0)


def test_interference_only_on_mixed_steps():
    m = JitteredCostModel(Flat(), JitterParams(mixed_s=0.002))  # no host term: exact
    assert m.step_time(_plan(0, 5)) == pytest.approx(0.010)  # decodes only
    assert m.step_time(_plan(512, 0)) == pytest.approx(0.010)  # a prefill alone
    assert m.step_time(_plan(512, 5)) == pytest.approx(0.010 + 5 * 0.002)  # each decode of a mixed step
    assert m.step_time(StepPlan(0, (), BatchComposition())) == 0.010  # no step: the base's answer


def test_host_jitter_has_the_given_mean_and_a_tail_and_repeats_with_its_seed():
    p = JitterParams(seq_s=50e-6, sigma=1.0)
    m = JitteredCostModel(Flat(), p, seed=3)
    host = [m.step_time(_plan(0, 100)) - 0.010 for _ in range(20000)]
    assert statistics.fmean(host) == pytest.approx(100 * 50e-6, rel=0.05)  # mean seq_s per sequence
    q = statistics.quantiles(host, n=100)
    assert q[98] > 4 * q[49]  # a log-normal tail: p99 far above the median
    again = JitteredCostModel(Flat(), p, seed=3)
    assert [again.step_time(_plan(0, 100)) - 0.010 for _ in range(100)] == host[:100]
    other = JitteredCostModel(Flat(), p, seed=4)
    assert [other.step_time(_plan(0, 100)) - 0.010 for _ in range(100)] != host[:100]


def _run(jitter: str, seed: int):
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=2, router="round-robin",
                       scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64),
                       step_jitter=jitter, jitter_params=JitterParams(seq_s=40e-6, sigma=1.0, mixed_s=0.3e-3),
                       jitter_seed=seed)
    specs = [RequestSpec(0.05 * i, 300 + 37 * (i % 9), 40 + 11 * (i % 5)) for i in range(60)]
    sim = build_simulator(spec, specs)
    return sim, sim.run()


def test_a_simulation_with_tails_is_deterministic_given_its_seed_and_slower_than_the_mean():
    sim, a = _run("fitted", 1)
    assert isinstance(sim.instances[0].cost_model, JitteredCostModel)
    _, b = _run("fitted", 1)
    _, c = _run("fitted", 2)
    _, off = _run("off", 1)
    gaps = lambda r: [g for rec in r.records for g in rec.itl_s]  # noqa: E731
    assert gaps(a) == gaps(b) and gaps(a) != gaps(c)
    assert all(r.success for r in a.records)
    assert statistics.fmean(gaps(a)) > statistics.fmean(gaps(off))  # host time and interference add
    q_a, q_off = statistics.quantiles(gaps(a), n=100), statistics.quantiles(gaps(off), n=100)
    assert q_a[98] / q_a[49] > q_off[98] / q_off[49]  # and a longer tail


def test_the_split_planner_profiles_the_mean_model():
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=2, mode="split",
                       scheduler=SchedulerConfig(batching="slo-compose", tbt_slo_ms=100, max_num_batched_tokens=2048,
                                                 max_num_seqs=64), step_jitter="fitted",
                       jitter_params=JitterParams(seq_s=40e-6, sigma=1.0, mixed_s=0.3e-3))
    sim = build_simulator(spec, [RequestSpec(0.0, 500, 20)])
    base = sim.instances[0].cost_model.base
    grid = sim.planner.predictor.step_time
    assert grid(512, 1024, 32) == pytest.approx(base.step_time(_plan_at(512, 1024, 32)), rel=1e-12)


def _plan_at(p: int, ctx: int, d: int) -> StepPlan:
    sp = SamplingParams(max_tokens=1)
    chunks = [ScheduledChunk("p", (0,) * p, 0, (), True, sp)] + \
             [ScheduledChunk(f"d{i}", (0,), ctx - 1, (), True, sp) for i in range(d)]
    return StepPlan(0, tuple(chunks), BatchComposition.of(chunks))


def test_a_receive_costs_its_bytes_over_the_bandwidth_plus_its_fixed_time():
    m = JitteredCostModel(Flat(), JitterParams(recv_bw=50e9, recv_s=0.002))
    assert m.receive_time(10**9) == pytest.approx(0.002 + 0.020)
    assert JitteredCostModel(Flat(), JitterParams(mixed_s=1e-3)).receive_time(10**9) == 0.0
    assert not JitterParams(recv_bw=1e9).is_off
    with pytest.raises(ValueError, match="recv_bw"):
        JitterParams(recv_bw=-1.0)


def _pd(params: JitterParams | None):
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=2, mode="disaggregate",
                       prefill_instances=1, scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64),
                       step_jitter="off" if params is None else "fitted", jitter_params=params)
    # a short request decodes on the decode instance while a 4K prompt prefills, then lands beside it
    sim = build_simulator(spec, [RequestSpec(0.0, 100, 120), RequestSpec(0.2, 4096, 4)])
    return sim, sim.run()


def test_a_1p1d_landing_stops_the_decode_instances_decodes_for_its_receive():
    """vLLM 0.7's disaggregated prefill pulls the KV inside the decode worker's step: the request
    decoding there waits bytes / recv_bw once, when the 4K prompt lands (tidal.sim.jitter)."""
    _, off = _pd(None)
    sim, on = _pd(JitterParams(recv_bw=10e9))
    (h,) = [h for h in sim.handoffs if h.num_tokens == 4096]
    assert h.nbytes == 4096 * 48 * 8 * 128 * 2 * 2  # Qwen-2.5-14B's KV: 192 KiB a token
    short_off, short_on = off.records[0].itl_s, on.records[0].itl_s
    assert len(short_off) == len(short_on) == 119
    extra = sorted((b - a for a, b in zip(short_off, short_on, strict=True)), reverse=True)
    assert extra[0] == pytest.approx(h.nbytes / 10e9, rel=0.02)  # the gap the landing fell in: 80 ms more
    assert abs(extra[1]) < 0.002  # every other gap as before (within the 4K request's own decode)


def test_the_testbed_attention_replaces_only_what_it_fits():
    from tidal.sim.hardware import get_hardware
    from tidal.sim.jitter import testbed

    hw = get_hardware("a100-80g")
    assert testbed(hw, JitterParams(seq_s=1e-5)) is hw  # nothing fitted: Vidur's attention
    tb = testbed(hw, JitterParams(attn_compute_efficiency=0.5, attn_self_factor=1.15))
    assert (tb.attn_compute_efficiency, tb.attn_self_factor) == (0.5, 1.15)
    assert tb.compute_efficiency == hw.compute_efficiency and tb.attn_memory_efficiency == hw.attn_memory_efficiency
    for bad in (dict(attn_compute_efficiency=1.5), dict(attn_self_factor=0.5), dict(attn_self_factor=-1.0)):
        with pytest.raises(ValueError, match="attn_"):
            JitterParams(**bad)


def test_fitted_runs_the_testbeds_prefill_attention_and_off_vidurs():
    """One 8K prompt alone: its time to first token falls when the testbed's attention is faster
    (FlashAttention's masked-block skip and a higher share of peak) and only with ``fitted``."""
    def ttft(jitter, params):
        spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=1, step_jitter=jitter,
                           jitter_params=params, scheduler=SchedulerConfig(max_num_batched_tokens=2048))
        res = build_simulator(spec, [RequestSpec(0.0, 8192, 2)]).run()
        return res.records[0].ttft_s

    vidur = JitterParams(seq_s=0.0, sigma=0.0)
    fast = JitterParams(attn_compute_efficiency=0.5, attn_self_factor=1.15)
    assert ttft("off", fast) == ttft("off", vidur)  # off: the hardware spec's attention, whatever is fitted
    assert ttft("fitted", fast) < 0.9 * ttft("fitted", vidur)
