"""How ``make test`` shares the tests between its two xdist workers (``--dist loadgroup``).

Every test module is one unit of work, run whole on one worker: its module-scoped clusters,
servers, reference outputs and Ray are built once, not once on each worker that gets one of its
tests (``--dist load`` split modules between the workers). The modules of ``tests/server`` that use
the session's servers (``server_procs``: a main and a small server, and the multi-instance ones
of test_cluster_api.py) are one unit, so those servers load on one worker only; so are the three
modules that load transformers' model of the checkpoint (``hf_smol``, ~5 s of CPU each time).

Units go out longest first (longest-processing-time scheduling): each worker takes the next unit
when it is done, so the last ones to start are short and the two workers end together. The order
is a ranking of the units by their CPU time in a full run on the 2-core CI machine; a module not
named keeps its collection order after them.

pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks and renames the tests, which pytest 9.2
ignores (the node id is no longer ``_nodeid``); this scheduler groups by the node id instead, on
the controller, and each worker sorts its collection alike (``heaviest_first``).
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# modules that run a server (or cluster) of their own are units of their own, not in "servers"
OWN_SERVER_MODULES = ("tests/server/test_dashboard.py", "tests/server/test_soak.py", "tests/server/test_chaos.py")
HF_SMOL_MODULES = ("tests/bench/test_offline_bench.py", "tests/engine/test_loader.py", "tests/engine/test_parity.py")
HEAVY_FIRST = (
    "servers",
    "tests/runtime/test_ray_nodes.py",
    "tests/engine/test_kernel_build.py",
    "tests/runtime/test_kunserve_runtime.py",
    "tests/server/test_dashboard.py",
    "tests/server/test_chaos.py",
    "tests/runtime/test_faults.py",
    "hf_smol",
    "tests/runtime/test_migrate_runtime.py",
    "tests/runtime/test_kunserve_groups.py",
    "tests/runtime/test_same_decisions.py",
    "tests/runtime/test_cluster.py",
    "tests/bench/test_kv_transfer_bench.py",
    "tests/experiments/test_reproduce.py",
    "tests/engine/test_disk_cache.py",
    "tests/server/test_soak.py",
    "tests/runtime/test_same_split_decisions.py",
    "tests/runtime/test_split_runtime.py",
    "tests/engine/test_profiler.py",
    "tests/experiments/test_server_proc.py",
    "tests/engine/test_quant.py",
    "tests/common/test_progress_and_flags.py",
    "tests/test_cli.py",
    "tests/engine/test_engine.py",
    "tests/engine/test_compiled.py",
    "tests/sim/test_sim_cli.py",
    "tests/runtime/test_kv_transfer.py",
    "tests/workload/test_workloads.py",
)
_RANK = {name: n for n, name in enumerate(HEAVY_FIRST)}


def unit_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/server/") and module not in OWN_SERVER_MODULES:
        return "servers"
    return "hf_smol" if module in HF_SMOL_MODULES else module


def heaviest_first(items: list) -> None:
    """Sort a worker's collection by unit rank; a stable sort, so each unit keeps its own order."""
    items.sort(key=lambda item: _RANK.get(unit_of(item.nodeid), len(_RANK)))


class UnitScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` with ``unit_of`` as the scope; with ``--no-loadscope-reorder`` the
    units go out in the workers' (sorted) collection order."""

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _reschedule(self, node) -> None:
        """The next unit only when the node is on its unit's last test (xdist's default is its last
        three, so a long unit's last tests could hold a second unit back on a busy worker). A worker
        runs a test once it knows the next one, so the node must get more before its queue is empty."""
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) <= 1:
            self._assign_work_unit(node)
