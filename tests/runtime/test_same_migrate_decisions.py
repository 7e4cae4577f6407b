"""The real runtime (``--kv-pressure migrate`` on 2 worker processes) and the simulator make the
same migration decisions, and each migration goes the same way through the one move machine.

Round-robin sends two long prompts (161 tokens, 11 blocks of 16 with every token they will
generate) to instance 0 and a short one (one block) to instance 1; each pool holds 12 blocks. On
instance 0 the first long request runs and the second waits for memory from the start (its chunk
never fits the one block left): instance 0 is throttled while the first one prefills and decodes.
A request moves only once it decodes (the worker's ``is_movable``: past its prefill, a token
sampled), and instance 1, holding one block, always has room for 11: so, whatever the instant,
both shells must migrate exactly the first long request, 0 -> 1, asking 11 blocks, once, and it
must land (``start, reserved 1, landed 1, done``). The simulator runs the same requests on
instances with the real workers' pools and scheduler configuration.

What this compares: every ``migrate`` decision the pure ``MigrationController`` logged (request,
source, destination, blocks) and every move record (request, kind, source, destination, outcome,
events in order). What it does not: when the migration happens (the runtime's monitor hears a
worker after its steps, at real times; the simulator's clock is modelled), so neither the decision's
time nor how many tokens the request had then (both shells count a decoding request's blocks the
same way, ``handoff_blocks`` of its tokens; the lengths keep that at 11 from its first token to its
last).
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
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig

ENGINE = dict(dtype="float32", num_blocks_override=12, max_num_batched_tokens=64)
LONG, SHORT = (161, 162), (4, 5)  # prompt lengths: 161 + 14 tokens + the next slot = 11 blocks of 16


def _workload() -> list[tuple[list[int], int]]:
    (a, c), (b,) = random_work(3, 2, LONG, (14, 15)), random_work(4, 1, SHORT, (4, 5))
    return [a, b, c]  # round-robin: 0, 1, 0


def _moves(records) -> list[tuple]:
    return sorted((m.request_id, m.kind, m.src, m.dst, m.outcome, m.events) for m in records)


def _decisions(events) -> list[tuple]:
    return [(e["request_id"], tuple(e["instances"]), e["blocks"]) for e in events if e["kind"] == "migrate"]


def _run_real(work):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), router="round-robin", threads_per_instance=1,
                      layers_per_chunk=8, kv_pressure="migrate")))
    before = shm_segments()
    llm.start()
    pids = [h.pid for h in llm.handles]
    try:
        pools = pools_of(llm)
        assert serve_burst(llm, work) == [m for _, m in work]
        deadline = time.monotonic() + 30  # the last reports: every block free again
        while time.monotonic() < deadline and llm.stats["num_free_kv_blocks"] < 24:
            time.sleep(0.1)
        kp = llm.stats["cluster"]["kv_pressure"]
        assert kp["moving"] == 0 and all(not r.reserved for r in llm.monitor.instances)
        return _decisions(kp["events"]), list(llm.move_records), pools, llm.config.scheduler
    finally:
        llm.shutdown()
        wait_gone(pids)  # every worker stopped, by its own id
        assert not leaked_segments(before)


def _sim_pressure(arch, hw):
    """The simulator's ``--kv-pressure migrate`` with the runtime's chunks (8 layers) over shared memory."""
    from tidal.runtime.pressure import model_memory
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.links import get_link
    from tidal.sim.pipeline import chunk_cost_for
    from tidal.sim.pressure import PressureConfig, build_pressure

    cost = AnalyticCostModel(arch, hw, dtype_bytes=4)
    return build_pressure(PressureConfig("migrate", get_link("shm", hw), model_memory(arch, 4), arch.hidden_size * 4,
                                         chunk_cost_for(cost, 64), layers_per_chunk=8))


def _run_sim(work, pools, scheduler):
    from tidal.cluster.router import build_router
    from tidal.sim.simulator import ClusterSimulator

    instances, arch, hw = sim_instances(pools, scheduler)
    handler = _sim_pressure(arch, hw)
    specs, ids = request_specs(work)
    res = ClusterSimulator(instances, build_router("round-robin"), specs, request_ids=ids,
                           layout=ClusterLayout(2, "colocate", 0), pressure=handler).run()
    assert all(r.success for r in res.records) and [r.output_tokens for r in res.records] == [m for _, m in work]
    return _decisions([e.to_dict() for e in handler.events]), res.moves


def test_runtime_and_simulator_make_the_same_migrations():
    work = _workload()
    real, real_moves, pools, scheduler = _run_real(work)
    sim, sim_moves = _run_sim(work, pools, scheduler)
    assert pools == {0: (12, 16), 1: (12, 16)}

    # the same decisions: the first long request, from the throttled instance to the spare one, whole
    assert real == sim == [("r0", (0, 1), 11)]
    # the same move, event for event, in both shells
    assert _moves(real_moves) == _moves(sim_moves) == [
        ("r0", "migrate", 0, 1, "done", ("start", "reserved 1", "landed 1", "done"))]
