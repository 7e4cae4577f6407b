"""Hand-offs between engines: a request paused on one engine, its KV sent in chunks, continued on
another; and fail-over by recompute from the prompt plus the tokens already streamed. Greedy
outputs and the streamed text must equal one engine's run of the same request."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.core.sampling import SamplingParams
from tidal.runtime.kv_transfer import SharedMemoryTransport, plan_chunks

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(smol_tokenizer):
    return smol_tokenizer.encode("The three primary colours of light are red, green and")


@pytest.fixture(scope="module")
def alone(make_engine, prompt):
    """(token ids, text) of the request run on one engine."""
    e = make_engine(max_num_batched_tokens=64)
    e.add_request("r", None, PARAMS, prompt_token_ids=prompt)
    out = None
    while e.has_unfinished_requests():
        for o in e.step():
            out = o
    return out.outputs[0].token_ids, out.outputs[0].text


def run_until(engine, rid: str, n_tokens: int) -> str:
    """Step until ``rid`` has ``n_tokens`` outputs; returns the text streamed meanwhile."""
    text = ""
    while len(engine.scheduler.requests[rid].output_token_ids) < n_tokens:
        for o in engine.step():
            text += o.outputs[0].delta_text
    return text


def finish(engine) -> tuple[list[int], str]:
    out, text = None, ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
            text += o.outputs[0].delta_text
    return out.outputs[0].token_ids, text


def test_paused_handoff_in_chunks_continues_identically(make_engine, prompt, alone):
    a = make_engine(max_num_batched_tokens=64)
    b = make_engine(max_num_batched_tokens=64, block_size=8)
    a.add_request("r", None, PARAMS, prompt_token_ids=prompt)
    streamed = run_until(a, "r", 1)  # a prefill instance stops after the first token
    a.pause_request("r")
    assert a.step() == [] and not a.has_runnable_requests() and a.has_unfinished_requests()
    meta = a.export_request("r", layers=[])  # tokens and state; the KV follows in chunks
    assert meta.kv == {}
    b.import_request(meta, paused=True)
    assert not b.has_runnable_requests()
    shm = SharedMemoryTransport()
    chunks = plan_chunks(a.model.layer_ids, 0, meta.num_computed_tokens, layers_per_chunk=12, tokens_per_chunk=5)
    assert len(chunks) >= 4
    for spec in chunks:
        handle = shm.put(a.export_kv("r", list(spec.layers), spec.start, spec.end), spec)
        b.import_kv("r", shm.get(handle), spec.start)
        shm.release(handle)
    a.abort_request("r")
    b.resume_request("r")
    tokens, rest = finish(b)
    assert tokens == alone[0]
    assert streamed + rest == alone[1]
    for e in (a, b):
        assert e.kv_manager.num_free_blocks == e.kv_manager.num_blocks


def test_failover_recomputes_from_prompt_and_streamed_tokens(make_engine, prompt, alone):
    a, b = make_engine(max_num_batched_tokens=64), make_engine(max_num_batched_tokens=16)
    a.add_request("r", None, PARAMS, prompt_token_ids=prompt)
    streamed = run_until(a, "r", 9)
    snap = a.export_request("r", layers=[])
    a.abort_request("r")  # the instance is gone: only tokens and text offsets survive
    b.import_request(dataclasses.replace(snap, num_computed_tokens=0))
    assert b.scheduler.requests["r"] in b.scheduler.waiting  # queued like a new request, then recomputed
    tokens, rest = finish(b)
    assert tokens == alone[0] and streamed + rest == alone[1]
    assert b.kv_manager.num_free_blocks == b.kv_manager.num_blocks


def test_pause_needs_a_running_request(make_engine, prompt):
    e = make_engine(max_num_batched_tokens=64)
    e.add_request("r", None, PARAMS, prompt_token_ids=prompt)
    with pytest.raises(ValueError, match="only a running request"):
        e.pause_request("r")
    e.abort_request("r")


def test_what_a_worker_reads_of_a_request_to_move_it(make_engine, prompt):
    """The engine's side of a move (no private field read by the workers): which requests it
    holds, how many sequences, which can move now, and DynaServe's unsplit."""
    e = make_engine(max_num_batched_tokens=64)
    e.add_request("one", None, PARAMS, prompt_token_ids=prompt)
    e.add_request("two", None, dataclasses.replace(PARAMS, n=2), prompt_token_ids=prompt)
    e.add_request("alpha", None, PARAMS, prompt_token_ids=prompt, pause_at=len(prompt) + 2)
    assert sorted(e.request_ids()) == ["alpha", "one", "two"]
    assert (e.num_sequences("one"), e.num_sequences("two"), e.num_sequences("gone")) == (1, 2, 0)
    assert not e.is_movable("one")  # still in its prefill: nothing sampled
    while not e.scheduler.drain_reached_pause():
        e.step()
    assert e.is_movable("one") and not e.is_movable("two") and not e.is_movable("gone")
    assert "alpha" in e.scheduler.paused and not e.is_movable("alpha")  # paused at its split point
    e.cancel_pause("alpha")  # alpha keeps the whole request: it runs on, with no split point
    assert "alpha" not in e.scheduler.paused and e.scheduler.requests["alpha"].pause_at is None
    e.cancel_pause("gone")  # a request not here: nothing to do
    e.abort_request(e.request_ids())
    assert e.request_ids() == [] and e.kv_manager.num_free_blocks == e.kv_manager.num_blocks


def test_an_imported_request_keeps_its_age(make_engine, prompt):
    """The move machine's moved copy keeps the client's arrival (tidal.cluster.moves.moved_request):
    a snapshot carries how long ago the request arrived, and the importer's arrival time is its own
    clock less that, so two machines need not share a clock and the request keeps its FCFS place."""
    a, b = make_engine(max_num_batched_tokens=64), make_engine(max_num_batched_tokens=64)
    a.clock, b.clock = (lambda: 100.0), (lambda: 5000.0)
    a.add_request("r", None, PARAMS, prompt_token_ids=prompt, arrival_time=97.5)
    run_until(a, "r", 1)
    a.pause_request("r")
    snap = a.export_request("r")
    assert snap.age_s == pytest.approx(2.5)
    b.import_request(snap)
    assert b.scheduler.requests["r"].arrival_time == pytest.approx(4997.5)
    a.abort_request("r")
    b.abort_request("r")
