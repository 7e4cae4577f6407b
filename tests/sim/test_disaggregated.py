"""Prefill/decode disaggregation in the simulator, on hand-checkable cost and link models:
hand-off timing (chunks one after the other on the prefill instance's link, computing meanwhile),
pending hand-offs and their retries, per-role policies, the link specs, and ``tidal sim`` flags."""

from __future__ import annotations

import json

import pytest

from tidal.cluster.decisions import replay
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.handoff import handoff_blocks
from tidal.cluster.router import build_router
from tidal.config import ConfigError, SchedulerConfig
from tidal.sim import run as sim_run
from tidal.sim.build import ClusterSpec, build_simulator
from tidal.sim.hardware import get_hardware
from tidal.sim.instance import SimInstance
from tidal.sim.links import LinkSpec, get_link
from tidal.sim.models import get_model
from tidal.sim.pd import HandoffConfig, summarize_handoffs
from tidal.sim.simulator import ClusterSimulator
from tidal.workload import RequestSpec

DT = 0.01  # every step
LINK = LinkSpec("test", bandwidth=1e6, latency_s=1e-3)  # 1 MB/s, 1 ms per chunk
BYTES_PER_TOKEN_LAYER = 100


class Constant:
    name = "constant"

    def step_time(self, plan):
        return DT


def _sim(specs, n=2, prefill=1, blocks=(256, 256), layers=4, lpc=2, tpc=0, recorder=None, **sched):
    config = SchedulerConfig(**sched)
    insts = [SimInstance(i, config, blocks[i] if i < len(blocks) else blocks[-1], 16, Constant(), 4096)
             for i in range(n)]
    hc = HandoffConfig(LINK, layers, BYTES_PER_TOKEN_LAYER, 1, lpc, tpc)
    return ClusterSimulator(insts, build_router("round-robin"), specs, layout=ClusterLayout(n, "disaggregate", prefill),
                            handoff=hc, recorder=recorder)


def test_one_handoff_costs_its_chunks_on_the_link_and_decodes_on_the_decode_instance():
    # 100-token prompt, 4 layers in chunks of 2: 2 chunks of 2 x 100 x 100 B = 20 kB, 1 ms + 20 ms each
    sim = _sim([RequestSpec(0.0, 100, 4)])
    res = sim.run()
    (h,) = res.handoffs
    assert (h.src, h.dst, h.num_chunks, h.nbytes, h.blocks) == (0, 1, 2, 40_000, handoff_blocks(100, 16))
    assert h.duration_s == pytest.approx(2 * (1e-3 + 20_000 / 1e6))
    assert h.ready_s == pytest.approx(DT) and h.chosen_s == h.start_s == h.ready_s
    assert h.end_s == pytest.approx(DT + h.duration_s) and h.landed
    rec = res.records[0]
    assert rec.success and rec.output_tokens == 4
    assert rec.ttft_s == pytest.approx(DT)  # the first token comes from the prefill instance
    assert rec.e2e_s == pytest.approx(DT + h.duration_s + 3 * DT)  # then 3 decode steps after landing
    assert res.instances[0]["steps"] == 1 and res.instances[1]["steps"] == 3
    assert [tl["role"] for tl in res.timelines] == ["prefill", "decode"]
    # nothing is left anywhere; the monitor moved the request to the decode instance and finished it
    assert all(i.kv.num_free_blocks == i.kv.num_blocks for i in sim.instances)
    assert sim.monitor.num_handoffs == 1 and all(not r.outstanding and not r.reserved for r in sim.monitor.instances)


def test_the_prefill_keeps_computing_while_chunks_queue_on_its_link():
    # two requests prefilled in consecutive steps (budget 100 tokens); each hand-off takes ~42 ms,
    # so the second waits on the link behind the first while the prefill instance steps on
    specs = [RequestSpec(0.0, 100, 2), RequestSpec(0.0, 100, 2)]
    res = _sim(specs, max_num_batched_tokens=100).run()
    a, b = res.handoffs
    assert a.ready_s == pytest.approx(DT) and b.ready_s == pytest.approx(2 * DT)  # step 2 ran during a's transfer
    assert b.chosen_s == pytest.approx(2 * DT) and b.start_s == pytest.approx(a.end_s)  # FIFO on the link
    assert b.end_s == pytest.approx(a.end_s + b.duration_s)
    s = summarize_handoffs(res.handoffs)
    assert s["landed"] == 2 and s["link_queue_ms"]["max"] == pytest.approx(1000 * (a.end_s - 2 * DT))


def test_a_handoff_waits_for_room_keeping_its_blocks_on_the_prefill_instance():
    # the decode pool (12 blocks) holds one 100-token request (7 blocks + growth) at a time
    specs = [RequestSpec(0.0, 100, 20), RequestSpec(0.0, 100, 20)]
    log = []
    sim = _sim(specs, blocks=(64, 12), recorder=log.append, max_num_batched_tokens=256)
    res = sim.run()
    a, b = res.handoffs
    assert a.chosen_s == pytest.approx(DT) and b.chosen_s > a.end_s  # b waited for a to finish decoding
    assert res.max_pending_handoffs == 1 and all(r.success for r in res.records)
    waits = [d for d in log if d.kind == "handoff" and d.request_id == "1"]
    assert waits[0].choice is None and waits[-1].choice == 1
    for d in log:
        if d.kind == "handoff":
            assert replay(d, ClusterLayout(2, "disaggregate", 1)) == d.choice
    s = summarize_handoffs(res.handoffs, res.max_pending_handoffs)
    assert s["max_pending"] == 1 and s["pending_at_end"] == 0 and s["wait_ms"]["max"] > 0


def test_prefill_holds_a_pending_request_blocks():
    specs = [RequestSpec(0.0, 100, 20), RequestSpec(0.0, 100, 20)]
    sim = _sim(specs, blocks=(64, 12), max_num_batched_tokens=256)
    sim.run(until=DT + 0.06)  # a landed at ~0.052; b waits for room on the decode instance
    assert list(sim._pending) == [1] and "1" in sim.instances[0].scheduler.paused
    assert sim.instances[0].kv.num_blocks_of("1") == handoff_blocks(100, 16)
    assert sim.monitor.pending_handoffs == {"1": handoff_blocks(100, 16)}


def test_handoffs_go_to_the_decode_instance_with_the_most_room():
    specs = [RequestSpec(0.0, 20 + 40 * i, 30) for i in range(6)]
    log = []
    res = _sim(specs, n=3, blocks=(256, 256, 256), recorder=log.append).run()
    taken = [d for d in log if d.kind == "handoff" and d.choice is not None]
    assert len(taken) == 6 and {d.choice for d in taken} == {1, 2}
    for d in taken:  # the chosen one had the most room among those that fit
        rooms = {v.index: v.handoff_room for v in d.views if v.role == "decode"}
        assert rooms[d.choice] == max(rooms.values())
    assert sorted(res.routed) == [0] * 6 and all(r.success for r in res.records)


def test_single_token_requests_finish_on_the_prefill_instance():
    res = _sim([RequestSpec(0.0, 50, 1), RequestSpec(0.0, 50, 3)]).run()
    assert [h.request_id for h in res.handoffs] == ["1"]
    assert all(r.success for r in res.records)


def test_disaggregated_needs_a_handoff_config_and_a_matching_layout():
    insts = [SimInstance(i, SchedulerConfig(), 64, 16, Constant(), 4096) for i in range(2)]
    with pytest.raises(ValueError, match="HandoffConfig"):
        ClusterSimulator(insts, build_router("round-robin"), [], layout=ClusterLayout(2, "disaggregate", 1))
    with pytest.raises(ValueError, match="layout has 3"):
        ClusterSimulator(insts, build_router("round-robin"), [], layout=ClusterLayout(3))


# ---------------------------------------------------------------------------- links
def test_links_per_hardware():
    a100, h100, cpu = get_hardware("a100-40g"), get_hardware("h100-80g"), get_hardware("cpu")
    assert get_link(None, a100).name == "nvlink" and get_link(None, cpu).name == "shm"
    assert get_link("nvlink", a100).bandwidth == pytest.approx(300e9 * 0.8)
    assert get_link("nvlink", h100).bandwidth == pytest.approx(450e9 * 0.8)
    assert get_link("pcie", a100).bandwidth == 25e9 and get_link("pcie", h100).bandwidth == 50e9
    assert get_link("ib-hdr", a100).bandwidth == pytest.approx(22.5e9)
    assert get_link("eth-100g", a100).latency_s > get_link("ib-hdr", a100).latency_s > get_link("nvlink", a100).latency_s
    with pytest.raises(ValueError, match="has no nvlink"):
        get_link("nvlink", cpu)
    with pytest.raises(ValueError, match="unknown link"):
        get_link("carrier-pigeon", a100)
    link = get_link("pcie", a100)
    assert link.chunk_time(25e6, tp=2) == pytest.approx(10e-6 + 0.5e-3)  # each GPU sends its half


def test_a_llama2_13b_longbench_prompt_over_nvlink_pcie_and_ethernet():
    arch, a100 = get_model("llama-2-13b"), get_hardware("a100-40g")
    times = {name: HandoffConfig.for_model(arch, 2, get_link(name, a100)).cost(3500)[2]
             for name in ("nvlink", "pcie", "eth-100g")}
    nbytes = 3500 * arch.kv_bytes_per_token(2)  # 2.87 GB: 819,200 B per token
    assert HandoffConfig.for_model(arch, 2, get_link("nvlink", a100)).cost(3500)[:2] == (5, nbytes)
    assert times["nvlink"] == pytest.approx(5 * 10e-6 + nbytes / 240e9)  # ~12 ms
    assert times["pcie"] == pytest.approx(5 * 10e-6 + nbytes / 25e9)  # ~115 ms
    assert times["eth-100g"] > times["pcie"] > times["nvlink"]


# ---------------------------------------------------------------------------- build and CLI
def test_prefill_instances_can_run_their_own_policy():
    spec = ClusterSpec(model="llama-2-7b", hardware="a100-80g", instances=3, mode="disaggregate", prefill_instances=1,
                       prefill_batching="bucket", scheduler=SchedulerConfig(batching="sla", tbt_slo_ms=50,
                                                                            policy_args={"bucket.theta": "0.6"}))
    sim = build_simulator(spec, [RequestSpec(0.0, 64, 4)])
    assert [type(i.policy).__name__ for i in sim.instances] == ["BucketPolicy", "SLAPolicy", "SLAPolicy"]
    assert sim.instances[0].scheduler.config.policy_args == {"bucket.theta": "0.6"}
    assert sim.instances[1].scheduler.config.policy_args == {}
    assert all(r.success for r in sim.run().records)
    with pytest.raises(ConfigError, match="needs --mode disaggregate"):
        ClusterSpec(prefill_batching="bucket")
    with pytest.raises(ConfigError, match=r"\[1, 2\]"):
        ClusterSpec(instances=3, mode="disaggregate")


def test_sim_cli_disaggregated_writes_handoffs_roles_and_plots(tmp_path, capsys):
    out = tmp_path / "pd.json"
    rc = sim_run.main(["--model", "llama-2-7b", "--hardware", "a100-40g", "--instances", "3", "--mode", "disaggregate",
                       "--prefill-instances", "1", "--prefill-batching", "bucket", "--link", "pcie", "--workload",
                       "mix:alpaca=0.8,longbench=0.2", "--max-input-len", "3000", "--num-requests", "60",
                       "--rate", "2", "--slo", "ttft=3000,tpot=150", "--output", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "disaggregate" and r["roles"] == ["prefill", "decode", "decode"]
    assert r["prefill_batching"] == "bucket" and r["batching"] == "continuous" and r["link"]["name"] == "pcie"
    h = r["handoffs"]
    assert h["count"] == h["landed"] == r["completed"] == 60 and h["transfer_ms"]["p50"] > 0
    assert [t["role"] for t in r["timelines"]] == r["roles"]
    assert all(q["instance"] == 0 and q["decode_instance"] in (1, 2) and q["handoff_ms"] > 0 for q in r["requests"])
    assert any(p.endswith("_handoffs.png") for p in r["plots"])
    assert "hand-offs: 60 landed of 60" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--mode", "disaggregate", "--instances", "2"], "--prefill-instances must be in [1, instances - 1] = [1, 1]"),
    (["--instances", "2", "--prefill-instances", "1"], "needs --mode disaggregate"),
    (["--link", "pcie"], "--link needs --mode disaggregate"),
    (["--mode", "disaggregate", "--instances", "2", "--prefill-instances", "1", "--hardware", "cpu",
      "--model", "smollm2-135m", "--link", "nvlink"], "has no nvlink"),
    (["--mode", "disaggregate", "--instances", "2", "--prefill-instances", "1", "--prefill-batching", "magic"],
     "unknown policy 'magic'"),
    (["--mode", "disaggregate", "--instances", "2", "--prefill-instances", "1", "--prefill-batching", "bucket",
      "--policy-arg", "sla.alpha=1"], "names a policy no instance runs"),
    (["--workload", "mix:alpaca=x"], "bad workload"),
])
def test_bad_cluster_arguments_give_one_line(tmp_path, capsys, argv, needle):
    args = list(argv)
    if "--model" not in args:
        args += ["--model", "llama-2-7b"]
    if "--workload" not in args:
        args += ["--workload", "alpaca"]
    rc = sim_run.main([*args, "--num-requests", "5", "--output", str(tmp_path / "x.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and err.count("\n") == 1, err
