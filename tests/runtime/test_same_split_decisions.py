"""The real runtime (``--mode split`` on 2 worker processes) and the simulator make the same
DynaServe split decisions (Alg. 1: pair, split point, probes) for the same request sequence.

Both shells drive a :class:`tidal.cluster.split.SplitPlanner` with the same parameters and the
same step-time model, and receive the same burst of requests at t=0 (the same prompt lengths and
max_tokens): before any request has progressed, the planner's ledgers hold exactly what it
committed itself, so every decision must come out the same. Each runtime decision is also asked
again of a fresh planner on its logged ledgers (``replay``): it is a function of what it saw.

What it does not prove: that later decisions agree once requests progress (the runtime learns of
progress from its workers' outputs at real times, the simulator on its modelled clock). On a loaded
machine that progress can reach the runtime's planner before the burst's last request is planned:
the decisions (and those requests' KV moves) are compared up to the first whose inputs differ, and
that difference must be progress (work gone from a ledger, a step's budget or a cached prefix heard)."""

from __future__ import annotations

import numpy as np

from tests.runtime.shells import pools_of, random_work, request_specs, serve_burst, sim_instances
from tests.runtime.test_cluster import ENGINE, settle, stop
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.split import SplitParams, SplitPlanner, replay
from tidal.config import EngineConfig

N = 12
PARAMS = SplitParams(token_budget=64, max_num_seqs=256, epsilon_s=0.001)


def step_time(p: float, ctx: float, d: float) -> float:
    return 0.004 + 2e-4 * p + 5e-4 * d + 1e-7 * ctx * d


def _workload() -> list[tuple[list[int], int]]:
    return random_work(11, N)


def _run_real(work):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    log = []
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "split"), threads_per_instance=1, layers_per_chunk=10,
                      tokens_per_chunk=16)), splitter=SplitPlanner(PARAMS, step_time, recorder=log.append))
    llm.start()
    try:
        assert serve_burst(llm, work) == [m for _, m in work]
        settle(llm)
        return log, pools_of(llm), llm.config.scheduler, {**llm.stats, "moves": list(llm.move_records)}
    finally:
        stop(llm)


def _run_sim(work, pools, scheduler):
    from tidal.sim.links import get_link
    from tidal.sim.pd import HandoffConfig
    from tidal.sim.split import SplitSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    specs, ids = request_specs(work)
    log = []
    sim = SplitSimulator(instances, SplitPlanner(PARAMS, step_time, recorder=log.append),
                         specs,
                         HandoffConfig.for_model(arch, 4, get_link("shm", hw), 1, 10, 16),
                         max_model_len=arch.max_position_embeddings, request_ids=ids)
    return log, sim.run()


def test_runtime_and_simulator_make_the_same_split_decisions():
    work = _workload()
    real, pools, scheduler, stats = _run_real(work)
    sim, res = _run_sim(work, pools, scheduler)
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]

    def key(log):
        return [(r.decision.request_id, r.decision.pair, r.decision.prompt_len, r.decision.predicted_output,
                 r.decision.split, r.decision.probes, r.decision.cold_start) for r in log]

    def inputs(r):
        return r.candidates, r.max_tokens, r.ledgers, r.budgets, r.cached

    def work(r):  # each part's remaining prefill and decode tokens, by (instance, request)
        return {(i, p.request_id): (p.prefill_tokens, p.decode_tokens) for i, parts in r.ledgers for p in parts}

    assert len(real) == len(sim) == N
    # until the runtime's planner hears its workers' first progress it sees what the simulator's saw and
    # decides the same; on a loaded machine that progress can come (at real times) before the burst's last
    # request is planned, and from there each decision is only a function of its own inputs (replay below)
    agree = next((k for k in range(N) if inputs(real[k]) != inputs(sim[k])), N)
    assert agree >= 1 and key(real[:agree]) == key(sim[:agree])
    if agree < N:  # what set them apart is progress: work gone from the runtime's ledgers, or a step heard
        r, s = real[agree], sim[agree]
        wr, ws = work(r), work(s)
        assert (r.candidates, r.max_tokens) == (s.candidates, s.max_tokens) and set(wr) <= set(ws)
        assert all(wr[k][0] <= ws[k][0] and wr[k][1] <= ws[k][1] for k in wr)
        assert wr != ws or r.budgets != s.budgets or r.cached != s.cached
    assert any(r.decision.handoff for r in real) and real[0].decision.cold_start
    for r in real:  # each decision is a function of the ledgers it saw
        again = replay(r, step_time, PARAMS)
        assert (again.pair, again.split, again.probes) == (r.decision.pair, r.decision.split, r.decision.probes)
    # the runtime split what it planned to split, and moved KV for each of them
    assert stats["splits"] == sum(r.decision.handoff for r in real) and stats["kv_bytes_moved"] > 0
    # every beta part is a move of the one machine (tidal.cluster.moves) in both shells, from the
    # decision's alpha to its beta, and each ended the same way, event for event
    def moves(records):
        return sorted((m.request_id, m.kind, m.src, m.dst, m.outcome, m.events) for m in records)

    planned = sorted((r.decision.request_id, r.decision.pair) for r in real if r.decision.handoff)
    assert [(m[0], (m[2], m[3])) for m in moves(stats["moves"])] == planned
    same = {r.decision.request_id for r in real[:agree]}  # the requests both shells decided alike

    def alike(ms):
        return [m for m in moves(ms) if m[0] in same]
    assert alike(stats["moves"]) == alike(res.moves)
    assert {m.outcome for m in res.moves} == {"done"}


def test_a_refused_split_stays_on_alpha_the_same_way_in_both_shells():
    """A refusal replayed through both shells: beta's pool (``ClusterConfig.kv_blocks``: 8 blocks
    of 16 tokens) can never hold a 200-token prompt, so the runtime's beta answers ``Refused`` to
    the reservation and the simulated beta refuses it as well; in both the move machine falls back
    (the request stays on alpha, which runs it whole) and records the same move, event for event."""
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    rng = np.random.default_rng(5)
    work = [(rng.integers(100, 40000, size=200).tolist(), 6)]
    log: list = []
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "split"), threads_per_instance=1, layers_per_chunk=10,
                      tokens_per_chunk=16, kv_blocks=(256, 8))),
        splitter=SplitPlanner(PARAMS, step_time, recorder=log.append))
    llm.start()
    try:
        assert serve_burst(llm, work) == [6]  # alpha ran it whole
        settle(llm)
        pools, scheduler, real_moves = pools_of(llm), llm.config.scheduler, list(llm.move_records)
    finally:
        stop(llm)
    assert pools[1][0] == 8 and pools[0][0] == 256  # each worker sized its own pool
    (d,) = log
    assert d.decision.handoff and d.decision.pair == (0, 1)  # the planner split it onto the small beta
    sim_log, res = _run_sim(work, pools, scheduler)
    assert [(r.decision.pair, r.decision.split) for r in sim_log] == [(d.decision.pair, d.decision.split)]
    assert res.records[0].success and res.records[0].output_tokens == 6

    def moves(records):
        return [(m.request_id, m.kind, m.src, m.dst, m.outcome, m.events) for m in records]

    assert moves(real_moves) == moves(res.moves)
    (m,) = real_moves
    assert m.kind == "split" and m.outcome != "done" and "refused" in " ".join(map(str, m.events))
