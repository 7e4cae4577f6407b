"""An instance that dies under a migration: the real runtime (a worker SIGKILLed by its pid) and the
simulator (``ClusterSimulator.fail``) end the move the same way and re-run the same requests.

The scenario of ``test_same_migrate_decisions`` (two long prompts on instance 0, whose second waits
for memory; a short one on instance 1), with no restart: the migration's source dies as the
migration starts. In the runtime the worker is killed just before the front end reserves on the
destination and tells the source to start (its death is heard later: the reservation was made on
a source already gone, as it can be in a real cluster); in the simulator instance 0 fails at the
instant the migration started, after its reservation. Either way, the move machine hears
``failed 0`` while the KV is on its way: the source holds the request no more, so the destination's
reservation is released and the request is recomputed from its prompt and the tokens it streamed
(``failed_over``); the queued request of instance 0 is re-run too, and both land on instance 1,
the only one left (where the queue cannot move on: no migration target is alive).

What this compares, in both shells: every migration decision, every move record (request, kind,
source, destination, outcome, events in order) and the number of requests re-run; every request
still gets all its tokens. A destination that dies mid-move or refuses, and KV lost on its way,
are not replayed here: the runtime's outcome then depends on whether the source's last chunk or
the failure (or the refusal) is heard first, and the simulator, whose monitor is live and whose
reservations are made and answered in one instant, never refuses a move its controller chose
(those paths are the machine's, ``tests/cluster/test_moves.py``, and the front end's,
``tests/runtime/test_front_moves.py``; the simulator's destination failure is in
``tests/sim/test_kv_pressure.py``).
"""

from __future__ import annotations

import os
import signal

from tests.runtime.shells import leaked_segments, request_specs, serve_burst, sim_instances
from tests.runtime.test_cluster import shm_segments, wait_gone
from tests.runtime.test_same_migrate_decisions import ENGINE, _decisions, _moves, _sim_pressure, _workload
from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.moves import MoveKind
from tidal.config import EngineConfig

EXPECTED = [("r0", "migrate", 0, 1, "failed_over",
             ("start", "reserved 1", "failed 0", "failed over: the source failed mid-move"))]


def _run_real(work):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), router="round-robin", threads_per_instance=1,
                      layers_per_chunk=8, kv_pressure="migrate", restart=False)))
    before = shm_segments()
    llm.start()
    pids = [h.pid for h in llm.handles]
    begin, killed = llm.begin_move, []

    def begin_move(t, kind, src, *args, **kwargs):  # the source dies as its migration starts
        if kind is MoveKind.MIGRATE and not killed:
            os.kill(pids[src], signal.SIGKILL)
            killed.append(src)
        return begin(t, kind, src, *args, **kwargs)

    llm.begin_move = begin_move
    try:
        pools = {r.index: (r.num_blocks, r.block_size) for r in llm.monitor.instances}
        assert serve_burst(llm, work) == [m for _, m in work]
        st = llm.stats
        assert killed == [0] and st["instance_failures"] == 1 and st["instance_restarts"] == 0
        return (_decisions(st["cluster"]["kv_pressure"]["events"]), list(llm.move_records), st["failovers"], pools,
                llm.config.scheduler)
    finally:
        llm.shutdown()
        wait_gone(pids)  # every worker stopped (the killed one too), by its own id
        assert not leaked_segments(before)


def _run_sim(work, pools, scheduler):
    from tidal.cluster.router import build_router
    from tidal.sim.simulator import ClusterSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    handler = _sim_pressure(arch, hw)
    specs, ids = request_specs(work)
    sim = ClusterSimulator(instances, build_router("round-robin"), specs, request_ids=ids,
                           layout=ClusterLayout(2, "colocate", 0), pressure=handler)
    start, failed = handler._start, []  # type: ignore[attr-defined]  (a MigrateHandler)

    def starting(m, now):  # the source fails at the instant its migration started
        landing = start(m, now)
        if not failed:
            failed.append(m.src)
            for e in sim.fail(m.src, now):
                sim.loop.push(e)
        return landing

    handler._start = starting  # type: ignore[attr-defined]
    res = sim.run()
    assert failed == [0]
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    return _decisions([e.to_dict() for e in handler.events]), res.moves, sim.num_failovers


def test_a_source_that_dies_mid_migration_ends_the_move_the_same_way_in_both_shells():
    work = _workload()
    real, real_moves, real_failovers, pools, scheduler = _run_real(work)
    sim, sim_moves, sim_failovers = _run_sim(work, pools, scheduler)
    assert real == sim == [("r0", (0, 1), 11)]  # one migration: nothing is left to move to afterwards
    assert _moves(real_moves) == _moves(sim_moves) == EXPECTED
    assert real_failovers == sim_failovers == 2  # the moving request and the queued one
