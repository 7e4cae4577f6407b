"""``--mode split`` in the simulator (DynaServe micro-requests) on hand-checkable cost and link
models: where alpha pauses, what beta continues, KV streamed while alpha computes (only the tail
exposed), a request that ends before its split point, the planner's profile grid, the decisions'
replay, and ``tidal sim --mode split``."""

from __future__ import annotations

import json
import random

import pytest

from tidal.cluster.split import SplitParams, SplitPlanner, replay
from tidal.cluster.split_predict import MicroRequest
from tidal.config import ConfigError, SchedulerConfig
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim import run as sim_run
from tidal.sim.build import ClusterSpec, build_simulator, make_cost_model, resolve
from tidal.sim.instance import SimInstance
from tidal.sim.links import LinkSpec
from tidal.sim.pd import HandoffConfig
from tidal.sim.split import ProfileGrid, SplitSimulator, summarize_splits
from tidal.workload import RequestSpec

DT = 0.01  # every step
LINK = LinkSpec("test", bandwidth=1e6, latency_s=1e-3)  # 1 MB/s, 1 ms per chunk
LAYERS, BYTES = 4, 100  # 4 layers in 2 groups of 2: a token costs 2 x 200 B in 2 chunks


class Constant:
    name = "constant"

    def step_time(self, plan):
        return DT


def one_per_pass(p, ctx, d, prefix=0.0):
    return 1.0


def _sim(specs, *, n=2, alpha_load=0, beta_load=0, length_mode="oracle", stream=16, recorder=None, **sched):
    config = SchedulerConfig(**{"max_num_batched_tokens": 4096, "max_num_seqs": 64, **sched})
    insts = [SimInstance(i, config, 512, 16, Constant(), 8192) for i in range(n)]
    planner = SplitPlanner(SplitParams(token_budget=4096, max_num_seqs=64, epsilon_s=0.0), one_per_pass)
    if alpha_load:
        planner.load_ledger(0, [MicroRequest("load", 0, 10, alpha_load)])
    if beta_load:
        planner.load_ledger(1, [MicroRequest("load", 0, 10, beta_load)])
    return SplitSimulator(insts, planner, specs, HandoffConfig(LINK, LAYERS, BYTES, 1, 2, 0), max_model_len=8192,
                          length_mode=length_mode, stream_tokens=stream, recorder=recorder)


def _free(sim):
    return all(i.kv.num_free_blocks == i.kv.num_blocks and not i.scheduler.requests for i in sim.instances)


def test_cold_start_is_pd_alpha_samples_the_first_token_then_beta_decodes():
    sim = _sim([RequestSpec(0.0, 100, 4)])
    res = sim.run()
    (t,) = res.splits
    assert t.cold_start and t.split == 100 and t.handoff  # phi = P/L
    # one 100-token prefill step on alpha; its KV goes in 2 chunks of 2 layers x 100 tokens x 100 B
    assert (t.sent_tokens, t.nbytes, t.num_chunks) == (100, 40_000, 2)
    assert t.paused_s == pytest.approx(DT) and t.landed_s == pytest.approx(DT + 2 * (1e-3 + 0.02))
    rec = res.records[0]
    assert rec.success and rec.output_tokens == 4 and rec.ttft_s == pytest.approx(DT)  # alpha's token
    assert rec.e2e_s == pytest.approx(t.landed_s + 3 * DT)  # beta decodes the other 3 after the landing
    assert res.instances[0]["steps"] == 1 and res.instances[1]["steps"] == 3
    assert _free(sim) and sim.planner.ledger(0) == () and sim.planner.ledger(1) == ()


def test_split_inside_the_output_streams_kv_while_alpha_decodes():
    # beta has 50 passes of work: Alg. 1 gives alpha the prompt and most of the output
    sim = _sim([RequestSpec(0.0, 32, 64)], beta_load=50)
    seen = []
    beta = sim.instances[1].scheduler
    resume = beta.resume

    def watch(rid):  # what beta's request carries when it resumes (the engine's finish_import)
        req = beta.requests[rid]
        seen.append((len(req.output_token_ids), req.num_computed_tokens, req.last_token_time))
        resume(rid)
    beta.resume = watch
    res = sim.run()
    (t,) = res.splits
    a_samples = t.split - 32 + 1
    assert 32 < t.split < 32 + 64 - 1 and 40 <= a_samples <= 60
    assert res.instances[0]["steps"] == a_samples  # 1 prefill step, then a decode step per token to s
    assert res.instances[1]["steps"] == 64 - a_samples  # beta samples the rest
    assert res.records[0].output_tokens == 64 and res.records[0].success
    assert t.sent_tokens == t.split  # all of alpha's KV, once
    # streamed in pieces as alpha computed them: only the tail (< 16 tokens) travels after the pause
    tail = t.split - 32 - 16 * ((t.split - 32) // 16) or 16
    assert t.landed_s - t.paused_s <= 2 * (1e-3 + 2 * tail * BYTES / 1e6) + 1e-12
    assert t.landed_s - t.paused_s < 0.5 * t.whole_transfer_s
    assert t.num_chunks > 2 * 2  # several pushes of 2 chunks each
    # beta resumed it with alpha's tokens, its KV of [0, s), and the time of alpha's last token
    assert seen == [(a_samples, t.split, pytest.approx(t.paused_s))]
    assert _free(sim)


def test_split_inside_the_prompt_beta_prefills_the_rest_and_samples_everything():
    sim = _sim([RequestSpec(0.0, 600, 8)], alpha_load=200, max_num_batched_tokens=256)
    res = sim.run()
    (t,) = res.splits
    assert 0 < t.split < 600 and t.handoff
    assert res.records[0].output_tokens == 8 and res.records[0].success
    alpha_chunks = -(-t.split // 256)
    assert res.instances[0]["steps"] == alpha_chunks  # alpha prefills s tokens in 256-token steps, samples nothing
    assert res.records[0].ttft_s > t.landed_s  # the first token comes from beta
    assert t.sent_tokens == t.split and _free(sim)


def test_a_request_that_ends_before_its_split_lets_beta_go():
    # the planner expects 256 + 20 tokens; the request makes 4, alpha finishes it, beta's reserved blocks free
    sim = _sim([RequestSpec(0.0, 10, 4)], beta_load=150, length_mode="predict", stream=1)
    res = sim.run()
    (t,) = res.splits
    assert t.predicted_output == 276 and t.split > 10 + 4 and t.handoff
    assert t.finished_on_alpha and t.landed_s is None and t.reserved_s is not None
    assert res.records[0].success and res.records[0].output_tokens == 4
    assert res.instances[1]["steps"] == 0 and _free(sim)
    assert summarize_splits(res.splits)["finished_on_alpha"] == 1
    assert sim.planner.lengths.count == 1 and sim.planner.lengths.estimate(10) == 4  # it learned the real length


def test_profile_grid_is_the_cost_model_on_its_points_and_close_between():
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g")
    arch, hw, _, max_len = resolve(spec)
    cm = make_cost_model(spec, arch, hw)
    grid = ProfileGrid(cm, 2048, 256, max_len)
    sp = SamplingParams(max_tokens=1)

    def exact(p, ctx, d):
        chunks = ([ScheduledChunk("p", (0,) * p, 0, (), True, sp)] if p else []) + \
                 [ScheduledChunk(f"d{i}", (0,), ctx - 1, (), True, sp) for i in range(d)]
        return cm.step_time(StepPlan(0, tuple(chunks), BatchComposition.of(chunks)))
    assert grid(512, 4096, 64) == pytest.approx(exact(512, 4096, 64), rel=1e-12)
    rng = random.Random(0)
    for _ in range(100):
        p, ctx, d = rng.choice([0, rng.randint(1, 2048)]), rng.randint(50, 30000), rng.randint(1, 256)
        assert grid(p, ctx, d) == pytest.approx(exact(p, ctx, d), rel=0.05)


def test_the_sims_decisions_replay_from_their_records_and_use_every_pair():
    records = []
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=4, mode="split",
                       scheduler=SchedulerConfig(batching="slo-compose", tbt_slo_ms=100, max_num_batched_tokens=2048,
                                                 max_num_seqs=128))
    rng = random.Random(1)
    specs = [RequestSpec(i * 0.05, rng.randint(100, 3000), rng.randint(10, 600)) for i in range(80)]
    sim = build_simulator(spec, specs)
    sim.planner.recorder = records.append
    res = sim.run()
    assert all(r.success for r in res.records) and len(records) == 80
    assert {r.decision.pair for r in records} == {(0, 1), (2, 3)}
    kinds = summarize_splits(res.splits)
    assert kinds["inside_output"] + kinds["inside_prompt"] > 0 and kinds["landed"] == kinds["handoffs"]
    step_time = sim.planner.predictor.step_time
    params = sim.planner.params
    assert params.token_budget == 2048 and params.max_num_seqs == 128  # the instances' own limits
    assert all(replay(rec, step_time, params) == rec.decision for rec in records)
    assert _free(sim)


def test_seed_profile_records_the_offline_profile_in_slo_compose_tables_only():
    sched = SchedulerConfig(batching="slo-compose", tbt_slo_ms=100, max_num_batched_tokens=2048, max_num_seqs=64)
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=2, mode="split", scheduler=sched,
                       seed_profile=True)
    sim = build_simulator(spec, [RequestSpec(0.0, 100, 4)])
    grid = sim.planner.predictor.step_time
    for inst in sim.instances:
        table = inst.policy.table
        assert table.num_samples == len(grid.records()) > 1000
        assert table.predict(512, 4096, 64) == pytest.approx(grid(512, 4096, 64), rel=0.02)  # a grid point
    plain = build_simulator(ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=2, mode="split",
                                        scheduler=sched), [RequestSpec(0.0, 100, 4)])
    assert all(i.policy.table.num_samples == 0 for i in plain.instances)


def test_split_needs_an_even_number_of_instances():
    with pytest.raises(ConfigError, match="even number"):
        ClusterSpec(instances=3, mode="split")
    with pytest.raises(ConfigError, match="need --mode split"):
        ClusterSpec(instances=2, split=SplitParams())


def test_sim_cli_split_writes_splits_kv_bytes_and_plots(tmp_path, capsys):
    out = tmp_path / "split.json"
    rc = sim_run.main(["--model", "qwen-2.5-14b", "--instances", "2", "--mode", "split", "--batching", "slo-compose",
                       "--tbt-slo-ms", "100", "--max-num-batched-tokens", "2048", "--split-probes", "4",
                       "--workload", "mix:burstgpt=0.5,azure-code=0.5", "--num-requests", "60", "--rate", "2",
                       "--output", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "split" and r["pairs"] == [[0, 1]] and r["split_params"]["max_probes"] == 4
    assert r["completed"] == 60 and r["splits"]["count"] == 60
    # --split-placement load (the default): either instance of the pair may be a request's alpha
    assert all(q["split"] is not None and sorted(q["pair"]) == [0, 1] and 0 <= q["phi"] <= 1 for q in r["requests"])
    assert r["split_params"]["flip_roles"] is True
    moved = [q for q in r["requests"] if q["handoff_ms"] is not None]
    assert moved and all(q["kv_bytes"] > 0 and q["split_probes"] <= 4 for q in moved)
    assert r["splits"]["kv_bytes_total"] == sum(q["kv_bytes"] for q in r["requests"])
    assert any(p.endswith("_splits.png") for p in r["plots"])
    assert "splits:" in capsys.readouterr().out


def test_fixed_split_placement_keeps_every_alpha_on_instance_0(tmp_path):
    out = tmp_path / "fixed.json"
    rc = sim_run.main(["--model", "qwen-2.5-14b", "--instances", "2", "--mode", "split", "--split-placement", "fixed",
                       "--workload", "burstgpt", "--num-requests", "30", "--rate", "4", "--output", str(out),
                       "--no-progress", "--no-plots"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["split_params"]["flip_roles"] is False
    assert all(q["pair"] == [0, 1] for q in r["requests"])


@pytest.mark.parametrize("argv,needle", [
    (["--mode", "split", "--instances", "3"], "needs an even number >= 2, got 3"),
    (["--instances", "2", "--split-probes", "3"], "--split-* flags need --mode split"),
    (["--instances", "2", "--split-placement", "fixed"], "--split-placement needs --mode split"),
])
def test_bad_split_arguments_give_one_line(tmp_path, capsys, argv, needle):
    rc = sim_run.main([*argv, "--model", "llama-2-7b", "--workload", "alpaca", "--num-requests", "5",
                       "--output", str(tmp_path / "x.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_a_beta_that_can_never_hold_its_part_refuses_and_alpha_runs_the_request_whole():
    """The move machine's split refusal (tidal.cluster.moves), as the runtime's beta answers
    ``refused``: beta's pool (8 blocks of 16) cannot hold a 200-token prompt's KV, so its part is
    refused at the first chunk; alpha keeps the request, clears its split point and finishes it."""
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64)
    insts = [SimInstance(0, config, 512, 16, Constant(), 8192), SimInstance(1, config, 8, 16, Constant(), 8192)]
    planner = SplitPlanner(SplitParams(token_budget=4096, max_num_seqs=64, epsilon_s=0.0), one_per_pass)
    sim = SplitSimulator(insts, planner, [RequestSpec(0.0, 200, 6)], HandoffConfig(LINK, LAYERS, BYTES, 1, 2, 0),
                         max_model_len=8192, length_mode="oracle", stream_tokens=16)
    res = sim.run()
    (t,) = res.splits
    assert t.handoff and t.stayed_on_alpha and t.landed_s is None and t.sent_tokens == 0
    rec = res.records[0]
    assert rec.success and rec.output_tokens == 6
    assert res.instances[1]["steps"] == 0 and _free(sim)
    assert sim.monitor.instances[1].reserved == {} and not sim._moves
    assert summarize_splits(res.splits)["stayed_on_alpha"] == 1


def test_flipped_roles_run_end_to_end_both_ways():
    records = []
    spec = ClusterSpec(model="qwen-2.5-14b", hardware="a100-80g", instances=2, mode="split",
                       scheduler=SchedulerConfig(batching="slo-compose", tbt_slo_ms=100, max_num_batched_tokens=2048,
                                                 max_num_seqs=128),
                       split=SplitParams(flip_roles=True, ttft_target_s=1.0))
    rng = random.Random(2)
    specs = [RequestSpec(i * 0.03, rng.randint(100, 6000), rng.randint(10, 300)) for i in range(120)]
    sim = build_simulator(spec, specs)
    sim.planner.recorder = records.append
    res = sim.run()
    assert all(r.success for r in res.records) and len(records) == 120
    assert {r.decision.pair for r in records} == {(0, 1), (1, 0)}  # either instance is some requests' alpha
    landed = [t for t in res.splits if t.handoff and t.landed_s is not None]
    assert {(t.alpha, t.beta) for t in landed} == {(0, 1), (1, 0)}
    assert all(r.decision.trace and all(p.ttft >= 0 for p in r.decision.trace) for r in records)
