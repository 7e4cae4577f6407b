"""tidal profile on the real default model: a tiny grid, and the cost model fitted from it."""

from __future__ import annotations

import functools
import json
import statistics

import pytest

from tidal.common.results import load_eq1
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.engine import profiler
from tidal.engine.profiler import FORMAT, default_grid, profile_engine, time_chunks
from tidal.sim.profiled import ProfiledCostModel


def small_runs(mp: pytest.MonkeyPatch, prompt: tuple[int, int], output: tuple[int, int],
               batch_sizes: tuple[int, ...]) -> None:
    """Shorter requests in the live serving runs (default prompts of 16-768 tokens and outputs of
    8-160: most of the profile's time on one thread) and fewer batch sizes in the overhead fit
    (default up to 32): the same code, the same kinds of samples, a fraction of the work."""
    mp.setattr(profiler, "measure_live", functools.partial(profiler.measure_live, prompt=prompt, output=output))
    mp.setattr(profiler, "measure_overhead", functools.partial(profiler.measure_overhead, batch_sizes=batch_sizes))


# the median of three runs survives one run a busy neighbour preempted; of two it is their mean
REPEATS = 3


@pytest.fixture(scope="module")
def profiled(make_engine):
    import torch

    before = torch.get_num_threads()
    # one thread: two wait on each other at every barrier, so a busy neighbour makes their timings noise
    engine = make_engine(num_threads=1, kv_cache_memory="256MiB")
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        small_runs(mp, prompt=(16, 128), output=(8, 48), batch_sizes=(1, 4, 8))
        data = profile_engine(engine, default_grid(quick=True), repeats=REPEATS, warmup=1,
                              progress=lambda done, total, s: seen.append((done, total)), live_runs=((6, 4.0),))
    yield engine, data, seen
    torch.set_num_threads(before)


def test_profile_has_the_format_and_positive_times(profiled):
    engine, data, seen = profiled
    assert data["format"] == FORMAT
    json.loads(json.dumps(data))  # JSON-able
    grid = [s for s in data["samples"] if s.get("source") != "live"]
    live = [s for s in data["samples"] if s.get("source") == "live"]
    assert len(grid) == len(default_grid(quick=True)) and not data["skipped"]
    for s in grid:
        assert s["time_s"] > 0 and len(s["times_s"]) == REPEATS and all(t > 0 for t in s["times_s"])
        assert all(len(c) == 3 for c in s["chunks"])
    # the live run: the scheduler's own batches, every prompt prefilled and every token decoded
    assert len(live) > 10 and all(s["time_s"] > 0 for s in live)
    assert any(len(s["chunks"]) > 1 for s in live)  # batching happened
    assert sum(n for s in live for _, n, _ in s["chunks"] if n == 1) > 0  # decodes
    assert data["model"]["num_layers"] == engine.arch.num_layers
    if engine.device.type == "cpu":  # the CPU thread count the engine was given (a GPU ignores it)
        assert data["threads"] == 1
    assert data["block_size"] == engine.kv_manager.block_size
    assert data["overhead"]["per_step_s"] >= 0 and data["overhead"]["per_seq_s"] >= 0
    assert (REPEATS * len(default_grid(quick=True)),) * 2 in seen  # one call per timed run
    assert seen[-1] == (1, 1)  # then the live run


def test_nothing_leaks(profiled):
    engine = profiled[0]
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert not engine.runner.sampler._request_gens


def test_fitted_model_predicts_the_samples(profiled):
    data = profiled[1]
    model = ProfiledCostModel.from_profile(data)
    mean = statistics.fmean(s["time_s"] for s in data["samples"])

    def median_errors(samples):
        """(the fit's, a model that knows nothing of the batch's: one mean time) median relative error"""
        fit = [abs(model.execute_time([tuple(c) for c in s["chunks"]]) - s["time_s"]) / s["time_s"] for s in samples]
        flat = [abs(mean - s["time_s"]) / s["time_s"] for s in samples]
        return statistics.median(fit), statistics.median(flat)

    # The grid's points are medians of repeated runs: quiet, the fit is within ~5% of them against the
    # flat model's ~40%; with two busy loops beside it, ~10% against ~40%. The live samples are single
    # steps a busy neighbour can preempt (~20% against ~45% under those loops; CI saw 22% against 38%),
    # so over all samples the fit need only beat the flat model.
    fit, flat = median_errors([s for s in data["samples"] if s.get("source") != "live"])
    assert fit < 0.5 * flat and fit < 0.25, (fit, flat)
    fit, flat = median_errors(data["samples"])
    assert fit < flat and fit < 0.4, (fit, flat)
    assert model.fit_report()["median_abs_rel_err"] == pytest.approx(fit, rel=1e-6)
    # a step's time is the execution plus the engine's overhead outside it
    s = data["samples"][-1]
    chunks = [ScheduledChunk(f"r{i}", (1,) * n, st, (), smp, SamplingParams())
              for i, (st, n, smp) in enumerate(s["chunks"])]
    plan = StepPlan(0, tuple(chunks), BatchComposition.of(chunks))
    want = model.execute_time([tuple(c) for c in s["chunks"]]) + model.overhead_per_step_s \
        + model.overhead_per_seq_s * len(chunks)
    assert model.step_time(plan) == pytest.approx(want, rel=1e-12)


def test_larger_prefill_takes_longer(profiled):
    if profiled[0].device.type != "cpu":
        pytest.skip("on a GPU a 135M model's 16- and 128-token prefills are both launch-bound (seen on an H100)")
    times = {tuple(map(tuple, s["chunks"])): s["time_s"] for s in profiled[1]["samples"]}
    assert times[((0, 128, True),)] > times[((0, 16, True),)]


def test_time_chunks_frees_on_failure(profiled):
    engine = profiled[0]
    kv = engine.kv_manager
    too_big = [(0, 16, True)] + [(kv.num_blocks * kv.block_size, 1, True)]
    with pytest.raises(RuntimeError, match="cannot hold"):
        time_chunks(engine, too_big, repeats=1, warmup=0)
    assert kv.num_free_blocks == kv.num_blocks


def test_points_that_do_not_fit_are_skipped(profiled):
    engine = profiled[0]
    kv = engine.kv_manager
    data = profile_engine(engine, [[(0, 8, True)], [(kv.num_blocks * kv.block_size, 1, True)]], repeats=1,
                          warmup=0, overhead=False, live_runs=None)
    assert len(data["samples"]) == 1 and len(data["skipped"]) == 1
    assert kv.num_free_blocks == kv.num_blocks


def test_cli_writes_the_profile(tmp_path, monkeypatch, capsys, smol_ckpt, smol_tokenizer):
    import argparse

    from tidal.bench import profile as profile_cmd
    from tidal.engine import llm_engine

    real = llm_engine.LLMEngine  # reuse the session's checkpoint instead of loading it again
    monkeypatch.setattr(llm_engine, "LLMEngine", lambda cfg: real(cfg, checkpoint=smol_ckpt, tokenizer=smol_tokenizer))

    tiny = [[(0, n, True)] for n in (4, 8, 16, 24)] + [[(32, 1, True)] * d for d in (1, 2, 3, 4)]
    monkeypatch.setattr(profiler, "default_grid", lambda quick=False: tiny)
    small_runs(monkeypatch, prompt=(8, 32), output=(2, 8), batch_sizes=(1, 4))
    parser = argparse.ArgumentParser()
    profile_cmd.add_parser(parser.add_subparsers())
    out = tmp_path / "sub" / "profile.json"
    args = parser.parse_args(["profile", "--quick", "--threads", "2", "--dtype", "float32", "--repeats", "1",
                              "--kv-cache-memory", "64MiB", "--output", str(out)])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    n_live = sum(1 for s in data["samples"] if s.get("source") == "live")
    assert data["format"] == FORMAT and len(data["samples"]) == len(tiny) + n_live and n_live > 0
    printed = capsys.readouterr().out
    assert "fit R2" in printed and "Eq. 1 per decoder layer (6 points" in printed
    assert data["eq1"]["num_layers"] == 30 and len(data["eq1"]["points"]) == len(profiler.eq1_grid(quick=True))
    assert load_eq1(str(out)) == (data["eq1"]["alpha"], data["eq1"]["beta"], data["eq1"]["gamma"])
    assert ProfiledCostModel.load(str(out)).fit_report()["num_samples"] == len(tiny) + n_live


# ---------------------------------------------------------------------------- KunServe Eq. 1
def test_eq1_profile_of_a_tiny_model_has_positive_coefficients(tmp_path, make_engine, smol_tokenizer):
    """A real run of :func:`profiler.profile_eq1` on a random-weight 3-layer model shaped so that
    attention over a 1.5K prefix and the MLP cost about the same per token (both stand out of the
    timing noise), and the fit explains the grid's times (r2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidal.engine.loader import load_checkpoint

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=128, intermediate_size=2048, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    before = torch.get_num_threads()
    engine = make_engine(ckpt=load_checkpoint(str(tmp_path)), tokenizer=smol_tokenizer, num_threads=1,
                         kv_cache_memory="64MiB")
    try:
        # a 1.5K prefix and five repeats: with 1K and three, a busy CI neighbour once fitted alpha 0.0
        grid = [(p, c) for p in (0, 1536) for c in (1, 64, 256)]
        fit = profiler.profile_eq1(engine, grid, repeats=5, warmup=1)
    finally:
        torch.set_num_threads(before)
    # attention and the per-token work stand out of the noise; a layer's fixed cost (gamma, a few us)
    # does not under a busy neighbour (a suite run fitted 0.0, the fit's lower bound): not asserted
    assert fit["alpha"] > 0 and fit["beta"] > 0, fit
    assert fit["num_layers"] == 3 and fit["per"] == "decoder layer" and len(fit["points"]) == len(grid)
    assert fit["r2"] > 0.8, fit
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
