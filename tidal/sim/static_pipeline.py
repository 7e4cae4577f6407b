"""vLLM with pipeline parallelism (KunServe's "vLLM (default + PP)" baseline, Sec. 5.1) in the
simulator: every ``size`` consecutive instances run as one pipeline from the start.

"pipelined parallelism (PP) further frees half of the parameters on each instance and leverages
PP to execute requests across two instances. This setup frees up more memory for KVCache, but it
also introduces pipelined execution overhead. By default, vLLM uses recomputation to cope with
memory throttling." So each group is a :class:`tidal.sim.pipeline.GroupInstance` formed at time 0
(stage ``j`` of ``k`` holds layers ``[j L // k, (j+1) L // k)``, its pool grown by the weights it
does not hold), running vLLM's token-count microbatches (its pipeline cannot look ahead, Sec. 5.2)
and the engine's own preemption; it never restores. Instances left over (``n`` not a multiple of
``size``) run alone. Pure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.cluster.pressure import stage_layers
from tidal.sim.instance import SimInstance
from tidal.sim.pipeline import GroupInstance
from tidal.sim.pressure import PressureConfig, PressureHandler

if TYPE_CHECKING:
    from tidal.sim.simulator import ClusterSimulator


class StaticPipelineHandler(PressureHandler):
    mode = "pp"

    def __init__(self, cfg: PressureConfig, size: int):
        if size < 2:
            raise ValueError(f"a pipeline needs at least 2 stages, got {size}")
        if size > cfg.model.num_layers:
            raise ValueError(f"cannot split {cfg.model.num_layers} layers into {size} stages")
        super().__init__(cfg)
        self.size = size
        self.groups: list[GroupInstance] = []

    def attach(self, sim: ClusterSimulator) -> None:
        super().attach(sim)
        self.base: list[SimInstance] = list(sim.instances)
        self.execs: list[SimInstance] = list(sim.instances)
        n, k = len(self.base), self.size
        if n < k:
            raise ValueError(f"pipeline parallel {k} needs at least {k} instances, got {n}")
        for start in range(0, n - n % k, k):
            members = self.base[start:start + k]
            layers = dict(zip((m.index for m in members), stage_layers(self.cfg.model.num_layers, k), strict=True))
            grp = GroupInstance(members, layers, self.cfg, members[0].scheduler.config, members[0].cost_model,
                                self.cfg.overhead_s, 0.0)
            self.groups.append(grp)
            for m in members:
                self.execs[m.index] = grp
                sim.instances[m.index] = grp if m.index == grp.index else m
        sim.monitor.on_groups([g.group for g in self.groups])
        for inst in sim.instances:
            sim.monitor.on_status(inst, 0.0)  # type: ignore[arg-type]  (live status)

    def can_step(self, inst: SimInstance) -> bool:
        return self.execs[inst.index] is inst

    def finish(self, now: float) -> None:
        assert self.sim is not None
        self.sim.instances[:] = self.base

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["groups"] = [{**g.stats(), "ended_s": None} for g in self.groups]
        return out


__all__ = ["StaticPipelineHandler"]
