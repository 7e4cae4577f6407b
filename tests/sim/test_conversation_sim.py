"""Conversations in the simulator: a closed loop (a turn arrives its think time after its
predecessor ended; a failed turn drops the rest), and prefix-cache hits named from content spans
(a turn hits its predecessor's prompt and answer blocks), in every cluster mode and on the fast path."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from tidal import metrics as M
from tidal import workload as W
from tidal.config import SchedulerConfig
from tidal.sim.build import ClusterSpec, build_simulator, handoff_config, resolve
from tidal.sim.run import simulate


def _conv(name: str, n: int, rate: float = 2.0, seed: int = 0) -> list[W.RequestSpec]:
    return W.make_requests(W.WorkloadOptions(workload=name, num_requests=n, rate=rate, seed=seed))


def _spec(**kw) -> ClusterSpec:
    return ClusterSpec(**{"model": "qwen-2.5-14b", "hardware": "a100-80g", "enable_prefix_caching": True, **kw})


def _full_blocks_before(specs, i: int, bs: int) -> int:
    """The tokens turn ``i`` can hit: its predecessor's computed blocks (prompt and answer but the
    last token, never fed back), capped one token short of its own prompt."""
    p = specs[specs[i].after]
    return min((p.prompt_len + p.output_len - 1) // bs, (specs[i].prompt_len - 1) // bs) * bs


@pytest.mark.parametrize("mode", [{}, {"instances": 3}, {"instances": 2, "mode": "disaggregate", "prefill_instances": 1},
                                  {"instances": 2, "mode": "split"}])
def test_turns_arrive_after_their_predecessor_and_hit_its_prompt_and_answer(mode):
    specs = _conv("conversation:turns=2-5,user=300,answer=200,think=1.5", 120, rate=3.0, seed=1)
    spec = _spec(**mode)
    res = build_simulator(spec, specs).run()
    recs = res.records
    assert all(r.success for r in recs)
    later = [i for i, s in enumerate(specs) if s.after is not None]
    assert len(later) > 40
    for i in later:
        p, r = recs[specs[i].after], recs[i]
        # closed loop: sent exactly its think time after its predecessor's response ended
        assert r.arrival_s == pytest.approx(p.end_s + specs[i].think_s) and r.send_s == r.arrival_s
        assert r.send_s > p.end_s
    if mode.get("mode") == "split":
        return  # the split planner places turns on pairs of its own; hits depend on the pair
    bs = spec.block_size
    roomy = [i for i in later if res.routed[i] == res.routed[specs[i].after]]  # the same instance's pool
    assert len(roomy) > 10
    if mode.get("mode") == "disaggregate":
        # the answer was decoded on a decode instance: the prefill instance, where the next turn goes,
        # holds the previous prompt's blocks only (as the engine's P/D: no KV store shared by instances)
        for i in roomy:
            p = specs[specs[i].after]
            assert recs[i].cached_tokens == min(p.prompt_len // bs, (specs[i].prompt_len - 1) // bs) * bs
    else:
        assert all(recs[i].cached_tokens == _full_blocks_before(specs, i, bs) for i in roomy)
    assert all(recs[i].cached_tokens == 0 for i, s in enumerate(specs) if s.after is None)  # nothing shared


def test_fast_path_changes_nothing_on_conversations():
    specs = _conv("conversation:system=200,turns=3-6,user=200,answer=150,think=0.4", 150, rate=6.0, seed=2)
    out = []
    for fast in (False, True):
        for blocks in (None, 400):  # roomy; tight (evictions, preemptions)
            sim = build_simulator(_spec(model="llama-3-8b", instances=2, num_blocks=blocks,
                                        scheduler=SchedulerConfig()), specs)
            sim.fast_forward = fast
            res = sim.run()
            out.append((fast, blocks, [asdict(r) for r in res.records], res.instances, res.simulated_time_s,
                        res.num_events))
    for blocks in (None, 400):
        slow, fast = (o for o in out if o[1] == blocks)
        assert fast[2] == slow[2] and fast[3] == slow[3] and fast[4] == slow[4]
    assert out[2][5] < out[0][5]  # it did run ahead
    assert any(i["num_preemptions"] for i in out[1][3]) or any(
        r["cached_tokens"] < _full_blocks_before(specs, k, 16) for k, r in enumerate(out[1][2]) if specs[k].after)


def test_a_failed_turn_drops_the_rest_of_its_conversation():
    specs = _conv("conversation:turns=4,user=400,answer=300,answer_sigma=0,user_sigma=0,think=1", 40, rate=1.0)
    res = build_simulator(_spec(max_model_len=1800), specs).run()
    recs = res.records
    # turn k's prompt is about 400 + 700 k tokens: turns 0 and 1 fit 1800 with their answers, turn 2 does not
    for i, s in enumerate(specs):
        r = recs[i]
        if s.turn < 2:
            assert r.success
        elif s.turn == 2:
            assert not r.success and r.error == "context" and r.send_s is not None
        else:
            assert not r.success and r.error == "dropped" and r.send_s is None and res.routed[i] == -1
    summary = M.summarize(recs)
    assert summary["errors"] == {"context": 10, "dropped": 10}


def test_summary_hits_equal_the_bound_when_nothing_is_evicted():
    specs = _conv("conversation:turns=2-6,user=250,answer=250,think=2", 200, rate=2.0, seed=4)
    out = simulate(_spec(instances=2, router="round-robin"), specs, M.SLO(), progress=False)
    pc = out["prefix_cache"]
    assert pc["hit_rate"] > 0.5
    # as routed, every hit the traffic allows on an instance's own requests (the routing splits turns)
    assert pc["hit_rate"] == pytest.approx(pc["unbounded_hit_rate_as_routed"])
    assert pc["unbounded_hit_rate"] > pc["unbounded_hit_rate_as_routed"]
    assert out["cached_prompt_share"] == pytest.approx(pc["hit_rate"])
    assert sum(r["cached_tokens"] for r in out["requests"]) == pc["hits"]
    off = simulate(_spec(instances=2, router="round-robin", enable_prefix_caching=False), specs, M.SLO(),
                   progress=False)
    assert "prefix_cache" not in off and off["cached_prompt_share"] == 0.0
    assert off["ttft_ms"]["p50"] > out["ttft_ms"]["p50"]


def test_sim_cli_runs_a_conversation_workload(tmp_path, capsys):
    from tidal.cli import main

    out = tmp_path / "c.json"
    code = main(["sim", "--workload", "conversation:system=500,turns=3,think=1", "--num-requests", "60", "--rate",
                 "1", "--model", "qwen-2.5-14b", "--no-plots", "--no-progress", "--output", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "prefix cache:" in text
    import json

    r = json.loads(out.read_text())
    assert r["workload"]["conversations"] == 20 and r["completed"] == 60
    pc = r["prefix_cache"]
    assert pc["hit_rate"] == pytest.approx(pc["unbounded_hit_rate"])  # one instance, a roomy pool
    code = main(["sim", "--workload", "conversation:turns=0", "--num-requests", "5", "--no-progress",
                 "--output", str(tmp_path / "bad.json")])
    err = capsys.readouterr().err
    assert code == 2 and "turns" in err and len(err.strip().splitlines()) == 1


def test_split_placement_by_cache_predicts_the_hit_the_engine_gets():
    """``--mode split --router cache-aware``: the planner sees each instance's cached prefix of a turn
    (the monitor's views); the part it places first is predicted to start where the engine's hit
    ends (within a block: the engine hits whole blocks), and a turn goes where its history is."""
    from tidal.cluster.split import SplitParams

    specs = _conv("conversation:system=400,turns=3-6,user=300,answer=200,think=1.5", 120, rate=3.0, seed=1)
    spec = _spec(instances=2, mode="split", router="cache-aware", split=SplitParams(flip_roles=True))
    sim = build_simulator(spec, specs)
    records = []
    sim.planner.recorder = records.append
    res = sim.run()
    assert all(r.success for r in res.records) and len(records) == len(specs)
    index = {rid: i for i, rid in enumerate(sim.ids)}
    seen = 0
    for rec in records:
        d = rec.decision
        first = d.alpha if d.alpha is not None else d.beta
        got = res.records[index[d.request_id]].cached_tokens
        assert 0 <= first.context - got < spec.block_size, (d, got)
        if first.context:
            seen += 1
            where = d.pair[0] if d.alpha is not None else d.pair[1]
            assert dict(rec.cached)[where] >= first.context  # the view it decided on
    assert seen > 40  # most later turns start past a cached prefix


@pytest.mark.parametrize("tokens_per_chunk", [0, 256])
def test_a_decode_instance_holding_the_history_takes_in_only_the_new_turn(tokens_per_chunk):
    """P/D: the decode instance decoded turn N, so its pool holds turn N's prompt and answer; turn N + 1's
    hand-off shares those blocks (as the engine's import does) and reads only the chunks reaching past
    them (all of them when a chunk spans every token)."""
    specs = _conv("conversation:turns=3-5,user=300,answer=200,think=1.5", 80, rate=2.0, seed=3)
    spec = _spec(instances=2, mode="disaggregate", prefill_instances=1, tokens_per_chunk=tokens_per_chunk)
    res = build_simulator(spec, specs).run()
    assert all(r.success for r in res.records)
    hs = {h.index: h for h in res.handoffs}
    bs = spec.block_size
    later = [i for i, s in enumerate(specs) if s.after is not None]
    assert len(later) > 30
    for i in later:
        h = hs[i]
        assert h.landed and 0 <= h.reused_tokens < h.num_tokens and h.reused_tokens % bs == 0
        assert h.reused_tokens <= _full_blocks_before(specs, i, bs)
    reused = [i for i in later if hs[i].reused_tokens == _full_blocks_before(specs, i, bs)]
    assert len(reused) > len(later) // 2  # most find all of their history (the pool evicts little here)
    arch, hw, _, _ = resolve(spec)
    cfg = handoff_config(spec, arch, hw)
    for i in reused:
        h = hs[i]
        assert (h.num_chunks, h.nbytes) == cfg.cost(h.num_tokens, cached=h.reused_tokens)[:2]
        full = cfg.cost(h.num_tokens)[1]
        # fewer bytes exactly when a whole token range of chunks lies inside the shared prefix
        assert (h.nbytes < full) == bool(tokens_per_chunk and h.reused_tokens >= tokens_per_chunk)
    assert not tokens_per_chunk or sum(hs[i].reused_tokens >= tokens_per_chunk for i in reused) > 10
    assert all(hs[i].reused_tokens == 0 for i, s in enumerate(specs) if s.after is None)
