"""engine.transfer, the KV-transfer interface workers call: a request's KV out (pause, export,
free) and in (import whole, or reserved and landed chunk by chunk), and what a mover reads."""

from __future__ import annotations

import pytest

from tests.engine.test_parity import mixed_prompts
from tidal import LLM, SamplingParams
from tidal.core.scheduler import RequestRejected

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(smol_tokenizer):
    return mixed_prompts(smol_tokenizer)[5]


@pytest.fixture(scope="module")
def reference(make_tiny_engine, prompt):
    out = LLM.from_engine(make_tiny_engine(max_num_batched_tokens=64)).generate([{"prompt_token_ids": prompt}],
                                                                                 GREEDY)
    return out[0].outputs[0].token_ids


def _run(engine, rid: str, until_tokens: int | None = None):
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if until_tokens is not None and len(engine.transfer.sampled(rid)[0]) >= until_tokens:
            return out
    return out


def _no_leak(engine):
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_what_a_mover_reads_follows_the_request(make_tiny_engine, prompt):
    e = make_tiny_engine(max_num_batched_tokens=64, block_size=8)
    t = e.transfer
    assert t.layer_ids == e.model.layer_ids and t.block_size == 8 and t.num_blocks == e.kv_manager.num_blocks
    e.add_request("r", None, GREEDY, prompt_token_ids=prompt)
    assert t.request_ids() == ["r"] and t.num_sequences("r") == 1 and t.num_sequences("nope") == 0
    assert t.running_with_kv() == {} and t.computed_tokens("r") == 0 and not t.is_movable("r")
    _run(e, "r", until_tokens=4)
    n = len(prompt) + 3
    assert t.computed_tokens("r") == n and t.running_with_kv() == {"r": n}
    assert len(t.block_table("r")) == -(-n // 8) and t.is_movable("r")
    tokens, last = t.sampled("r")
    assert len(tokens) == 4 and last is not None
    t.pause("r")
    assert t.is_paused("r") and t.running_with_kv() == {} and not t.is_movable("r")
    assert not e.has_runnable_requests()
    t.resume("r")
    assert not t.is_paused("r") and t.running_with_kv() == {"r": n}
    t.free("r")
    assert t.computed_tokens("r") is None and t.sampled("r") is None and t.request_ids() == []
    _no_leak(e)


def test_export_free_import_continues_the_same_tokens(make_tiny_engine, prompt, reference):
    a, b = make_tiny_engine(max_num_batched_tokens=64), make_tiny_engine(max_num_batched_tokens=64, block_size=8)
    a.add_request("m", None, GREEDY, prompt_token_ids=prompt)
    _run(a, "m", until_tokens=7)
    a.transfer.pause("m")
    snap = a.transfer.export_request("m")
    assert snap.num_computed_tokens == len(prompt) + 6 and snap.output_token_ids == reference[:7]
    a.transfer.free("m")
    _no_leak(a)
    b.transfer.import_request(snap)
    with pytest.raises(RequestRejected, match="already in use"):
        b.transfer.import_request(snap)
    assert _run(b, "m").outputs[0].token_ids == reference
    _no_leak(b)


def test_a_reserved_import_lands_chunk_by_chunk(make_tiny_engine, prompt, reference):
    """DynaServe's beta part: blocks grow as KV chunks land; the sampled tokens come last."""
    a, b = make_tiny_engine(max_num_batched_tokens=64), make_tiny_engine(max_num_batched_tokens=64)
    a.add_request("s", None, GREEDY, prompt_token_ids=prompt)
    _run(a, "s", until_tokens=5)
    a.transfer.pause("s")
    n = a.transfer.computed_tokens("s")
    b.transfer.reserve_import("s", prompt, GREEDY, n, hold_tokens=0)
    assert b.transfer.is_paused("s") and b.kv_manager.num_blocks_of("s") == 0
    half = n // 2
    for start, end in ((0, half), (half, n)):
        assert b.transfer.grow_import("s", end)
        b.transfer.import_kv("s", a.transfer.export_kv("s", a.transfer.layer_ids, start, end), start)
    with pytest.raises(ValueError, match="past its"):
        b.transfer.grow_import("s", n + 1)
    tokens, last = a.transfer.sampled("s")
    a.transfer.free("s")
    _no_leak(a)
    b.transfer.finish_import("s", tokens, text_sent=None, last_token_time=last)
    assert not b.transfer.is_paused("s")
    out = _run(b, "s")
    assert out.outputs[0].token_ids == reference
    assert out.outputs[0].delta_token_ids == reference[len(reference) - len(out.outputs[0].delta_token_ids):]
    _no_leak(b)


def test_finish_import_refuses_kv_that_has_not_all_arrived(make_tiny_engine, prompt):
    b = make_tiny_engine(max_num_batched_tokens=64)
    b.transfer.reserve_import("s", prompt, GREEDY, len(prompt), hold_tokens=0)
    with pytest.raises(ValueError, match="has not all arrived"):
        b.transfer.finish_import("s", [1], text_sent=0)
    b.transfer.free("s")
    _no_leak(b)


def test_the_pool_resizer_drops_and_restores_layers(make_tiny_engine):
    e = make_tiny_engine(max_num_batched_tokens=64)
    blocks, layers = e.transfer.num_blocks, e.transfer.layer_ids
    grown = e.pool.drop_layers(layers[len(layers) // 2:])
    assert grown > blocks and e.transfer.num_blocks == grown and e.transfer.layer_ids == layers[:len(layers) // 2]
    assert e.pool.restore_layers(layers[len(layers) // 2:]) == blocks
    assert e.transfer.layer_ids == layers and e.pool.pool_spare_bytes == 0 and not e.pool.dropped_weight_bytes


def test_a_handed_off_request_shares_the_prefix_its_destination_holds(make_tiny_engine, prompt, reference):
    """A P/D hand-off into an engine whose prefix cache holds the prompt's first blocks: they are shared,
    a chunk reaching into them is written only past them (one chunk from token 0 here), and the tokens
    are the reference's (issue 52)."""
    a, b = make_tiny_engine(max_num_batched_tokens=64), make_tiny_engine(max_num_batched_tokens=64, block_size=8)
    b.add_request("warm", None, SamplingParams(temperature=0, max_tokens=1), prompt_token_ids=prompt[:21])
    _run(b, "warm")  # b now caches prompt[:16] (two full blocks of 8)
    a.add_request("h", None, GREEDY, prompt_token_ids=prompt)
    _run(a, "h", until_tokens=1)
    a.transfer.pause("h")
    snap = a.transfer.export_request("h", layers=[])  # as a prefill worker sends it: the KV follows in chunks
    n = snap.num_computed_tokens
    b.transfer.import_request(snap, paused=True, hold_tokens=0)
    assert b.transfer.import_reused("h") == 16 and b.kv_manager.num_blocks_of("h") == 2
    shared = b.kv_manager.block_table("h")[:2]
    before = [b.kv_cache.export(shared, None, 0, 16)[layer][0].clone() for layer in a.transfer.layer_ids[:1]]
    assert b.transfer.grow_import("h", n)
    b.transfer.import_kv("h", a.transfer.export_kv("h", a.transfer.layer_ids, 0, n), 0)
    after = b.kv_cache.export(shared, None, 0, 16)[a.transfer.layer_ids[0]][0]
    assert after.data_ptr() != before[0].data_ptr() and bool((after == before[0]).all())
    a.transfer.free("h")
    b.transfer.resume("h")
    assert b.transfer.import_reused("h") == 0
    assert _run(b, "h").outputs[0].token_ids == reference
    assert b.scheduler.kv_reused_tokens == 16
    _no_leak(b)
