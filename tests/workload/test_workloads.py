"""Workloads of ``tidal.workload``: length statistics, real trace files, arrivals, exact prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tidal import workload as W

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/traces is not here")


def opts(**kw) -> W.WorkloadOptions:
    kw.setdefault("traces_dir", str(TRACES))
    return W.WorkloadOptions(**kw)


# ============================================================================ lengths
@pytest.mark.parametrize("name", list(W.SHAPES))
def test_shape_means(name: str):
    shape = W.SHAPES[name]
    specs = W.make_requests(opts(workload=name, num_requests=4000, seed=1))
    ins = np.array([s.prompt_len for s in specs])
    outs = np.array([s.output_len for s in specs])
    assert len(specs) == 4000
    assert ins.mean() == pytest.approx(shape.in_mean, rel=0.06)
    assert outs.mean() == pytest.approx(shape.out_mean, rel=0.06)
    assert ins.min() >= 1 and outs.min() >= 1
    if shape.in_sigma == 0:
        assert (ins == shape.in_mean).all() and (outs == shape.out_mean).all()
    else:
        assert ins.std() > 0


def test_design_means_of_the_named_shapes():
    assert (W.SHAPES["alpaca"].in_mean, W.SHAPES["longbench"].in_mean, W.SHAPES["longbench"].out_mean) == (83, 5900, 499)
    assert (W.SHAPES["sharegpt"].in_mean, W.SHAPES["sharegpt"].out_mean) == (1660, 373)
    assert (W.SHAPES["burstgpt"].in_mean, W.SHAPES["burstgpt"].out_mean) == (642, 262)
    assert W.SHAPES["azure-code"].in_mean > 10 * W.SHAPES["azure-code"].out_mean  # prefill heavy
    for name, (i, o) in {"dynaserve-8192-32": (8192, 32), "dynaserve-2048-512": (2048, 512),
                         "dynaserve-219-1467": (219, 1467)}.items():
        assert (W.SHAPES[name].in_mean, W.SHAPES[name].out_mean) == (i, o)


def test_fixed_and_uniform():
    specs = W.make_requests(opts(workload="fixed:100:20", num_requests=10))
    assert {(s.prompt_len, s.output_len) for s in specs} == {(100, 20)}
    specs = W.make_requests(opts(workload="uniform:10-20:1-4", num_requests=3000))
    ins = np.array([s.prompt_len for s in specs])
    outs = np.array([s.output_len for s in specs])
    assert ins.min() == 10 and ins.max() == 20 and outs.min() == 1 and outs.max() == 4
    assert ins.mean() == pytest.approx(15, abs=0.3)
    for bad in ("fixed:10", "fixed:10-20:5", "uniform:20-10:1-2", "uniform:a:b", "nope", "fixed:0:5"):
        with pytest.raises(W.WorkloadError):
            W.make_requests(opts(workload=bad, num_requests=2))


def test_mix_draws_each_request_from_one_component():
    opts = W.WorkloadOptions(workload="mix:fixed:10:2=3,fixed:1000:50=1", num_requests=4000, seed=5)
    specs = W.make_requests(opts)
    assert {(s.prompt_len, s.output_len) for s in specs} == {(10, 2), (1000, 50)}
    share = sum(s.prompt_len == 10 for s in specs) / len(specs)
    assert share == pytest.approx(0.75, abs=0.03)
    assert specs == W.make_requests(opts)  # seeded
    mixed = W.make_requests(W.WorkloadOptions(workload="mix:alpaca=0.8,longbench=0.2", num_requests=4000))
    assert np.mean([s.prompt_len for s in mixed]) == pytest.approx(0.8 * 83 + 0.2 * 5900, rel=0.1)
    for bad in ("mix:alpaca", "mix:alpaca=-1", "mix:alpaca=0", "mix:mix:alpaca=1=1", "mix:nope=1"):
        with pytest.raises(W.WorkloadError):
            W.make_requests(W.WorkloadOptions(workload=bad, num_requests=5))


def test_seed_makes_workloads_reproducible():
    a = W.make_requests(opts(workload="sharegpt", num_requests=50, rate=3.0, seed=7))
    b = W.make_requests(opts(workload="sharegpt", num_requests=50, rate=3.0, seed=7))
    c = W.make_requests(opts(workload="sharegpt", num_requests=50, rate=3.0, seed=8))
    assert a == b and a != c


@needs_traces
@pytest.mark.parametrize("name,in_mean,out_mean", [("sharegpt-lengths", 2340, 439), ("arxiv-lengths", 2588, 291)])
def test_length_sets(name: str, in_mean: float, out_mean: float):
    all_in, all_out = W.load_length_set(str(TRACES / W.TRACE_FILES[name]))
    assert len(all_in) == {"sharegpt-lengths": 30731, "arxiv-lengths": 28257}[name]
    assert all_in.mean() == pytest.approx(in_mean, rel=0.01) and all_out.mean() == pytest.approx(out_mean, rel=0.01)
    specs = W.make_requests(opts(workload=name, num_requests=3000, seed=3))
    assert np.mean([s.prompt_len for s in specs]) == pytest.approx(in_mean, rel=0.06)
    assert np.mean([s.output_len for s in specs]) == pytest.approx(out_mean, rel=0.06)
    # every sampled pair is a real row
    rows = set(zip(all_in.tolist(), all_out.tolist(), strict=True))
    assert all((s.prompt_len, s.output_len) in rows for s in specs[:200])


@needs_traces
def test_alpaca_real_uses_the_dataset_texts(smol_tokenizer):
    pairs = W.load_alpaca(str(TRACES / "alpaca_en_demo.json"))
    assert len(pairs) == 999
    by_prompt = dict(pairs)
    specs = W.make_requests(opts(workload="alpaca-real", num_requests=20, seed=2), smol_tokenizer)
    assert len({s.prompt_text for s in specs}) == 20  # sampled without replacement
    for s in specs:
        assert s.prompt_text in by_prompt
        assert s.output_len == len(smol_tokenizer.encode(by_prompt[s.prompt_text], add_special_tokens=False))
        assert s.prompt_len == len(smol_tokenizer.encode(s.prompt_text))
    approx = W.make_requests(opts(workload="alpaca-real", num_requests=20, seed=2))  # no tokenizer: word counts
    assert [s.prompt_text for s in approx] == [s.prompt_text for s in specs]


def test_clipping():
    specs = W.make_requests(opts(workload="longbench", num_requests=200, max_input_len=512, max_output_len=64))
    assert max(s.prompt_len for s in specs) == 512 and max(s.output_len for s in specs) == 64


# ============================================================================ traces
@needs_traces
def test_azure_trace_parses():
    rows = W.load_trace(str(TRACES / "azure2023_conv.csv"))
    assert len(rows) == 19366
    assert (rows[0].input_len, rows[0].output_len, rows[0].line) == (374, 44, 2)
    assert (rows[1].input_len, rows[1].output_len) == (396, 109)
    assert rows[1].time_s - rows[0].time_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    span = rows[-1].time_s - rows[0].time_s
    assert (len(rows) - 1) / span == pytest.approx(5.5, rel=0.05)  # README: 5.5 req/s over one hour
    assert np.mean([r.input_len for r in rows]) == pytest.approx(1155, rel=0.01)
    assert np.mean([r.output_len for r in rows]) == pytest.approx(211, rel=0.01)
    assert W.parse_azure_timestamp("2023-11-16 18:15:46.6805900") % 60 == pytest.approx(46.68059, abs=1e-6)


@needs_traces
def test_mooncake_trace_parses():
    path = str(TRACES / "mooncake_synthetic.jsonl")
    assert W.detect_trace_format(path) == "mooncake"
    rows = W.load_trace(path)
    assert len(rows) == 3993
    first = json.loads(Path(path).read_text().split("\n", 1)[0])
    assert (rows[0].input_len, rows[0].output_len, rows[0].hash_ids) == (40160, 6, first["hash_ids"])
    assert rows[0].time_s == 0.0
    assert np.mean([r.input_len for r in rows]) == pytest.approx(15325, rel=0.01)
    specs = W.make_requests(opts(trace=path, num_requests=10))
    assert [s.prompt_len for s in specs] == [r.input_len for r in rows[:10]]
    assert specs[0].hash_ids == first["hash_ids"]


@needs_traces
def test_trace_rate_rescaling_keeps_the_pattern():
    path = str(TRACES / "azure2023_conv.csv")
    own = W.make_requests(opts(trace=path, num_requests=300))
    t_own = np.array([s.arrival_s for s in own])
    assert t_own[0] == 0.0
    for rate in (0.5, 2.0, 40.0):
        scaled = W.make_requests(opts(trace=path, num_requests=300, rate=rate))
        t = np.array([s.arrival_s for s in scaled])
        assert W.mean_rate(t) == pytest.approx(rate)
        assert t / t[-1] == pytest.approx(t_own / t_own[-1])  # same relative pattern
        assert [s.prompt_len for s in scaled] == [s.prompt_len for s in own]
    fast = W.make_requests(opts(trace=path, num_requests=300, time_scale=2.0))  # speedup: t -> t / 2
    assert np.array([s.arrival_s for s in fast]) == pytest.approx(t_own / 2)
    within = W.make_requests(opts(trace=path, duration_s=30.0, time_scale=3.0))  # the first 90 s of the trace
    times = np.array([r.time_s for r in W.load_trace(path)])
    assert len(within) == int(np.sum(times - times[0] < 90.0))
    assert max(s.arrival_s for s in within) < 30
    with pytest.raises(W.WorkloadError, match="not both"):
        W.make_requests(opts(trace=path, num_requests=5, rate=1.0, time_scale=2.0))


def test_malformed_traces_name_the_line(tmp_path: Path):
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,1,2\n"
                   "2023-11-16 18:15:47.1,1,2\nnot a time,3,4\n")
    with pytest.raises(W.WorkloadError, match=r"t\.csv:4: bad timestamp"):
        W.load_trace(str(bad))
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,1,2\n2023-11-16 18:15:47.1,-3\n")
    with pytest.raises(W.WorkloadError, match=r":3: expected 3 columns"):
        W.load_trace(str(bad))
    js = tmp_path / "m.jsonl"
    js.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1}\n\n'
                  '{"timestamp": 5, "input_length": 1.5, "output_length": 1}\n')
    with pytest.raises(W.WorkloadError, match=r"m\.jsonl:3: bad input_length"):
        W.load_trace(str(js))
    js.write_text('{"timestamp": 0, "output_length": 1}\n')
    with pytest.raises(W.WorkloadError, match=r":1: missing field 'input_length'"):
        W.load_trace(str(js))
    other = tmp_path / "x.txt"
    other.write_text("hello\n")
    with pytest.raises(W.WorkloadError, match="unknown trace format"):
        W.load_trace(str(other))
    with pytest.raises(W.WorkloadError, match="not found"):
        W.load_trace(str(tmp_path / "missing.csv"))
    generic = tmp_path / "g.csv"
    generic.write_text("arrival_s,input_len,output_len\n0.5,10,2\n0.0,20,3\n")
    rows = W.load_trace(str(generic))
    assert [(r.time_s, r.input_len) for r in rows] == [(0.0, 20), (0.5, 10)]  # sorted by time


# ============================================================================ arrivals
def test_gamma_burstiness_changes_the_cv():
    rng = np.random.default_rng(0)
    for b, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        t = W.gamma_arrivals(rng, 20000, rate=5.0, burstiness=b)
        assert t[0] == 0.0 and (np.diff(t) >= 0).all()
        assert W.mean_rate(t) == pytest.approx(5.0, rel=0.05)
        assert W.cv_of_gaps(t) == pytest.approx(cv, rel=0.07)
    assert (W.gamma_arrivals(rng, 5, rate=float("inf")) == 0).all()
    bursty = W.make_requests(opts(workload="burstgpt", num_requests=3000, rate=2.0))
    assert W.cv_of_gaps([s.arrival_s for s in bursty]) == pytest.approx(2 ** 0.5, rel=0.1)  # its default B = 0.5
    poisson = W.make_requests(opts(workload="burstgpt", num_requests=3000, rate=2.0, burstiness=1.0))
    assert W.cv_of_gaps([s.arrival_s for s in poisson]) == pytest.approx(1.0, rel=0.1)


def test_duration_bounds_synthetic_arrivals():
    specs = W.make_requests(opts(workload="fixed:4:4", duration_s=50.0, rate=4.0))
    t = [s.arrival_s for s in specs]
    assert max(t) < 50 and len(specs) == pytest.approx(200, rel=0.2)
    capped = W.make_requests(opts(workload="fixed:4:4", duration_s=50.0, rate=4.0, num_requests=10))
    assert len(capped) == 10
    with pytest.raises(W.WorkloadError, match="finite"):
        W.make_requests(opts(workload="fixed:4:4", duration_s=5.0))


# ============================================================================ prompts
def test_exact_length_text_prompts(smol_tokenizer):
    lengths = [1, 2, 5, 37, 128, 700]
    specs = [W.RequestSpec(0.0, n, 4) for n in lengths]
    out = W.materialize(specs, smol_tokenizer, "text", seed=3, special_ids=smol_tokenizer.hf.all_special_ids)
    for n, s in zip(lengths, out, strict=True):
        assert s.prompt_token_ids is None and s.prompt_text
        assert len(smol_tokenizer.encode(s.prompt_text)) == n, (n, s.prompt_text[:80])
        assert s.prompt_len == n
    assert len({s.prompt_text for s in out}) == len(out)


def test_token_id_prompts(smol_tokenizer):
    special = set(smol_tokenizer.hf.all_special_ids)
    specs = [W.RequestSpec(0.0, n, 4) for n in (1, 50, 2000)]
    out = W.materialize(specs, smol_tokenizer, "ids", seed=0, special_ids=sorted(special))
    for n, s in zip((1, 50, 2000), out, strict=True):
        assert len(s.prompt_token_ids) == n
        assert not special & set(s.prompt_token_ids)
        assert all(0 <= t < smol_tokenizer.vocab_size for t in s.prompt_token_ids)
    # Mooncake hash blocks: equal hash ids give equal 512-token blocks
    a, b = W.materialize([W.RequestSpec(0.0, 1100, 2, hash_ids=[1, 2, 3]), W.RequestSpec(0.0, 700, 2, hash_ids=[1, 9])],
                         smol_tokenizer, "ids")
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512]
    assert a.prompt_token_ids[512:700] != b.prompt_token_ids[512:700]
    assert len(a.prompt_token_ids) == 1100 and len(b.prompt_token_ids) == 700


def test_prompts_without_a_tokenizer():
    out = W.materialize([W.RequestSpec(0.0, 30, 4)], None, "text")
    assert len(out[0].prompt_text.split()) == 30
    with pytest.raises(W.WorkloadError, match="tokenizer"):
        W.materialize([W.RequestSpec(0.0, 30, 4)], None, "ids")


def test_a_trace_window_at_a_rate_has_that_mean_rate():
    """The capacity search over a trace window: rescaling the whole trace and cutting it at the window
    gave the window the rate of whatever part landed in it (a trace that thins out: far below the
    probe's rate); ``window_at_rate`` takes the first rate x D arrivals and rescales those to the rate."""
    from tidal.workload import RequestSpec, mean_rate, specs_at_rate, window_at_rate

    times = [0.1 * i for i in range(100)] + [10 + 5.0 * i for i in range(100)]  # dense, then sparse
    base = [RequestSpec(t, 10, 5) for t in times]
    cut = specs_at_rate(base, 2.0, 60.0)  # the old way: the whole trace at 2 req/s, the first 60 s kept
    assert mean_rate([s.arrival_s for s in cut]) > 2.5  # the window holds the dense part: not 2 req/s
    win = window_at_rate(base, 2.0, 60.0)
    arr = [s.arrival_s for s in win]
    assert len(win) == 121 and arr[0] == 0.0 and max(arr) <= 60.0
    assert mean_rate(arr) == pytest.approx(2.0)
    assert [s.prompt_len for s in win] == [s.prompt_len for s in base[:121]]  # the trace's first requests, in order
    short = window_at_rate(base[:50], 2.0, 60.0)  # the trace runs out: all of it, still at the rate
    assert len(short) == 50 and mean_rate([s.arrival_s for s in short]) == pytest.approx(2.0)
    assert window_at_rate(base, 2.0, None) == specs_at_rate(base, 2.0, None)
