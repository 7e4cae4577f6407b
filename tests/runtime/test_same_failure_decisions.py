"""An instance that dies as a migration starts: the real runtime (a worker SIGKILLed by its pid) and
the simulator (``ClusterSimulator.fail``) end the move the same way and re-run the same requests.

The scenario of ``test_same_migrate_decisions`` (two long prompts on instance 0, whose second waits
for memory; a short one on instance 1), with no restart. In the runtime the victim is killed just
before the front end reserves on the destination and tells the source to start, so its death is
heard later (the reservation was made on an instance already gone, as it can be in a real
cluster); in the simulator it fails at the instant the migration started, after its reservation.
Either way the move machine hears ``failed`` while the KV is on its way:

- the source died: it holds the request no more, so the destination's reservation is released
  and the request is recomputed from its prompt and the tokens it streamed (``failed_over``); the
  queued request of instance 0 is re-run too, both on instance 1, the only one left;
- the destination died: the request stays on its source with its KV (``stayed``), re-run by
  neither shell. In the runtime the source is stopped (SIGSTOP, by its pid) until the front end
  has ended the move, so it reads ``migrate`` and the ``stay`` after it together: the order a
  source meets when the death is heard before it starts. (That order found a drift: the front end
  sent no ``stay`` to a source that had not started, which then moved the request out and let it
  go, and it took the source's late ``handoff`` for a P/D hand-off that waited 120 s for a decode
  instance, so the request was recomputed where the simulator kept it.)

What this compares, in both shells: every migration decision, every move record (request, kind,
source, destination, outcome, events in order) and which requests were re-run, in order; every
request still gets all its tokens. When the destination dies, whether instance 1's short request
had finished is a matter of timing in the runtime, so only "not the moving request" is compared.
Refusals and KV lost on its way are not replayed here: the simulator's monitor is live and its
reservations are made and answered in one instant, so it never refuses a move its controller
chose, nor loses chunks (those paths are the machine's, ``tests/cluster/test_moves.py``, and the
front end's, ``tests/runtime/test_front_moves.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.runtime.shells import leaked_segments, request_specs, serve_burst, sim_instances
from tests.runtime.test_cluster import shm_segments, wait_gone
from tests.runtime.test_same_migrate_decisions import ENGINE, _decisions, _moves, _sim_pressure, _workload
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.moves import MoveKind
from tidal.config import EngineConfig

EXPECTED = {  # who dies -> the move's record, and the requests re-run (recomputed from their tokens)
    "src": ([("r0", "migrate", 0, 1, "failed_over",
              ("start", "reserved 1", "failed 0", "failed over: the source failed mid-move"))], ["r0", "r2"]),
    # the short request of instance 1 is re-run too if it had not finished when its instance died
    "dst": ([("r0", "migrate", 0, 1, "stayed", ("start", "reserved 1", "failed 1", "stayed"))], ["r1"]),
}


def _run_real(work, dies: str):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), router="round-robin", threads_per_instance=1,
                      layers_per_chunk=8, kv_pressure="migrate", restart=False)))
    before = shm_segments()
    llm.start()
    pids = [h.pid for h in llm.handles]
    begin, failover, killed, stopped, rerun = llm.begin_move, llm.failover, [], [], []

    def resume_when_heard() -> None:  # the move fell back and its ``Stay`` left: the source may go on
        deadline = time.monotonic() + 30
        while (not llm.move_records or llm.outbox.queue) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(stopped[0], signal.SIGCONT)

    def begin_move(t, kind, src, *args, **kwargs):  # an instance dies as the migration starts
        if kind is MoveKind.MIGRATE and not killed:
            victim = src if dies == "src" else kwargs["dst"]
            if dies == "dst":  # the source reads ``migrate`` only with the ``stay`` the death brings
                stopped.append(pids[src])
                os.kill(pids[src], signal.SIGSTOP)
                threading.Thread(target=resume_when_heard, daemon=True).start()
            os.kill(pids[victim], signal.SIGKILL)
            killed.append(victim)
        return begin(t, kind, src, *args, **kwargs)

    def failing_over(t):
        rerun.append(t.rid)
        return failover(t)

    llm.begin_move, llm.failover = begin_move, failing_over
    llm.begin_move = begin_move
    try:
        pools = {r.index: (r.num_blocks, r.block_size) for r in llm.monitor.instances}
        assert serve_burst(llm, work) == [m for _, m in work]
        st = llm.stats
        assert killed == [0 if dies == "src" else 1] and st["instance_failures"] == 1 and st["instance_restarts"] == 0
        assert st["failovers"] == len(rerun)
        return _decisions(st["cluster"]["kv_pressure"]["events"]), list(llm.move_records), rerun, pools, llm.config.scheduler
    finally:
        for pid in stopped:  # never left stopped, whatever failed
            os.kill(pid, signal.SIGCONT)
        llm.shutdown()
        wait_gone(pids)  # every worker stopped (the killed one too), by its own id
        assert not leaked_segments(before)


def _run_sim(work, pools, scheduler, dies: str):
    from tidal.cluster.router import build_router
    from tidal.sim.simulator import ClusterSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    handler = _sim_pressure(arch, hw)
    specs, ids = request_specs(work)
    sim = ClusterSimulator(instances, build_router("round-robin"), specs, request_ids=ids,
                           layout=ClusterLayout(2, "colocate", 0), pressure=handler)
    start, failed = handler._start, []  # type: ignore[attr-defined]  (a MigrateHandler)

    def starting(m, now):  # an instance fails at the instant the migration started
        landing = start(m, now)
        if not failed:
            failed.append(getattr(m, dies))
            for e in sim.fail(failed[0], now):
                sim.loop.push(e)
        return landing

    failover, rerun = sim.failover, []

    def failing_over(req, now):
        rerun.append(req.request_id)
        return failover(req, now)

    handler._start, sim.failover = starting, failing_over  # type: ignore[attr-defined]
    res = sim.run()
    assert failed == [0 if dies == "src" else 1]
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    assert sim.num_failovers == len(rerun)
    return _decisions([e.to_dict() for e in handler.events]), res.moves, rerun


@pytest.mark.parametrize("dies", ["src", "dst"])
def test_an_instance_that_dies_as_a_migration_starts_ends_the_move_the_same_way_in_both_shells(dies):
    work = _workload()
    real, real_moves, real_rerun, pools, scheduler = _run_real(work, dies)
    sim, sim_moves, sim_rerun = _run_sim(work, pools, scheduler, dies)
    assert real == sim == [("r0", (0, 1), 11)]  # one migration: nothing is left to move to afterwards
    moves, rerun = EXPECTED[dies]
    assert _moves(real_moves) == _moves(sim_moves) == moves
    if dies == "src":
        assert real_rerun == sim_rerun == rerun
    else:  # the moving request stayed with its KV in both: no shell re-ran it
        assert set(real_rerun) <= set(rerun) and set(sim_rerun) <= set(rerun)
