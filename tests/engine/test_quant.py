"""Int4 execution of weights stored as 4-bit groups: the grid is recovered exactly, the kernel computes
the same matmul as the dequantized float weights, and the engine gives the same tokens."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from tidal.config import ConfigError, EngineConfig
from tidal.engine.loader import load_checkpoint
from tidal.engine.model import Linear, LlamaModel
from tidal.engine.quant import (
    GROUP,
    GroupedInt8Weight,
    describe_quantization,
    int4_grid,
    int4_supported,
    int8_grid,
    measure_crossover,
    measure_int8_crossover,
    pack_int4,
)

from .test_loader import _save, _tiny_qwen2_config, _write_gguf

pytestmark = pytest.mark.skipif(int4_supported(torch.device("cpu"), torch.float32) is not None,
                                reason="no CPU int4 kernel in this torch")


def q4_1(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1-style matrix: q in 0..15 with 0 and 15 in every group of 32, d > 0, any m."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15
    d = torch.rand(n, k // GROUP, generator=g) * 0.05 + 1e-3
    m = -torch.rand(n, k // GROUP, generator=g) * 0.4
    w = (q.float().view(n, -1, GROUP) * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, k)
    return w, q, d, m


def test_grid_is_recovered_exactly():
    w, q, d, m = q4_1(48, 96)
    got = int4_grid(w)
    assert got is not None
    gq, gd, gm = got
    assert torch.equal(gq.long(), q) and gq.dtype == torch.uint8
    torch.testing.assert_close(gd, d, rtol=1e-5, atol=0)
    torch.testing.assert_close(gm, m, rtol=0, atol=0)


def test_weights_off_the_grid_stay_float():
    w, *_ = q4_1(16, 64)
    assert int4_grid(torch.randn(16, 64)) is None  # a float checkpoint
    off = w.clone()
    off[3, 17] += 0.3 * (w[3, :32].amax() - w[3, :32].amin()) / 15  # one weight a third of a step off
    assert int4_grid(off) is None
    assert int4_grid(w.bfloat16().float()) is None  # bf16 rounding leaves the grid: needs the float32 values
    assert int4_grid(w[:, :48]) is None  # not whole groups
    # a constant group (d = 0) is on the grid
    flat = torch.full((2, 32), 0.25)
    gq, gd, gm = int4_grid(flat)
    assert torch.equal(gq, torch.zeros_like(gq)) and torch.equal(gd, torch.zeros(2, 1)) and torch.equal(gm, flat[:, :1])


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_kernel_equals_the_float_matmul(tokens):
    w, *_ = q4_1(64, 128, seed=tokens)
    packed = pack_int4(*int4_grid(w), torch.float32)
    x = torch.randn(tokens, 128)
    torch.testing.assert_close(packed.matmul(x), F.linear(x, w), rtol=1e-4, atol=1e-4)


def test_q8_0_grid_and_grouped_int8_matmul():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (64, 96), generator=g)
    q[:, ::GROUP] = 127  # Q8_0: the largest |weight| of a group is 127 steps
    d = torch.rand(64, 3, generator=g) * 0.01 + 1e-4
    w = (q.float().view(64, 3, GROUP) * d.unsqueeze(-1)).view(64, 96)
    gq, gd = int8_grid(w)
    assert torch.equal(gq.long(), q) and gq.dtype == torch.int8
    torch.testing.assert_close(gd, d, rtol=1e-6, atol=0)
    assert int8_grid(torch.randn(64, 96)) is None and int8_grid(w.bfloat16().float()) is None
    packed = GroupedInt8Weight.pack(gq, gd, torch.float32)
    x = torch.randn(3, 96, generator=g)
    torch.testing.assert_close(packed.matmul(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert packed.matmul(x).dtype == torch.float32 and packed.nbytes == 64 * 96 + 3 * 64 * 4


def test_crossover_is_a_timed_step_size():
    assert measure_crossover(256, 256, torch.bfloat16, repeats=3) in (0, 1, 2, 4, 8, 16, 32, 64, 128)
    assert measure_crossover(256, 48, torch.float32) == 0  # not whole groups of 32
    assert measure_crossover(100, 64, torch.bfloat16) == 0  # output rows not a multiple of 16
    assert measure_int8_crossover(512, 64, torch.bfloat16, repeats=3) in (0, 1, 2, 4, 8, 16, 32, 64, 128)


def test_linear_uses_int4_up_to_its_step_size(monkeypatch):
    w, *_ = q4_1(32, 64)
    lin = Linear(64, 32, bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(torch.randn(32))
    lin.int4 = pack_int4(*int4_grid(w), torch.float32)
    lin.int4.max_tokens = 4
    calls = []
    real = lin.int4.matmul
    monkeypatch.setattr(lin.int4, "matmul", lambda x: calls.append(x.shape[0]) or real(x))
    for n in (1, 4, 5):
        x = torch.randn(n, 64)
        torch.testing.assert_close(lin(x), F.linear(x, w, lin.bias), rtol=1e-4, atol=1e-4)
    assert calls == [1, 4]  # five tokens: the float matmul


def _tiny_model(tmp_path, types, mode, dtype=torch.float32):
    cfg = _tiny_qwen2_config(hidden_size=64, intermediate_size=128)
    import transformers

    state = _save(transformers.Qwen2ForCausalLM, cfg, tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    if not path.exists():
        _write_gguf(path, "qwen2", cfg, state, types)
    ckpt = load_checkpoint(str(path))
    model = LlamaModel(ckpt.arch, dtype, torch.device("cpu"))
    assert model.set_quantization(mode) is None
    model.load_weights(ckpt.weights())
    return model, ckpt


def test_only_matrices_stored_as_4bit_groups_get_int4(tmp_path):
    # q stored as Q8_0: the fused qkv matrix is not all on a 4-bit grid, so it stays float
    types = {"attn_q": QT.Q8_0, "attn_k": QT.Q4_1, "attn_v": QT.Q4_1, "attn_output": QT.Q4_1,
             "ffn_gate": QT.Q4_1, "ffn_up": QT.Q4_1, "ffn_down": QT.F16}
    model, _ = _tiny_model(tmp_path, types, "int4")
    report = model.quantization_report()
    assert report["int4_matrices"] == 2 * 2 and report["float_matrices"] == 2 * 2
    layer = model.layers["0"]
    assert layer.qkv_proj.int4 is None and layer.down_proj.int4 is None
    assert layer.o_proj.int4 is not None and layer.gate_up_proj.int4 is not None
    assert "int4 for 4 of 8" in describe_quantization(report)
    none, _ = _tiny_model(tmp_path, types, "none")
    assert none.quantization_report()["int4_matrices"] == 0


def test_restored_layers_get_their_int4_copy_back(tmp_path):
    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), QT.Q4_1)
    model, ckpt = _tiny_model(tmp_path, types, "int4")
    layer = model.layers["1"]
    x = torch.randn(3, 64)
    want = layer.qkv_proj(x)
    assert all(getattr(layer, n).int4 is not None for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    model.drop_layers([1])
    model.restore_layers([1], ckpt.weights())
    again = model.layers["1"]
    assert all(getattr(again, n).int4 is not None for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    torch.testing.assert_close(again.qkv_proj(x), want, rtol=0, atol=0)
    # a part written over a loaded fused matrix: the rest of its grid is unknown, so no int4 copy
    name = "model.layers.1.self_attn.q_proj.weight"
    model.load_weights((n, t) for n, t in ckpt.weights() if n == name)
    assert model.layers["1"].qkv_proj.int4 is None


def test_bad_quantization_is_refused():
    with pytest.raises(ConfigError, match="quantization must be one of"):
        EngineConfig.from_kwargs(quantization="int3")
    cuda = int4_supported(torch.device("cuda"), torch.bfloat16)
    assert cuda and "CPU-only" in cuda


def test_engine_tokens_equal_with_int4(make_engine):
    """The default model's Q4_1 matrices through the int4 kernel and its Q8_0 head through grouped
    int8, float32: the same greedy tokens as the dequantized float weights, and logits within
    float32 rounding of the kernels' sum order."""
    from tidal.core.sampling import SamplingParams

    prompts = [[1, 504, 3458, 314, 260], [1, 57, 1470, 30, 4473, 28, 411]]
    runs = {}
    for mode in ("none", "int4"):
        engine = make_engine(quantization=mode, kv_cache_memory="32MiB")
        assert (engine.quantization["int4_matrices"] > 0) == (mode == "int4")
        # the tied head is stored as Q8_0: forced, it runs as grouped int8 at every step size
        assert (engine.model.head_int8 is not None) == (mode == "int4")
        engine.runner.keep_logits = True
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p,
                               params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        tokens, last = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
            last.update(engine.runner.last_logits)
        runs[mode] = tokens, last
        kv = engine.kv_manager
        assert kv.num_free_blocks == kv.num_blocks
    assert runs["int4"][0] == runs["none"][0]
    for rid, logits in runs["none"][1].items():
        torch.testing.assert_close(runs["int4"][1][rid], logits, rtol=1e-3, atol=1e-3)


def test_float_checkpoints_skip_the_start_up_timing(tmp_path, monkeypatch, smol_tokenizer):
    """An HF (safetensors) checkpoint holds float weights: no matrix can be on a 4-bit grid, so
    ``auto`` neither times the kernels nor stages grids, and says why."""
    import transformers

    from tidal.engine import model as model_mod
    from tidal.engine.llm_engine import LLMEngine

    from .test_loader import _tiny_llama_config

    _save(transformers.LlamaForCausalLM, _tiny_llama_config(), tmp_path / "hf")

    def never(*a, **k):
        raise AssertionError("timed the kernels for a float checkpoint")

    monkeypatch.setattr(model_mod, "measure_crossover", never)
    monkeypatch.setattr(model_mod, "measure_int8_crossover", never)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tmp_path / "hf"), kv_cache_memory="16MiB"),
                       tokenizer=smol_tokenizer)
    q = engine.quantization
    assert q["int4_matrices"] == 0 and q["head_int8_max_tokens"] == 0 and "float" in q["why_not"]
    assert describe_quantization(q).startswith("float (quantization auto: ")


def _ratio_by_size(ratio):
    """A stand-in for quant._paired_ratio: time(4-bit) / time(float) as ``ratio(tokens)``."""
    def paired(fa, fb, repeats):
        assert fb.args[0] is F.linear and fa.args[0] is not F.linear
        return ratio(fa.args[2].shape[0])
    return paired


@pytest.mark.parametrize("upto,want", [(1, 1), (100, 128), (512, 512), (5000, 2048)])
def test_the_timing_stops_at_the_largest_step_the_engine_runs(monkeypatch, upto, want):
    """With a kernel that always wins, the probe stops at the first timed size >= ``upto`` (the step
    budget or the most sequences a step holds) or at the largest it times; one that never wins gives 0."""
    from tidal.engine import quant

    monkeypatch.setenv("TIDAL_DISK_CACHE_MB", "0")  # timed here, not read from an earlier process
    monkeypatch.setattr(quant, "_crossovers", {})
    monkeypatch.setattr(quant, "_paired_ratio", _ratio_by_size(lambda m: 0.5))
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=upto) == want
    assert measure_int8_crossover(64, 64, torch.float32, repeats=1, upto=upto) == want
    monkeypatch.setattr(quant, "_crossovers", {})
    monkeypatch.setattr(quant, "_paired_ratio", _ratio_by_size(lambda m: 2.0))
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=upto) == 0


@pytest.mark.parametrize("lost,want", [((), 512), ((64,), 512), ((256,), 512), ((512,), 256), ((64, 128), 32),
                                       ((1, 2), 0), ((8, 32, 128), 512), ((16, 32, 256), 8)])
def test_one_lost_size_does_not_end_the_timing(monkeypatch, lost, want):
    """The threshold is the largest size the 4-bit kernel won before two sizes in a row that it lost:
    a lone loss (noise, near the crossover) does not cut it short."""
    from tidal.engine import quant

    monkeypatch.setenv("TIDAL_DISK_CACHE_MB", "0")
    monkeypatch.setattr(quant, "_crossovers", {})
    monkeypatch.setattr(quant, "_paired_ratio", _ratio_by_size(lambda m: 1.0 if m in lost else 0.9))
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=512) == want


def test_a_crossover_is_timed_once_per_machine(monkeypatch, tmp_path):
    """A later process (here: the per-process table emptied) reads the timing from the disk cache
    instead of timing again; another step budget or kernel build is timed anew; a torn
    file is timed again and rewritten."""
    from tidal.engine import disk_cache, quant

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DISK_CACHE_MB", raising=False)
    timed: list[int] = []

    def ratio(m):
        timed.append(m)
        return 0.9 if m <= 16 else 1.1

    monkeypatch.setattr(quant, "_paired_ratio", _ratio_by_size(ratio))
    monkeypatch.setattr(quant, "_crossovers", {})
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=512) == 16 and timed
    timed.clear()
    monkeypatch.setattr(quant, "_crossovers", {})
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=512) == 16 and not timed
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=64) == 16 and timed  # another budget
    timed.clear()
    monkeypatch.setattr(quant, "_crossovers", {})
    monkeypatch.setattr(quant.native, "matmul_build", lambda: "qmatmul_edited")
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=512, kernels="tidal") == 16 and timed
    with open(disk_cache.crossovers_path(), "w") as f:
        f.write('{"torn')
    timed.clear()
    monkeypatch.setattr(quant, "_crossovers", {})
    assert measure_crossover(64, 64, torch.float32, repeats=1, upto=512) == 16 and timed
    with open(disk_cache.crossovers_path()) as f:
        assert list(json.load(f).values()) == [16]


def test_a_start_says_when_it_times_the_kernels(monkeypatch, tmp_path, capsys):
    """The timings (a machine's first start) are a phase with a line when it begins and ends; a start
    that finds every timing on disk prints nothing of it."""
    from tidal.config import ModelArch
    from tidal.engine import quant

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DISK_CACHE_MB", raising=False)
    monkeypatch.setattr(quant, "_crossovers", {})
    monkeypatch.setattr(quant, "_paired_ratio", _ratio_by_size(lambda m: 0.9 if m <= 16 else 1.1))
    arch = ModelArch("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    model = LlamaModel(arch, torch.float32, torch.device("cpu"))
    capsys.readouterr()
    assert model.set_quantization("auto", 64, 8) is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"engine: timing the {model.kernels} 4/8-bit kernels against float32 "
                                               "matmuls (5 shapes; once per machine) ...") \
        and err[1].startswith("engine: timed in "), err
    assert model._int4_tokens and all(v == 16 for v in model._int4_tokens.values())
    monkeypatch.setattr(quant, "_crossovers", {})  # a later process: the disk cache has them
    assert model.set_quantization("auto", 64, 8) is None
    assert capsys.readouterr().err == ""


def test_processes_starting_together_time_one_at_a_time(monkeypatch, tmp_path):
    """Two starts that miss the cache at once (two threads here, each with its own open file, as two
    worker processes would be): one times while the other waits on the lock, then reads the file;
    the timing runs once and never two at a time."""
    import threading
    import time

    from tidal.engine import quant

    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIDAL_DISK_CACHE_MB", raising=False)
    lock = threading.Lock()
    state = {"now": 0, "most": 0, "calls": 0}

    def ratio(m):
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.05)
        with lock:
            state["now"] -= 1
        return 0.9 if m <= 32 else 1.1

    monkeypatch.setattr(quant, "_paired_ratio", _ratio_by_size(ratio))
    monkeypatch.setattr(quant, "_crossovers", {})
    got: list[int] = []
    starts = [threading.Thread(target=lambda: got.append(measure_crossover(64, 64, torch.float32, repeats=1,
                                                                           upto=512))) for _ in range(2)]
    for t in starts:
        t.start()
    for t in starts:
        t.join(timeout=60)
    assert got == [32, 32]
    assert state["most"] == 1  # never two timings at once
    assert state["calls"] == 8  # sizes 1..32 won, 64 and 128 lost: one scan of 8 sizes, not two


def test_only_an_edited_matmul_is_timed_anew(tmp_path, monkeypatch):
    """The crossovers' key names the matmuls' build: editing the attention kernel renames the library
    (it is built anew) but keeps the timings; editing the matmul kernel or the shared header changes both."""
    import shutil

    from tidal.engine import native

    for f in native.SOURCES + native.HEADERS:
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(native, "SOURCES", [tmp_path / f.name for f in native.SOURCES])
    monkeypatch.setattr(native, "HEADERS", [tmp_path / f.name for f in native.HEADERS])
    monkeypatch.setattr(native, "MATMUL_SOURCES", [tmp_path / f.name for f in native.MATMUL_SOURCES])
    names = [(native.build_name(), native.matmul_build())]
    for edited in ("paged_attention.cpp", "qmatmul.cpp", "kernels.h"):
        with open(tmp_path / edited, "a") as f:
            f.write("// edited\n")
        names.append((native.build_name(), native.matmul_build()))
    assert len({lib for lib, _ in names}) == 4  # every edit rebuilds the library
    assert names[1][1] == names[0][1]  # attention edited: the same matmul build
    assert len({mm for _, mm in names[1:]}) == 3  # matmul or header edited: a new one each time


def test_paired_ratio_times_both_sides_each_round():
    from tidal.engine import quant

    calls = []
    ratio = quant._paired_ratio(lambda: calls.append("a") or time.sleep(0.04),
                                lambda: calls.append("b") or time.sleep(0.01), repeats=3)
    assert calls == ["a", "b"] * 4  # a warm-up pair, then three rounds
    assert 1.5 < ratio < 20  # ~4: each side sleeps its own time (a loaded machine only oversleeps)


def test_greedy_steps_take_the_fused_head_and_the_same_tokens(make_engine, monkeypatch):
    """A step whose rows are all greedy without logprobs asks the Q8_0 head for the argmax alone
    (tidal's fused kernel: no logits in memory); its tokens are those of the full logits. A step with a
    sampled row, logprobs or kept logits goes the full way."""
    from tidal.core.sampling import SamplingParams
    from tidal.engine import native

    calls: list[int] = []
    fused = native.Q8_0Weight.argmax

    def counted(self, x):
        calls.append(x.shape[0])
        return fused(self, x)

    monkeypatch.setattr(native.Q8_0Weight, "argmax", counted)
    prompts = [[1, 504, 3458, 314, 260], [1, 57, 1470, 30, 4473, 28, 411], [1, 9, 80, 4000]]

    def run(keep: bool, params: list[SamplingParams]):
        engine = make_engine(quantization="int4", kv_cache_memory="32MiB")
        engine.runner.keep_logits = keep
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p, params=params[i])
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
        return engine, tokens

    greedy = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)] * 3
    engine, fast = run(False, greedy)
    native_head = isinstance(engine.model.head_int8, native.Q8_0Weight)
    assert (len(calls) > 0) == native_head  # where the head runs torch's int8 kernel, the full way
    assert not native_head or sum(calls) == 3 * 6  # every sampled row: one per request and step
    calls.clear()
    _, full = run(True, greedy)
    assert full == fast and not calls
    mixed = [greedy[0], SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)]
    _, out = run(False, mixed)
    assert not calls and out["r0"] == fast["r0"] and out["r2"] == fast["r2"]


def test_greedy_batches_by_bound_and_verify_keep_their_tokens(make_engine, monkeypatch):
    """Twenty greedy requests at once: on a CPU with AVX-512 VNNI their steps of 16+ rows take the
    head's bound-and-verify argmax (greedy_head.cpp); every token equals the full logits' argmax."""
    import random

    from tidal.core.sampling import SamplingParams
    from tidal.engine import native

    if not native.bounded_argmax():
        pytest.skip("no AVX-512 VNNI build here")
    rng = random.Random(5)
    prompts = [[1, *(rng.randrange(100, 40000) for _ in range(rng.randrange(3, 12)))] for _ in range(20)]

    def run(keep: bool):
        engine = make_engine(quantization="int4", kv_cache_memory="32MiB")
        engine.runner.keep_logits = keep
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", prompt_token_ids=p,
                               params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.outputs[0].token_ids
        return engine, tokens

    rows: list[int] = []
    bounded = torch.ops.tidal.q8_0_argmax_bounded
    monkeypatch.setattr(torch.ops.tidal, "q8_0_argmax_bounded", lambda x, *a: rows.append(x.shape[0]) or bounded(x, *a))
    engine, fast = run(False)
    assert engine.model.head_int8.bounds is not None and rows.count(20) == 8  # every step: the prefill's and 7 decodes'
    _, full = run(True)
    assert fast == full and len(fast) == 20 and all(len(t) == 8 for t in fast.values())
