"""The real cluster runtime and the simulator make the same dispatch and hand-off decisions.

One real cluster (3 worker processes: 1 prefill + 2 decode, shared-memory KV hand-offs) serves a
burst of 16 requests at t=0 with round-robin routing; its dispatcher records every decision with
the monitor's view it was taken on (``tidal.cluster.decisions``). The simulator then serves the
same request sequence (the same prompt lengths and output lengths, a burst at t=0) on instances
with the real workers' KV pools and scheduler configuration, recording its own decisions.

What this proves:
- dispatch: both shells send the same requests, in the same order, with the same router inputs
  (prompt length, max tokens) to the same instances, seeing the same outstanding counts;
- hand-off: both shells hand off exactly the same requests, in the same order, each needing
  the same number of KV blocks (the prefill pauses after the first token in both, and both size
  the move with ``handoff_blocks``); both plan the same chunks (``plan_chunks`` is one function);
- every hand-off target, in either shell, is exactly what ``Dispatcher.choose_decode`` answers on
  the logged view of the monitor (``replay``): the decision is a function of the view, and both
  shells ask it the same question (blocks needed, request order, the same reservation bookkeeping).

What it does not prove: that the two shells see the same *views* at each hand-off. The runtime's
monitor hears each worker's status after its steps, at real times; the simulator's sees its
instances live on a modelled clock; so which decode instance has the most room when a given
request is handed off can differ, and the targets are not compared one to one. Nor does it say
anything about timing (the cost model or the link model).
"""

from __future__ import annotations

from tests.runtime.shells import pools_of, random_work, request_specs, serve_burst, sim_instances
from tests.runtime.test_cluster import wait_gone
from tidal.cluster.decisions import Decision, replay
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.handoff import DEFAULT_LAYERS_PER_CHUNK, handoff_blocks, plan_chunks
from tidal.config import EngineConfig

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)
N = 16


def _workload() -> list[tuple[list[int], int]]:
    return random_work(7, N)


def test_the_runtime_reexports_the_pure_chunk_plan_and_defaults():
    from tidal.runtime import kv_transfer
    from tidal.runtime.cluster import ClusterConfig

    assert kv_transfer.plan_chunks is plan_chunks
    assert ClusterConfig().layers_per_chunk == DEFAULT_LAYERS_PER_CHUNK


def _run_real(work) -> tuple[list[Decision], dict, dict]:
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(3, "disaggregate", 1), router="round-robin",
                      threads_per_instance=1, layers_per_chunk=10, tokens_per_chunk=16)))
    log: list[Decision] = []
    llm.dispatcher.recorder = log.append
    pids: list[int] = []
    try:
        llm.start()
        pids = [h.pid for h in llm.handles if h is not None]
        assert serve_burst(llm, work) == [m for _, m in work]
        snap = llm.stats["cluster"]
        return log, snap, {"pools": pools_of(llm), "scheduler": llm.config.scheduler, "moves": list(llm.move_records)}
    finally:
        llm.shutdown()
        wait_gone(pids)  # every worker stopped, by its own id


def _run_sim(work, pools: dict, scheduler) -> tuple[list[Decision], object]:
    from tidal.cluster.router import build_router
    from tidal.sim.links import get_link
    from tidal.sim.pd import HandoffConfig
    from tidal.sim.simulator import ClusterSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    log: list[Decision] = []
    specs, ids = request_specs(work)
    sim = ClusterSimulator(instances, build_router("round-robin"), specs, request_ids=ids,
                           layout=ClusterLayout(3, "disaggregate", 1),
                           handoff=HandoffConfig.for_model(arch, 4, get_link("shm", hw), 1, 10, 16),
                           recorder=log.append)
    return log, sim.run()


def test_runtime_and_simulator_make_the_same_dispatch_and_handoff_decisions():
    work = _workload()
    real, snap, info = _run_real(work)
    sim_log, res = _run_sim(work, info["pools"], info["scheduler"])
    layout = ClusterLayout(3, "disaggregate", 1)

    # the real cluster ran every request through a hand-off, and so did the simulator
    assert snap["num_handoffs"] == N and snap["pending_handoffs"] == 0
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    assert sum(h.landed for h in res.handoffs) == N

    # dispatch: same requests, order, router inputs, targets and outstanding counts seen
    def dispatches(log):
        return [(d.request_id, d.request.prompt_len, d.request.max_tokens, d.choice,
                 tuple(v.num_outstanding for v in d.views), tuple(v.role for v in d.views))
                for d in log if d.kind == "dispatch"]

    assert dispatches(real) == dispatches(sim_log)
    assert [d.choice for d in real if d.kind == "dispatch"] == [0] * N  # the one prefill instance

    # hand-offs: the same requests, in the same order, needing the same blocks
    def first_asks(log):
        seen, out = set(), []
        for d in log:
            if d.kind == "handoff" and d.request_id not in seen:
                seen.add(d.request_id)
                out.append((d.request_id, d.blocks))
        return out

    bs = info["pools"][0][1]
    expected = [(f"r{i}", handoff_blocks(len(ids), bs)) for i, (ids, _) in enumerate(work)]
    assert first_asks(real) == first_asks(sim_log) == expected

    # every decision is the pure dispatcher's answer on the view it logged, in both shells
    for log in (real, sim_log):
        handoffs = [d for d in log if d.kind == "handoff"]
        assert handoffs and all(replay(d, layout) == d.choice for d in handoffs)
        taken = [d for d in handoffs if d.choice is not None]
        assert sorted(d.request_id for d in taken) == sorted(f"r{i}" for i in range(N))
        assert {d.choice for d in taken} <= {1, 2}
    # every hand-off is a move of the one machine (tidal.cluster.moves) in both shells, and each went
    # the same way: from the prefill instance, reserved on a decode instance, landed, done (a
    # refusal on a stale view, which only the runtime can meet, would show as "refused" and a retry)
    def moves(records):
        return sorted((m.request_id, m.kind, m.src, m.outcome, tuple(e.split()[0] for e in m.events if
                                                                      not e.startswith("refused")))
                      for m in records)

    expected_moves = sorted((f"r{i}", "handoff", 0, "done", ("start", "reserved", "landed", "done")) for i in range(N))
    assert moves(info["moves"]) == moves(res.moves) == expected_moves
    assert all(m.dst in (1, 2) for m in [*info["moves"], *res.moves])
    # the chunks of every hand-off, as both shells plan them (layers 0-29 by 10, tokens by 16)
    assert [h.num_chunks for h in res.handoffs] == [len(plan_chunks(range(30), 0, len(ids), 10, 16))
                                                  for ids, _ in work]
