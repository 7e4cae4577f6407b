"""The output side returns what ends, it never finishes a request itself: a stop string found in
a step's text comes back as a ``StopFinish`` that the engine applies after the loop, and the
scheduler then frees the sequence's blocks (no KV leak)."""

from __future__ import annotations

from tidal import LLM, SamplingParams
from tidal.core.plan import RequestUpdate
from tidal.core.request import FinishReason, Request, RequestStatus
from tidal.engine.output_processor import OutputProcessor, StopFinish


def _tokens(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _feed(proc, rid, ids, now, finished_at=None):
    """One update per token; the last results."""
    res = None
    for k, t in enumerate(ids):
        fin = finished_at is not None and k == finished_at
        res = proc.process([RequestUpdate(rid, [t], finished=fin, finish_reason="length" if fin else None)], now + k)
        if res.outputs and res.outputs[0].finished:
            return res, k
    return res, len(ids) - 1


def test_a_stop_string_is_returned_not_applied(smol_tokenizer):
    proc = OutputProcessor(smol_tokenizer)
    req = Request("r", _tokens(smol_tokenizer, "Count:"), SamplingParams(stop=[" 7"], max_tokens=50))
    proc.add_request("r", "Count:", req.sampling_params, [req], arrival_time=1.0)
    ids = _tokens(smol_tokenizer, " 5, 6, 7, 8, 9")
    res, k = _feed(proc, "r", ids, now=10.0)
    assert k < len(ids) - 1, "the stop string never ended the sequence"
    out = res.outputs[0]
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 7"
    assert out.outputs[0].text == " 5, 6,"
    # returned to the engine, with the time it ended: the request itself is untouched
    assert res.to_finish == [StopFinish("r", " 7", 10.0 + k)]
    assert req.status is RequestStatus.WAITING and req.finish_time is None
    assert out.metrics.finished_time == 10.0 + k and out.metrics.arrival_time == 1.0
    assert "r" not in proc  # a finished request is no longer tracked


def test_a_length_finish_is_not_returned(smol_tokenizer):
    """The scheduler ended it (max_tokens): nothing for the engine to finish."""
    proc = OutputProcessor(smol_tokenizer)
    req = Request("r", _tokens(smol_tokenizer, "Count:"), SamplingParams(stop=[" 7"], max_tokens=3))
    proc.add_request("r", None, req.sampling_params, [req], arrival_time=0.0)
    res, _ = _feed(proc, "r", _tokens(smol_tokenizer, " 1, 2")[:3], now=0.0, finished_at=2)
    assert res.outputs[0].finished and res.outputs[0].outputs[0].finish_reason == "length"
    assert res.to_finish == []


def test_every_sequence_a_stop_string_ends_comes_back(smol_tokenizer):
    proc = OutputProcessor(smol_tokenizer)
    params = SamplingParams(n=2, stop=["b"])
    prompt = _tokens(smol_tokenizer, "x")
    seqs = [Request(f"g#{i}", prompt, params.clone(n=1)) for i in range(2)]
    proc.add_request("g", None, params, seqs, arrival_time=0.0)
    a, b = _tokens(smol_tokenizer, " a"), _tokens(smol_tokenizer, "b")
    first = proc.process([RequestUpdate("g#0", a), RequestUpdate("g#1", b)], 5.0)
    assert first.to_finish == [StopFinish("g#1", "b", 5.0)]
    assert not first.outputs[0].finished  # g#0 still runs
    second = proc.process([RequestUpdate("g#0", b)], 6.0)
    assert second.to_finish == [StopFinish("g#0", "b", 6.0)]
    assert second.outputs[0].finished and [o.finish_reason for o in second.outputs[0].outputs] == ["stop"] * 2


def test_the_engine_finishes_a_stopped_sequence_after_its_step(make_engine):
    """Step by step: in the step whose text holds the stop string the request leaves the
    scheduler and its blocks are free at once; its output's finish time is the scheduler's."""
    engine = make_engine()
    base = LLM.from_engine(engine).generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0]
    assert "7" in base.outputs[0].text
    engine.add_request("s", "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=["7"]))
    calls = []
    real = engine.scheduler.finish_request
    engine.scheduler.finish_request = lambda *a, **k: (calls.append((a, k)), real(*a, **k))[1]
    try:
        while True:
            outs = engine.step()
            if outs and outs[0].finished:
                break
            assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    finally:
        del engine.scheduler.finish_request
    out = outs[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "7"
    assert len(out.outputs[0].token_ids) < 20
    assert [(a, set(k)) for a, k in calls] == [(("s", FinishReason.STOP, "7"), {"now"})]  # once, after the loop
    assert "s" not in engine.scheduler.requests and not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks  # no KV leak
    assert out.metrics.finished_time == calls[0][1]["now"]


def _final_outputs(engine, requests, final_only):
    for rid, prompt, sp in requests:
        engine.add_request(rid, None, sp, prompt_token_ids=prompt, final_only=final_only)
    got, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.finished)
            if out.finished:
                got[out.request_id] = out
    return got, seen


def test_final_only_gives_the_streamed_outputs_once(make_tiny_engine):
    """LLM.generate's final-only outputs (text decoded once at the end where no stop string needs it as it
    grows) against the same requests streamed step by step: every field of every finished output is equal,
    and nothing unfinished comes back. Random weights sample odd bytes: partial UTF-8 characters included."""
    prompts = [[(41 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((7, 30, 12, 21))]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, n=2, logprobs=2),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, stop=["e", " a"]),
              SamplingParams(temperature=0.8, seed=7, max_tokens=25, skip_special_tokens=False)]
    reqs = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    streamed, seen_streamed = _final_outputs(make_tiny_engine(max_num_seqs=8), reqs, final_only=False)
    final, seen_final = _final_outputs(make_tiny_engine(max_num_seqs=8), reqs, final_only=True)
    assert all(seen_final) and len(seen_final) == len(reqs) and not all(seen_streamed)
    assert set(final) == set(streamed) == {r for r, _, _ in reqs}
    for rid in final:
        a, b = final[rid], streamed[rid]
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.text, x.token_ids, x.finish_reason, x.stop_reason, x.logprobs, x.cumulative_logprob) == \
                   (y.text, y.token_ids, y.finish_reason, y.stop_reason, y.logprobs, y.cumulative_logprob)
            assert x.text  # (some text to compare)
    assert any(o.finish_reason == "stop" for o in final["r2"].outputs)  # the stop-string request kept its path
