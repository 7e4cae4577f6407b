"""One simulated instance: the engine's own Scheduler, KVCacheManager and policy objects, with
the model runner replaced by a cost model. Pure: time is an argument.

An instance is idle or executing one step. ``begin_step(now)`` asks the real scheduler for a
plan and the cost model for its duration; ``end_step(now)`` applies a result (each sampled
request gets one token) through the real ``Scheduler.update``.

An instance has a role (``colocated``, ``prefill`` or ``decode``, from the cluster layout) and
is its own live status for the global monitor (it has every field of
:class:`tidal.cluster.monitor.InstanceStatus`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import RequestUpdate, StepPlan, StepResult
from tidal.core.request import Request
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.sim.cost_model import CostModel

SIM_TOKEN = 0  # the token every simulated sample produces (requests ignore EOS)


@dataclass
class Timeline:
    """Per-instance samples over simulated time (at most one per ``interval`` seconds)."""

    interval: float = 0.0
    t: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=list)
    kv_demand: list[float] = field(default_factory=list)  # (used + the queue's need) / pool: Llumnix's count

    def due(self, now: float) -> bool:
        return not self.t or now - self.t[-1] >= self.interval

    def sample(self, now: float, kv_usage: float, waiting: int, running: int, batch: int,
               kv_demand: float | None = None) -> None:
        self.t.append(now)
        self.kv_usage.append(kv_usage)
        self.waiting.append(waiting)
        self.running.append(running)
        self.batch_size.append(batch)
        self.kv_demand.append(kv_usage if kv_demand is None else kv_demand)

    def to_dict(self) -> dict:
        return {"t": self.t, "kv_usage": self.kv_usage, "waiting": self.waiting, "running": self.running,
                "batch_size": self.batch_size, "kv_demand": self.kv_demand}


class SimInstance:
    def __init__(self, index: int, config: SchedulerConfig, num_blocks: int, block_size: int,
                 cost_model: CostModel, max_model_len: int | None, num_host_blocks: int = 0,
                 timeline_interval: float = 0.0, role: str = "colocated"):
        self.index = index
        self.role = role
        self.kv = KVCacheManager(num_blocks, block_size, num_host_blocks)
        self.policy = build_policy(config)
        self.scheduler = Scheduler(config, self.kv, self.policy, max_model_len)
        self.cost_model = cost_model
        self.max_model_len = max_model_len
        self.busy = False
        self.wake_pending = False
        self.plan: StepPlan | None = None
        self.end_event: Any = None  # the simulator's reusable step-end event
        self._step_time = 0.0
        self.num_steps = 0
        self.busy_time = 0.0
        self.timeline = Timeline(timeline_interval)

    # ---- what a router and the monitor see (InstanceLoad, InstanceStatus) ----
    @property
    def num_outstanding(self) -> int:
        return len(self.scheduler.requests)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def queued_block_demand(self) -> int:
        bs = self.kv.block_size
        return sum(-(-(r.num_tokens + 1) // bs) for r in self.scheduler.waiting)

    @property
    def hol_block_demand(self) -> int:
        """Blocks the head of the queue needs: the first swapped request (it comes back first), else the first waiting."""
        s = self.scheduler
        if s.swapped:
            return self.kv.num_host_blocks_of(s.swapped[0].request_id)
        return -(-(s.waiting[0].num_tokens + 1) // self.kv.block_size) if s.waiting else 0

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def step_time_s(self) -> float | None:
        return self._step_time if self.num_steps else None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- requests and steps ----
    def add_request(self, req: Request) -> None:
        """Raises :class:`tidal.core.scheduler.RequestRejected` if it can never run here."""
        self.scheduler.add_request(req)

    def begin_step(self, now: float) -> tuple[float | None, list[RequestUpdate]]:
        """Plan a step at ``now``: (its duration, or None when there is nothing to run; updates
        the scheduler decided while planning, e.g. a request that outgrew the pool)."""
        plan = self.scheduler.schedule(now)
        if self.timeline.due(now):  # checked before gathering the values: this runs every step
            self._sample(now, len(plan.chunks))
        if not plan.chunks:
            return None, self.scheduler.update(plan, StepResult(plan.step_id), now)
        dt = self.cost_model.step_time(plan)
        self.plan, self._step_time, self.busy = plan, dt, True
        return dt, []

    def _sample(self, now: float, batch: int) -> None:
        sched, kv = self.scheduler, self.kv
        demand = (kv.pool.num_used + self.queued_block_demand) / kv.num_blocks if kv.num_blocks else 0.0
        self.timeline.sample(now, kv.usage, len(sched.waiting) + len(sched.swapped), len(sched.running), batch,
                             demand)

    def run_decodes(self, now: float, before: float,
                    on_step: Callable[[list[RequestUpdate], float], None]) -> float:
        """Run whole steps at once, begin and end, while each is one the scheduler vouches is only
        decodes (:meth:`Scheduler.decode_positions`), the cost model can time it without a plan,
        and it ends before ``before``; ``on_step(updates, end)`` after each. Returns when the next
        step begins (``now`` if none ran). The state afterwards is exactly that of ``begin_step``
        and ``end_step`` at those times."""
        timer = getattr(self.cost_model, "decode_step_time", None)  # times a decode-only step without a plan
        if timer is None or self.role != "colocated":
            return now
        sched, tl = self.scheduler, self.timeline
        positions = sched.decode_positions()
        while positions is not None:
            dt = timer(positions)
            if not now + dt < before:
                break
            batch = sched.begin_decodes(positions)
            if tl.due(now):
                self._sample(now, len(batch))
            self._step_time = dt
            self.num_steps += 1
            self.busy_time += dt
            now += dt
            on_step(sched.end_decodes(batch, SIM_TOKEN, now), now)
            positions = sched.decode_positions(positions)
        return now

    def end_step(self, now: float) -> list[RequestUpdate]:
        plan = self.plan
        assert plan is not None, "end_step without a step in flight"
        sampled = {c.request_id: SIM_TOKEN for c in plan.chunks if c.sample}
        result = StepResult(plan.step_id, sampled, step_time_s=self._step_time, composition=plan.composition)
        self.plan, self.busy = None, False
        self.num_steps += 1
        self.busy_time += self._step_time
        return self.scheduler.update(plan, result, now)

    def stats(self) -> dict:
        return {"index": self.index, "role": self.role, "num_blocks": self.kv.num_blocks, "block_size": self.kv.block_size,
                "steps": self.num_steps, "busy_time_s": self.busy_time,
                "num_preemptions": self.scheduler.num_preemptions, "policy_state": self.policy.state().to_dict()}
