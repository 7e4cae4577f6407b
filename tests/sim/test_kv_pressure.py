"""``tidal sim --kv-pressure``: KunServe groups, the migration baseline and the preempt watcher,
on hand-checkable instances (tiny pools, constant or Eq. 1 step times)."""

from __future__ import annotations

import json

import pytest

from tidal.cluster.pressure import ChunkCost, ModelMemory
from tidal.cluster.router import build_router
from tidal.config import SchedulerConfig
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim import run as sim_run
from tidal.sim.instance import SimInstance
from tidal.sim.links import LinkSpec
from tidal.sim.pipeline import GroupInstance, PipelineCostModel, group_blocks
from tidal.sim.pressure import PressureConfig, build_pressure
from tidal.sim.simulator import ClusterSimulator
from tidal.workload import RequestSpec

# 4 layers; one token's KV is 4 bytes (1 per layer): a block of 16 tokens is 64 bytes; a layer's
# weights are 640 bytes = 10 blocks' worth
MODEL = ModelMemory(num_layers=4, layer_bytes=640, kv_bytes_per_token=4)
LINK = LinkSpec("test", bandwidth=1e6, latency_s=0.001)  # 1 MB/s: moves take visible time


class Constant:
    name = "constant"

    def __init__(self, dt: float):
        self.dt = dt

    def step_time(self, plan):
        return self.dt


class Eq1Model:
    """Step time = Eq. 1 summed over the plan's chunks (alpha 1, beta 0, gamma 0)."""

    name = "eq1"

    def step_time(self, plan):
        return sum(ChunkCost(1.0, 0.0, 0.0).chunk(c.start, c.num_tokens) for c in plan.chunks)


def _cfg(mode: str, **kw) -> PressureConfig:
    return PressureConfig(mode, LINK, MODEL, hidden_bytes=8, chunk_cost=ChunkCost(1.0, 0.0, 0.0), **kw)


def _instances(n=2, blocks=32, dt=0.01):
    return [SimInstance(i, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256), blocks, 16, Constant(dt),
                        4096, timeline_interval=0.0) for i in range(n)]


def _burst(n=12, prompt=100, out=60):
    return [RequestSpec(0.0, prompt, out) for _ in range(n)]


def _run(mode: str | None, specs=None, n=2, blocks=32):
    handler = build_pressure(_cfg(mode)) if mode else None
    sim = ClusterSimulator(_instances(n, blocks), build_router("round-robin"), specs or _burst(), pressure=handler)
    return sim, sim.run()


def _tokens_ok(res, specs):
    return all(r.success and r.counted_tokens == s.output_len for r, s in zip(res.records, specs, strict=True))


def test_a_pair_pools_its_kv_and_the_dropped_weights():
    insts = _instances(2, 64)
    layers = {0: (0, 2), 1: (2, 4)}
    # each stage: 64 blocks x 64 B + 2 dropped layers x 640 B = 5376 B, over half a block's KV (32 B)
    assert group_blocks(insts, layers, _cfg("drop")) == 168
    # = k K + (k - 1) L layer_bytes / block_bytes = 128 + 4 * 640 / 64
    grp = GroupInstance(insts, layers, _cfg("drop"), insts[0].scheduler.config, Constant(0.01), 0.0, 0.0)
    assert grp.kv.num_blocks == 168 and grp.index == 0 and grp.group == (0, 1)
    assert grp.scheduler.config.max_num_seqs == 128 and grp.scheduler.config.max_num_batched_tokens == 512


def test_drop_forms_a_group_exchanges_kv_and_restores_without_losing_a_token():
    specs = _burst()
    sim, res = _run("drop", specs)
    kinds = [e["kind"] for e in res.pressure["events"]]
    assert kinds[:4] == ["throttle", "drop", "exchange", "exchange-done"], kinds
    assert "restore" in kinds and kinds.index("restore-done") > kinds.index("restore")
    drop = next(e for e in res.pressure["events"] if e["kind"] == "drop")
    assert drop["groups"] == [[0, 1]] and drop["layers"] == {0: [0, 2], 1: [2, 4]}
    ex = next(e for e in res.pressure["events"] if e["kind"] == "exchange")
    assert ex["pool_blocks"] == 32 * 2 + 4 * 640 // 64  # 104
    # each running request sent half its layers: 2 layers x tokens x 1 B, on the 1 MB/s link
    assert ex["bytes"] > 0 and ex["bytes"] % 2 == 0
    done = next(e for e in res.pressure["events"] if e["kind"] == "exchange-done")
    assert done["seconds"] >= ex["bytes"] / 2 / 1e6  # two senders at most, in parallel
    assert _tokens_ok(res, specs)
    assert [type(i).__name__ for i in sim.instances] == ["SimInstance", "SimInstance"]  # put back at the end
    g = res.pressure["groups"][0]
    assert g["group"] == [0, 1] and g["steps"] > 0 and 0.0 <= g["bubble_ratio"] < 1.0


def test_drop_avoids_the_preemptions_and_the_queue_of_preempt():
    specs = _burst(8)  # 4 per instance: 4 x 7 blocks admitted, 4 x 11 at the end > 32; 8 x 11 <= 104
    _, pre = _run("preempt", specs)
    _, drop = _run("drop", specs)
    assert _tokens_ok(pre, specs) and _tokens_ok(drop, specs)
    pre_pre = sum(i["num_preemptions"] for i in pre.instances)
    assert pre_pre > 0  # the 9th block of the 4th request: one is evicted, and throttles at the head of the queue
    assert sum(g["num_preemptions"] for g in drop.pressure["groups"]) == 0  # the pair holds them all
    assert max(r.e2e_s for r in drop.records) < 0.8 * max(r.e2e_s for r in pre.records)  # no recompute
    assert [e["kind"] for e in pre.pressure["events"]] == ["throttle"] * len(pre.pressure["events"])


def test_preempt_only_watches():
    specs = _burst()
    _, plain = _run(None, specs)
    _, watched = _run("preempt", specs)
    assert [(r.ttft_s, r.e2e_s) for r in plain.records] == [(r.ttft_s, r.e2e_s) for r in watched.records]
    assert plain.pressure is None and watched.pressure["counts"]["throttle"] >= 1


def test_migrate_moves_kv_over_the_link_to_the_spare_instance():
    # instance 0 gets 6 long requests, instance 1 stays nearly empty (round-robin over 12 with odd ones tiny)
    specs = [RequestSpec(0.0, 100, 60) if i % 2 == 0 else RequestSpec(0.0, 8, 2) for i in range(12)]
    sim, res = _run("migrate", specs)
    p = res.pressure
    assert p["migrated"] >= 1 and p["counts"]["migrate"] >= p["migrated"]
    mig = next(e for e in p["events"] if e["kind"] == "migrate")
    assert mig["instances"] == [0, 1]
    # a request's KV: tokens x 4 B, one chunk per 8 layers (all 4 here): latency + bytes / 1 MB/s
    assert p["migrated_bytes"] % 4 == 0 and p["mean_stall_ms"] >= 1.0 + 100 * 4 / 1e6 * 1000
    assert _tokens_ok(res, specs)
    assert sum(1 for r in sim.monitor.instances[1].outstanding) == 0  # all finished


def test_pipeline_step_balances_by_cost_not_tokens():
    chunk = ScheduledChunk("r", (0,) * 8, 0, (), True, SamplingParams(max_tokens=4))
    plan = StepPlan(1, (chunk,), BatchComposition.of([chunk]))
    period = {}
    for lookahead in (True, False):
        cost = PipelineCostModel(Eq1Model(), [0.5, 0.5], _cfg("drop", lookahead=lookahead), overhead_s=0.0)
        period[lookahead] = cost.step_time(plan)
    # by tokens: 4 + 4 tokens cost 10 and 26 (Fig. 17); by cost (Fig. 11): 5 + 3 tokens cost 15 and 21;
    # the slower microbatch's trip through both stages, plus its activations (8 B a token) once
    assert period[False] == pytest.approx(26.0 + LINK.chunk_time(4 * 8))
    assert period[True] == pytest.approx(21.0 + LINK.chunk_time(5 * 8))


def test_sim_cli_kv_pressure(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = sim_run.main(["--model", "qwen-2.5-14b", "--hardware", "a800-80g", "--instances", "2", "--kv-pressure",
                       "drop", "--router", "kv-aware", "--max-num-seqs", "512", "--gpu-memory-utilization", "0.5",
                       "--workload", "sharegpt", "--num-requests", "300", "--rate", "6", "--burstiness", "0.2",
                       "--output", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["kv_pressure"]["mode"] == "drop" and r["pressure_link"]["name"] == "ib-hdr"
    assert {"drop", "exchange"} <= set(r["kv_pressure"]["counts"])
    assert "kv pressure (drop)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--kv-pressure", "drop", "--instances", "1"], "needs at least 2 instances"),
    (["--kv-pressure", "migrate", "--instances", "3", "--mode", "disaggregate", "--prefill-instances", "1"],
     "needs colocated instances"),
    (["--no-lookahead"], "--no-lookahead needs --kv-pressure drop"),
    (["--link", "ib-hdr"], "--link needs --mode disaggregate or split, or --kv-pressure"),
])
def test_bad_kv_pressure_arguments_give_one_line(tmp_path, capsys, argv, needle):
    rc = sim_run.main([*argv, "--workload", "alpaca", "--num-requests", "5", "--output", str(tmp_path / "x.json"),
                       "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("dies, outcome", [("src", "failed_over"), ("dst", "stayed")])
def test_an_instance_failing_under_a_migration_ends_the_move_as_the_machine_says(dies, outcome):
    """The first migration's source (or destination) fails as it starts: the move ends as
    :class:`tidal.cluster.moves.Move` says (recomputed elsewhere / left on its source), the dead
    instance's other requests are re-run on the survivor, and every request gets all its tokens."""
    specs = [RequestSpec(0.0, 100, 60) if i % 2 == 0 else RequestSpec(0.0, 8, 2) for i in range(12)]
    handler = build_pressure(_cfg("migrate"))
    sim = ClusterSimulator(_instances(2, 32), build_router("round-robin"), specs, pressure=handler)
    start, failed, held = handler._start, [], set()

    def starting(m, now):
        landing = start(m, now)
        if not failed:
            failed.append(getattr(m, dies))
            held.update(sim.instances[failed[0]].scheduler.requests)
            for e in sim.fail(failed[0], now):
                sim.loop.push(e)
        return landing

    handler._start = starting
    res = sim.run()
    first = res.moves[0]
    assert failed == [getattr(first, dies)] and (first.src, first.dst) == (0, 1)
    assert first.outcome == outcome and f"failed {failed[0]}" in first.events
    assert len(res.moves) == 1  # no migration after: its peer is dead
    # every request the dead one held is re-run elsewhere, but for a destination's copy of the moving one
    assert first.request_id in held and sim.num_failovers == len(held) - (dies == "dst") > 0
    assert _tokens_ok(res, specs)
    assert not sim.monitor.instances[failed[0]].alive and not handler.moves


def test_a_failure_needs_colocated_instances_on_the_event_loop():
    sim = ClusterSimulator(_instances(2), build_router("round-robin"), _burst(2))
    sim.run()
    sim._fast = True
    with pytest.raises(ValueError, match="colocated instances without pipeline groups"):
        sim.fail(0, 0.0)
