"""DynaServe micro-requests between two engines (Sec. 3, Sec. 4.3): the alpha engine computes a
request's first ``s`` tokens of KV and pauses; the beta engine holds a reservation, receives the KV
chunk by chunk *while alpha still computes* (each step's new tokens), then alpha's sampled tokens,
and continues. Greedy tokens and the streamed text must equal one engine's run of the request,
for splits inside the prompt, at its end, and inside the output."""

from __future__ import annotations

import pytest

from tidal.core.sampling import SamplingParams
from tidal.runtime.kv_transfer import SharedMemoryTransport, plan_chunks

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(smol_tokenizer):
    return smol_tokenizer.encode("Tell me about the ocean tides, the moon, and why there are two high tides a day.")


@pytest.fixture(scope="module")
def alone(make_engine, prompt):
    e = make_engine(max_num_batched_tokens=8)
    e.add_request("r", None, PARAMS, prompt_token_ids=prompt)
    out, text = None, ""
    while e.has_unfinished_requests():
        for o in e.step():
            out, text = o, text + o.outputs[0].delta_text
    return out.outputs[0].token_ids, text


def _split_run(make_engine, prompt, s: int, layers_per_chunk: int):
    """alpha prefills in 8-token chunks (so the KV streams in several pieces); beta has another
    block size. Returns (tokens, streamed text, chunks moved before alpha paused, chunk specs)."""
    alpha = make_engine(max_num_batched_tokens=8)
    beta = make_engine(max_num_batched_tokens=8, block_size=8)
    shm = SharedMemoryTransport()
    alpha.add_request("r", None, PARAMS, prompt_token_ids=prompt, pause_at=s)
    beta.reserve_import("r", prompt, PARAMS, s, hold_tokens=0)  # as the runtime does: blocks as KV lands
    assert not beta.has_runnable_requests()  # paused: waits for its KV
    assert beta.kv_manager.num_blocks_of("r") == 0
    text, sent, specs, early = "", 0, [], 0
    reached = []
    while not reached:
        for o in alpha.step():
            text += o.outputs[0].delta_text
        reached = alpha.scheduler.drain_reached_pause()
        done = alpha.scheduler.requests["r"].num_computed_tokens
        for spec in plan_chunks(alpha.model.layer_ids, sent, done, layers_per_chunk):
            h = shm.put(alpha.export_kv("r", list(spec.layers), spec.start, spec.end), spec)
            assert beta.grow_import("r", spec.end)
            assert beta.kv_manager.num_blocks_of("r") == -(-spec.end // 8)  # only what has landed
            beta.import_kv("r", shm.get(h), spec.start)
            shm.release(h)
            specs.append(spec)
            early += not reached
        sent = done
    assert reached == ["r"] and sent == s
    req = alpha.scheduler.requests["r"]
    outs = list(req.output_token_ids)
    assert len(outs) == max(0, s - len(prompt) + 1)
    alpha.abort_request("r")  # its KV now lives on beta
    assert alpha.kv_manager.num_free_blocks == alpha.kv_manager.num_blocks
    beta.finish_import("r", outs, len(text), req.last_token_time)
    assert beta.scheduler.requests["r"].last_token_time == req.last_token_time  # the TBT clock goes on
    out = None
    while beta.has_unfinished_requests():
        for o in beta.step():
            out, text = o, text + o.outputs[0].delta_text
    assert beta.kv_manager.num_free_blocks == beta.kv_manager.num_blocks
    return out.outputs[0].token_ids, text, early, specs


@pytest.mark.parametrize("where", ["inside-prompt", "prompt-end", "inside-output"])
def test_split_anywhere_continues_identically(make_engine, prompt, alone, where):
    p = len(prompt)
    s = {"inside-prompt": p // 2 + 3, "prompt-end": p, "inside-output": p + 6}[where]
    tokens, text, early, specs = _split_run(make_engine, prompt, s, layers_per_chunk=16)
    assert (tokens, text) == alone
    # the KV moved in pieces while alpha still computed, and covered [0, s) for every layer, once
    assert early > 0
    covered = {}
    for spec in specs:
        for layer in spec.layers:
            covered.setdefault(layer, []).append((spec.start, spec.end))
    for ranges in covered.values():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == s
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_finish_import_refuses_outputs_that_do_not_cover_the_kv(make_engine, prompt):
    beta = make_engine()
    beta.reserve_import("r", prompt, PARAMS, len(prompt) + 3)
    with pytest.raises(ValueError, match="cannot cover"):
        beta.finish_import("r", [5], 0)
    beta.abort_request("r")
    assert beta.kv_manager.num_free_blocks == beta.kv_manager.num_blocks


def test_an_import_grows_only_into_free_blocks_and_resumes_only_with_all_its_kv(make_engine, prompt):
    beta = make_engine(block_size=8)
    s = len(prompt) + 3
    beta.reserve_import("r", prompt, PARAMS, s, hold_tokens=8)
    assert beta.kv_manager.num_blocks_of("r") == 1
    with pytest.raises(ValueError, match="not all arrived"):  # the KV of [8, s) never came
        beta.finish_import("r", [5, 6, 7, 8], 0)
    with pytest.raises(ValueError, match="past its"):
        beta.grow_import("r", s + 1)
    # another request takes every free block: the import cannot grow until it lets go
    hog = beta.kv_manager.num_free_blocks
    assert beta.kv_manager.allocate("hog", hog * 8) is not None
    assert not beta.grow_import("r", s)
    assert beta.kv_manager.num_blocks_of("r") == 1  # a failed grow takes nothing
    beta.kv_manager.free("hog")
    assert beta.grow_import("r", s)
    beta.finish_import("r", [5, 6, 7, 8], 0)
    assert "r" not in beta.scheduler.paused
    beta.abort_request("r")
    assert beta.kv_manager.num_free_blocks == beta.kv_manager.num_blocks


def test_pause_at_needs_a_single_sequence(make_engine, prompt):
    e = make_engine()
    with pytest.raises(ValueError, match="pause_at"):
        e.add_request("r", None, SamplingParams(n=2, max_tokens=4), prompt_token_ids=prompt, pause_at=3)


def test_split_under_the_graphs_static_step_continues_identically(make_engine, prompt, alone, monkeypatch):
    """The CUDA graphs' branch (on CPU its padded static step, run eagerly): beta, after importing alpha's KV,
    decodes through it and gives one engine's tokens and text."""
    from tidal.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "static_decode_on_cpu", True)
    built = []

    def make(**kw):
        built.append(make_engine(max_model_len=256, **kw))
        return built[-1]

    tokens, text, _, _ = _split_run(make, prompt, len(prompt) + 4, layers_per_chunk=16)
    assert (tokens, text) == alone
    beta = built[1]
    assert beta.runner.graphs is not None and beta.runner.graphs.replays > 0
