"""``tidal bench offline``: workloads, FLOP accounting, and a tiny end-to-end run against transformers."""

from __future__ import annotations

import functools
import json
import sys

import pytest

from tidal.bench import offline as ob
from tidal.bench import offline_systems as osys
from tidal.config import ModelArch


def test_workloads_are_deterministic_and_shaped():
    names = ["a", "b", "c"]
    w1 = ob.make_workloads(names, vocab_size=1000, avoid_ids=[0, 1, 2], seed=3)
    w2 = ob.make_workloads(names, vocab_size=1000, avoid_ids=[0, 1, 2], seed=3)
    assert [w.prompts for w in w1] == [w.prompts for w in w2]
    a, b, c = w1
    assert a.num_requests == 64 and all(32 <= n <= 512 for n in a.prompt_lens)
    assert len(set(a.prompt_lens)) > 10  # really spread, not constant
    assert b.num_requests == 32 and set(b.prompt_lens) == {128}
    assert c.num_requests == 1 and c.prompt_lens == [128]
    assert all(w.output_len == 128 for w in w1)
    assert all(t not in (0, 1, 2) and 0 <= t < 1000 for w in w1 for p in w.prompts for t in p)
    other = ob.make_workloads(["b"], vocab_size=1000, seed=4)[0]
    assert other.prompts != b.prompts
    small = ob.make_workloads(names, vocab_size=1000, num_requests=2, output_len=8)
    assert [w.num_requests for w in small] == [2, 2, 1]
    assert all(w.output_len == 8 and w.expected_output_tokens == 8 * w.num_requests for w in small)
    with pytest.raises(ValueError):
        ob.make_workloads(["z"], vocab_size=1000)


def test_decode_flops():
    arch = ModelArch("llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16
    assert ob.linear_params(arch) == 2 * per_layer + 100 * 8
    # batch 3 at context 10 each: matmuls + QK^T and PV over 10 keys per head per layer
    assert ob.decode_step_flops(arch, 3, 30) == 2 * ob.linear_params(arch) * 3 + 4 * 30 * 2 * 4 * 2


def test_ratios_pick_best_peer():
    rows = {"tidal": {"status": "ok", "output_tok_s": 100.0, "decode_tok_s_est": 50.0},
            "hf": {"status": "ok", "output_tok_s": 50.0, "decode_tok_s_est": 25.0},
            "hf-cb": {"status": "ok", "output_tok_s": 80.0, "decode_tok_s_est": None},
            "llamacpp": {"status": "failed", "reason": "x"}}
    r = ob._ratios(rows)
    assert r["output_tok_s"] == {"hf": 2.0, "hf-cb": 1.25}
    assert r["decode_tok_s_est"] == {"hf": 2.0}
    assert r["best_peer"] == "hf-cb" and r["tidal_over_best_peer"] == 1.25


def test_a_run_of_tidal_variants_alone_has_ratios_but_no_best_peer():
    """``--systems tidal,tidal-compile``: the report gives tidal/tidal-compile and names no peer."""
    from tidal.bench.offline_report import format_report

    rows = {"tidal": {"status": "ok", "output_tok_s": 100.0, "decode_tok_s_est": None},
            "tidal-compile": {"status": "ok", "output_tok_s": 125.0, "decode_tok_s_est": None}}
    r = ob._ratios(rows)
    assert r["output_tok_s"] == {"tidal-compile": 0.8} and "best_peer" not in r
    report = {"command": "x", "machine": {"cpu_model": "cpu", "cores": 2, "num_threads": 2, "torch": "t",
                                          "dtype": "float32", "isa": []},
              "model": {"path": "m", "architecture": "llama", "num_params": 1, "linear_params": 1},
              "systems": {}, "workloads": {"b": {"description": "d", "prompt_tokens": 4, "expected_output_tokens": 4,
                                                 "results": {}, "ratios": r}}}
    text = format_report(report)
    assert "b: tidal/tidal-compile 0.80x" in text and "best peer" not in text and "ISA:" not in text
    report["machine"].update(isa=["avx2", "avx512f"], torch_cpu_capability="AVX2",
                             isa_limits={"ATEN_CPU_CAPABILITY": "avx2", "TIDAL_NATIVE_SIMD": "avx2"})
    assert ("ISA: avx2 avx512f; torch's kernels AVX2 (limited: ATEN_CPU_CAPABILITY=avx2 TIDAL_NATIVE_SIMD=avx2)"
            in format_report(report))  # an AVX2 run on an AVX-512 machine says so


def test_unknown_system_is_an_error():
    with pytest.raises(ValueError):
        ob.resolve_systems(["tidal", "vllm"])


def _ctx(tmp_path, model_path=None) -> ob.BenchContext:
    arch = ModelArch("llama", vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=4)
    wl = ob.make_workloads(["b"], vocab_size=100, avoid_ids=[2], num_requests=3, output_len=5)
    if model_path is None:
        model_path = tmp_path / "m.gguf"
        model_path.write_bytes(b"GGUF")
    return ob.BenchContext(str(model_path), "float32", 1, arch, 2, 3, 133, wl)


def test_llamacpp_runner_with_a_stand_in_module(tmp_path, monkeypatch):
    """llama-cpp-python is optional: drive the runner against a stand-in with its documented API."""
    import importlib.machinery
    import types

    calls = {"init": None, "reset": 0, "prompts": []}

    class FakeLlama:
        def __init__(self, model_path, **kw):
            calls["init"] = (model_path, kw)
            self.n_tokens = 0

        def reset(self):
            calls["reset"] += 1
            self.n_tokens = 0

        def generate(self, tokens, temp=0.8, repeat_penalty=1.1, reset=True, **kw):
            assert temp == 0.0 and repeat_penalty == 1.0
            calls["prompts"].append(list(tokens))
            i = 0
            while True:  # like Llama.generate: never stops by itself, EOS (2) included
                yield 2 if i % 2 else (sum(tokens) + i) % 100
                i += 1

    mod = types.ModuleType("llama_cpp")
    mod.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    mod.Llama = FakeLlama
    mod.__version__ = "0.0-test"
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    ctx = _ctx(tmp_path)
    runner = osys.LlamaCppRunner(ctx)
    runner.load()
    path, kw = calls["init"]
    assert path == ctx.model_path and kw["n_threads"] == 1 and kw["logits_all"] is False
    assert kw["n_ctx"] >= ctx.max_seq_len and kw["verbose"] is False
    out = runner.generate(ctx.workloads[0].prompts, 5)
    assert [len(t) for t in out.token_ids] == [5, 5, 5]
    assert out.token_ids[0][1] == 2  # EOS does not end the request
    assert calls["reset"] == 3 and calls["prompts"] == ctx.workloads[0].prompts
    assert runner.settings()["llama_cpp_version"] == "0.0-test"
    runner.close()


def test_llamacpp_missing_or_not_gguf_is_a_skip(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes find_spec fail like a missing package
    real = osys.importlib.util.find_spec

    def find_spec(name, *a, **k):
        return None if name == "llama_cpp" else real(name, *a, **k)

    monkeypatch.setattr(osys.importlib.util, "find_spec", find_spec)
    with pytest.raises(ob.SystemUnavailable, match="not installed"):
        osys.LlamaCppRunner(_ctx(tmp_path)).load()
    assert "llamacpp" not in ob.installed_systems()


@pytest.mark.timeout(300)
def test_tiny_run_tidal_vs_hf(tmp_path, monkeypatch, reuse_smol_tokenizer, reuse_hf_smol):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    # each of the 2 x 2 x 2 peak timings lasts at least min_time_s (0.25 s): a tenth is plenty for gflops > 0
    monkeypatch.setattr(ob, "measure_matmul_peak", functools.partial(ob.measure_matmul_peak, min_time_s=0.025))
    out = tmp_path / "res" / "offline.json"
    opts = ob.BenchOptions(workloads=["b"], systems=["tidal", "hf"], repeats=1, dtype="float32", num_requests=2,
                           output_len=8, output=str(out), peak_square_n=256, peak_samples=2, quiet=True)
    res = ob.run_benchmark(opts)

    rep = json.loads(out.read_text())
    for key in ("command", "machine", "model", "options", "systems", "workloads", "peak", "peak_fraction", "plot"):
        assert key in rep, key
    m = rep["machine"]
    assert m["cores"] >= 1 and m["dtype"] == "float32" and m["torch"] and m["num_threads"] >= 1
    assert rep["systems"]["tidal"]["status"] == "ok" and rep["systems"]["hf"]["status"] == "ok"
    assert set(rep["workloads"]) == {"b"}
    w = rep["workloads"]["b"]
    assert w["num_requests"] == 2 and w["output_len"] == 8 and w["expected_output_tokens"] == 16
    for name in ("tidal", "hf"):
        row = w["results"][name]
        assert row["status"] == "ok", row
        assert row["output_tokens"] == 16 and row["output_tokens_all"] == [16]
        assert row["wall_s"] > 0 and row["output_tok_s"] > 0
        assert row["prefill_s"] > 0
        assert row["decode_tok_s"] is None or row["decode_tok_s"] > 0
    assert w["results"]["tidal"]["decode_tok_s"] > 0  # from tidal's own decode steps
    assert w["ratios"]["output_tok_s"]["hf"] > 0 and w["ratios"]["best_peer"] == "hf"
    assert rep["peak"]["square"]["gflops"] > 0 and rep["peak"]["skinny"]["gflops"] > 0
    pf = rep["peak_fraction"]
    assert pf["status"] == "ok" and pf["batch"] == 2 and pf["fraction_of_square_peak"] > 0

    png = tmp_path / "res" / "offline.png"
    assert rep["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    gen = res.generated["b"]
    assert [len(t) for t in gen["tidal"]] == [8, 8]
    assert [len(t) for t in gen["hf"]] == [8, 8]
    assert gen["tidal"] == gen["hf"]  # greedy, float32: the same tokens
    assert w["results"]["hf"]["greedy_match_requests"] == 2
    assert "workload b" in res.text and "tidal/hf" in res.text

    # the report drops into benchmarks/results/ as it is: `tidal bench report` renders it
    from tidal.bench import report

    assert rep["date"][:2] == "20" and rep["tidal"]["version"]
    runs = report.load_runs(str(tmp_path / "res"))
    assert [r.kind for r in runs] == ["offline"]
    page = report.render_page(runs)
    assert f"`{rep['command']}`" in page and f"#### {rep['date']}: tidal bench offline" in page
    assert "| (b) batch of 2, prompts of 128 tokens, 8 output tokens each |" in page
    assert f"**{w['ratios']['tidal_over_best_peer']:.2f}x** transformers" in page


def _offline_args(*argv: str):
    from tidal.cli import build_parser

    return build_parser().parse_args(["bench", "offline", *argv])


def test_dtype_default_is_what_the_engine_picks(monkeypatch):
    """`tidal bench offline` defaults to the engine's `auto`: bf16 only where the CPU has it natively."""
    import torch

    from tidal.engine.sizing import dtype_name, resolve_dtype

    opts = ob.options_from_args(_offline_args())
    assert opts.dtype == "auto"
    engine_pick = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert dtype_name(opts.dtype, "cpu") == engine_pick
    # an AVX2-only CPU (no native bf16): auto is float32, where the bf16 default took minutes per matmul
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert dtype_name(opts.dtype, "cpu") == "float32"
    assert ob.options_from_args(_offline_args("--dtype", "bfloat16")).dtype == "bfloat16"


def test_shared_flags_map_to_options():
    opts = ob.options_from_args(_offline_args("--quiet", "--no-plots", "--num-threads", "1", "--seed", "4",
                                              "--num-requests", "2", "--max-num-batched-tokens", "64"))
    assert opts.quiet and opts.plot == "" and opts.num_threads == 1 and opts.seed == 4
    assert opts.num_requests == 2 and opts.max_num_batched_tokens == 64
    assert ob.options_from_args(_offline_args("--no-progress")).quiet


@pytest.mark.timeout(300)
def test_default_dtype_run_reports_the_resolved_dtype(tmp_path, monkeypatch, capsys):
    """A tidal-only run on a CPU without native bf16 runs and reports float32, never "auto"."""
    import torch

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    out = tmp_path / "offline.json"
    opts = ob.BenchOptions(workloads=["c"], systems=["tidal"], repeats=1, output_len=3, output=str(out), plot="",
                           peak_square_n=64, peak_samples=1, prefill_runs=False, num_threads=1)
    assert opts.dtype == "auto"
    res = ob.run_benchmark(opts)
    rep = json.loads(out.read_text())
    assert rep["machine"]["dtype"] == rep["options"]["dtype"] == "float32"
    assert rep["options"]["dtype_requested"] == "auto"
    assert rep["peak"]["dtype"] == "float32" and rep["systems"]["tidal"]["settings"]["dtype"] == "float32"
    assert rep["workloads"]["c"]["results"]["tidal"]["status"] == "ok"
    machine_line = res.text.splitlines()[1]
    assert machine_line.startswith("machine:") and "dtype float32" in machine_line and "auto" not in machine_line
    assert "[   ...]" in capsys.readouterr().err  # progress lines through tidal.common.progress
