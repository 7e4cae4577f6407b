"""--async-scheduling: a decode step runs ahead of the host, the next one planned and launched
behind it with its tokens fed from the first one's samples on the device (EngineCore.step,
Scheduler.plan_overlapped, ModelRunner.launch / collect). On the CPU the graphs' static step runs eagerly
(no graphs), which runs every part of it but the CUDA events; the outputs must be the synchronous
engine's, request for request, whatever stops a request (length, a stop token, a stop string, an abort)."""

from __future__ import annotations

import pytest

from tidal import SamplingParams
from tidal.core.plan import PENDING_TOKEN
from tidal.engine.llm_engine import LLMEngine

PROMPTS = [[(37 * i + 11 * j) % 4000 + 60 for j in range(n)] for i, n in enumerate((7, 30, 12, 45, 3, 21))]


def _engine(make_tiny_engine, monkeypatch, async_scheduling: bool, **kw):
    monkeypatch.setattr(LLMEngine, "static_decode_on_cpu", True)
    return make_tiny_engine(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                            async_scheduling=async_scheduling, **kw)


def _drive(engine, requests, abort_at=None, late=None):
    """Run to the end; ``late``: (step, id, prompt, params) added once that many steps ran; ``abort_at``:
    (step, id). Returns each request's (token ids, text, finish reason) and the steps taken."""
    for rid, prompt, params in requests:
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    out, steps = {}, 0
    while engine.has_unfinished_requests():
        if late and steps == late[0]:
            engine.add_request(late[1], None, late[3], prompt_token_ids=late[2])
        if abort_at and steps == abort_at[0]:
            engine.abort_request(abort_at[1])
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (list(c.token_ids), c.text, c.finish_reason)
        steps += 1
    return out, steps


def _free_at_the_end(engine):
    """Every block back; a step still in flight after the last output holds only finished requests' rows,
    and the next step drops it."""
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and not engine.scheduler.running
    left = engine.core.inflight
    if left is not None:
        assert engine.has_runnable_requests()
        assert not any(c.request_id in engine.scheduler.requests for c in left.plan.chunks)
        assert engine.step() == [] and engine.core.inflight is None
    assert not engine.has_runnable_requests() and kv.num_free_blocks == kv.num_blocks


def test_the_outputs_are_the_synchronous_engines_whatever_stops_a_request(make_tiny_engine, monkeypatch):
    sync = _engine(make_tiny_engine, monkeypatch, False)
    plain = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    first, _ = _drive(sync, [(f"p{i}", p, plain) for i, p in enumerate(PROMPTS)])
    # stops each request can meet: a token it samples at its 3rd-6th output, a string in its text
    reqs = []
    for i, p in enumerate(PROMPTS):
        toks, text, _ = first[f"p{i}"]
        if i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True)  # length, at its own step
        elif i % 3 == 1:
            params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop_token_ids=[toks[2 + i % 4]])
        else:
            params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=[text[len(text) // 2:][:3]])
        reqs.append((f"r{i}", p, params))
    want, _ = _drive(_engine(make_tiny_engine, monkeypatch, False), reqs)
    e = _engine(make_tiny_engine, monkeypatch, True)
    got, steps = _drive(e, reqs)
    assert got == want
    assert {w[2] for w in want.values()} == {"length", "stop"}
    assert any(len(w[0]) < 14 and w[2] == "stop" for w in want.values())
    # every step but the prefill, the first decode's launch and the last was planned while one ran
    assert e.core.overlapped_steps >= steps - 3
    _free_at_the_end(e)


def test_a_late_arrival_and_an_abort_while_a_step_is_in_flight(make_tiny_engine, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    late = (6, "late", PROMPTS[4], params)
    want, _ = _drive(_engine(make_tiny_engine, monkeypatch, False), reqs, late=late)
    e = _engine(make_tiny_engine, monkeypatch, True)
    got, _ = _drive(e, reqs, late=late, abort_at=(8, "r1"))
    assert "r1" not in got  # aborted: no output after it
    assert got == {k: v for k, v in want.items() if k != "r1"}
    assert e.core.overlapped_steps > 0
    _free_at_the_end(e)


def test_sampled_rows_run_ahead_too(make_tiny_engine, monkeypatch):
    """The sampler draws on the device without waiting for it, in step order as the synchronous engine does:
    seeded rows (each its own generator) give its tokens whatever stops them; unseeded rows share the
    engine's generator, so they give its tokens while no request stops on a token (a stopped request's
    extra row would take draws)."""
    def seeded(i, **kw):
        return SamplingParams(temperature=0.8, top_p=0.9, seed=3 + i, max_tokens=12, ignore_eos=True, **kw)

    first, _ = _drive(_engine(make_tiny_engine, monkeypatch, False),
                      [(f"s{i}", p, seeded(i)) for i, p in enumerate(PROMPTS[:4])])
    cases = [  # seeded, each but the first stopping on the token it samples 3rd-5th
        [(f"s{i}", p, seeded(i, **({"stop_token_ids": [first[f"s{i}"][0][2 + i]]} if i else {})))
         for i, p in enumerate(PROMPTS[:4])],
        [(f"u{i}", p, SamplingParams(temperature=1.0, top_k=40, max_tokens=6 + i, ignore_eos=True))
         for i, p in enumerate(PROMPTS[:4])],
    ]
    stops = []
    for reqs in cases:
        want, _ = _drive(_engine(make_tiny_engine, monkeypatch, False), reqs)
        e = _engine(make_tiny_engine, monkeypatch, True)
        got, _ = _drive(e, reqs)
        assert got == want and e.core.overlapped_steps > 0
        stops.append(sum(w[2] == "stop" for w in want.values()))
    assert stops == [3, 0]


def _logprobs_of(engine, reqs):
    for rid, prompt, params in reqs:
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
    return out


def test_logprobs_rows_are_taken_on_the_device_and_equal_the_samplers(make_tiny_engine, monkeypatch):
    """Greedy rows asking for logprobs run ahead too: the chosen token's log-probability and the top k are
    computed on the device for every row of the step and copied behind its samples."""
    reqs = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=lp))
            for i, (p, lp) in enumerate(zip(PROMPTS[:4], (2, None, 0, 5), strict=True))]
    want = _logprobs_of(_engine(make_tiny_engine, monkeypatch, False), reqs)
    e = _engine(make_tiny_engine, monkeypatch, True)
    got = _logprobs_of(e, reqs)
    assert got == want and e.core.overlapped_steps > 0
    assert want["r1"][1] is None and len(want["r3"][1][-1].top) == 5 and want["r2"][1][-1].top == ()


def test_the_step_after_is_fed_on_the_device(make_tiny_engine, monkeypatch):
    """A step planned ahead carries no token ids of its own: the graphs' input rows are the samples of
    the step before, gathered by request (its rows are ordered by context, not by request)."""
    e = _engine(make_tiny_engine, monkeypatch, True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:5]):
        e.add_request(f"r{i}", None, params, prompt_token_ids=p)
    while e.core.inflight is None or e.core.inflight.plan.chunks[0].token_ids[0] != PENDING_TOKEN:
        e.step()
    ahead = e.core.inflight  # launched by the last call, which then applied the step before it
    assert all(c.token_ids == (PENDING_TOKEN,) for c in ahead.plan.chunks)
    fed = e.runner.graphs.ids[:len(ahead.rows)].tolist()
    last = {r.request_id: r.output_token_ids[-1] for r in e.scheduler.running}
    assert fed == [last[c.request_id] for c in ahead.rows]
    assert [c.request_id for c in ahead.rows] != sorted(last)  # (the gather does reorder)
    e.step()
    assert e.last_plan is ahead.plan and e.core.inflight.plan.step_id == ahead.plan.step_id + 1


@pytest.mark.parametrize("bad", ["yes", 1])
def test_the_flag_is_a_bool(bad):
    from tidal.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="async_scheduling must be true or false"):
        ModelConfig(async_scheduling=bad)


def test_the_next_step_fills_the_other_host_buffers(make_tiny_engine, monkeypatch):
    """On CUDA a step's input copies may still be queued when the host fills the next step's: each step
    writes the set of host buffers the step before did not, so both steps' positions stay there."""
    e = _engine(make_tiny_engine, monkeypatch, True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:4]):
        e.add_request(f"r{i}", None, params, prompt_token_ids=p)
    for _ in range(6):
        e.step()
    g = e.runner.graphs
    before, ahead = e.last_plan, e.core.inflight.plan  # the last one applied, the one launched after it
    newest = g.staging[g._turn ^ 1].arrays[1]  # positions, in row order (longest context first)
    older = g.staging[g._turn].arrays[1]
    assert sorted(newest[:4].tolist()) == sorted(c.start for c in ahead.chunks)
    assert sorted(older[:4].tolist()) == sorted(c.start for c in before.chunks)
    assert sorted(c.start for c in ahead.chunks) == [c.start + 1 for c in sorted(before.chunks, key=lambda c: c.start)]


def test_an_engine_without_graphs_says_so_and_runs_as_without_it(make_tiny_engine, capsys):
    e = make_tiny_engine(max_model_len=256, async_scheduling=True)  # CPU: no graphs, no static step
    assert "--async-scheduling overlaps the decode steps of CUDA graphs" in capsys.readouterr().err
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got, _ = _drive(e, [(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:2])])
    assert all(len(v[0]) == 6 for v in got.values()) and e.core.overlapped_steps == 0
    assert "async-scheduling" not in e.describe_weights()


def test_a_step_left_in_flight_by_the_last_stop_is_dropped_by_the_next(make_tiny_engine, monkeypatch):
    """The last request stops on a token it samples: the step planned after it is still in flight when the
    engine has no more requests (its row is the stopped request's); the next step drops it."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first, _ = _drive(_engine(make_tiny_engine, monkeypatch, False), [("a", PROMPTS[1], plain)])
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[first["a"][0][4]])
    e = _engine(make_tiny_engine, monkeypatch, True)
    got, _ = _drive(e, [("a", PROMPTS[1], stop)])
    assert got["a"][0] == first["a"][0][:5] and got["a"][2] == "stop"
    assert e.core.inflight is not None and e.has_runnable_requests()
    _free_at_the_end(e)
