"""The real runtime (``--kv-pressure drop`` on 2 worker processes) and the simulator move the same
requests into a KunServe group, each the same way through the one move machine (kind ``exchange``).

Least-outstanding routing sends two long prompts (140 tokens; with every token they generate, 10
blocks of 16) to instance 0 and a short one with a long output to instance 1; each pool holds 10
blocks. On instance 0 the first long request takes the pool and the second waits for memory from
the start (its chunk never fits what is left): instance 0 is throttled from its first step on and
the pair drops into one group, instance 0 its head (Sec. 4.1). At the drop, in either shell and
whatever the instant, the first long request runs on 0 with KV (it is far from done), the second
still queues, and the short one runs on 1 (it has tens of tokens to go). So both shells must
record exactly two exchange moves (Sec. 4.2), each landed: the head's own request (0 -> 0: it
stays, its KV of the layers the head dropped goes to the tail) and the tail's (1 -> 0: it moves
to the head, its KV of the tail's layers stays where it is); the queued request moves with no KV,
which is no move in either shell.

What this compares: every exchange move record of the drop (request, kind, source, destination,
outcome, events in order), in both shells. What it does not: the restore (Sec. 4.4) the runtime
makes afterwards gathers the group on its head, where the simulator, as the paper, spreads its
requests over the members (``tidal.runtime.group``'s docstring): the simulator's restore moves are
left out (those recorded once its restore starts); nor when the drop happens, nor how many
tokens each request had computed then (see ``test_same_pressure_decisions``).
"""

from __future__ import annotations

import time

from tests.runtime.shells import (
    leaked_segments,
    pools_of,
    random_work,
    request_specs,
    serve_burst,
    sim_instances,
)
from tests.runtime.test_cluster import shm_segments, wait_gone
from tests.runtime.test_kunserve_runtime import _cluster
from tests.runtime.test_same_pressure_decisions import _eq1

EXPECTED = [("r0", "exchange", 0, 0, "done", ("start", "reserved 0", "landed 0", "done")),
            ("r1", "exchange", 1, 0, "done", ("start", "reserved 0", "landed 0", "done"))]


def _workload() -> list[tuple[list[int], int]]:
    (a, c), (b,) = random_work(8, 2, (140, 141), (19, 20)), random_work(9, 1, (4, 5), (60, 61))
    return [a, b, c]  # least-outstanding: 0, 1, 0


def _moves(records) -> list[tuple]:
    return sorted((m.request_id, m.kind, m.src, m.dst, m.outcome, m.events) for m in records)


def _run_real(work):
    eq1 = _eq1()
    llm = _cluster(microbatch_cost=(eq1.alpha, eq1.beta, eq1.gamma))
    before = shm_segments()
    llm.start()
    pids = [h.pid for h in llm.handles]
    try:
        pools = pools_of(llm)
        assert serve_burst(llm, work) == [m for _, m in work]
        deadline = time.monotonic() + 30  # the restore, so that the workers stop as they started
        while time.monotonic() < deadline and not ("restore-done" in llm.pressure.counts and not llm.pressure.dropped):
            time.sleep(0.1)
        kinds = [e["kind"] for e in llm.pressure.events]
        return kinds, list(llm.move_records), pools, llm.config.scheduler, llm.pressure.model
    finally:
        llm.shutdown()
        wait_gone(pids)  # every worker stopped, by its own id
        assert not leaked_segments(before)


def _run_sim(work, pools, scheduler, model):
    from tidal.cluster.dispatch import ClusterLayout
    from tidal.cluster.router import build_router
    from tidal.sim.links import get_link
    from tidal.sim.pressure import PressureConfig, build_pressure
    from tidal.sim.simulator import ClusterSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    handler = build_pressure(PressureConfig("drop", get_link("shm", hw), model, arch.hidden_size * 4, _eq1(),
                                            layers_per_chunk=4, overhead_s=hw.step_overhead_s))
    specs, ids = request_specs(work)
    sim = ClusterSimulator(instances, build_router("least-outstanding"), specs, request_ids=ids,
                           layout=ClusterLayout(2, "colocate", 0), pressure=handler)
    restore, cut = handler._restore, []  # type: ignore[attr-defined]  (a DropHandler)

    def restoring(plan, now):  # the moves recorded so far are the drop's
        cut.append(len(sim.move_records))
        return restore(plan, now)

    handler._restore = restoring  # type: ignore[attr-defined]
    res = sim.run()
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    return [e.kind for e in handler.events], res.moves[:cut[0] if cut else None]


def test_runtime_and_simulator_move_the_same_requests_into_the_group():
    work = _workload()
    real_kinds, real_moves, pools, scheduler, model = _run_real(work)
    sim_kinds, sim_moves = _run_sim(work, pools, scheduler, model)
    assert pools == {0: (10, 16), 1: (10, 16)}
    # one drop in both shells (then its restore)
    for kinds in (real_kinds, sim_kinds):
        assert kinds[:4] == ["throttle", "drop", "exchange", "exchange-done"] and kinds.count("drop") == 1
    # the same moves into the group, event for event
    assert _moves(m for m in real_moves if m.kind == "exchange") == _moves(sim_moves) == EXPECTED
