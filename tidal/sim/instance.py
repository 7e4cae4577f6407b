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
from tidal.core.block_hash import span_block_names, trace_block_names
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import RequestUpdate, StepPlan, StepResult
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.sim.cost_model import CostModel
from tidal.workload import MOONCAKE_BLOCK_TOKENS, RequestSpec

SIM_TOKEN = 0  # the token every simulated sample produces (requests ignore EOS)


def spec_block_names(spec: RequestSpec, block_size: int, unique: bytes) -> list[bytes]:
    """The names a simulated request's full blocks get (:mod:`tidal.core.block_hash`): a
    conversation turn's from its content spans, prompt and answer (so its decode-filled blocks
    carry the names the next turn's prompt has there); a trace row's prompt from its hash ids;
    by ``unique`` elsewhere, so that the simulator's zeros share nothing."""
    if spec.prompt_segments is not None:
        spans = [(g.content, g.length) for g in (*spec.prompt_segments, *(spec.answer_segments or ()))]
        return span_block_names(spans, spec.prompt_len + spec.output_len, block_size, unique)
    return trace_block_names(spec.hash_ids or (), MOONCAKE_BLOCK_TOKENS, spec.prompt_len, block_size, unique)


def sim_names(rid: str, spec: RequestSpec, block_size: int) -> list[bytes]:
    """A simulated request's block names (:func:`spec_block_names`, keyed by its id where it has no content)."""
    return spec_block_names(spec, block_size, rid.encode())


def sim_request(rid: str, spec: RequestSpec, now: float, block_size: int, caching: bool,
                names: list[bytes] | None = None) -> Request:
    """A simulated request: no tokens of its own (zeros), greedy to its exact output length; with
    prefix caching, its blocks named ahead (:func:`sim_names`, or ``names`` when already made): the
    scheduler's ``extend_hashes`` names only blocks past those, so a hit, and a decode-filled block,
    has the name of its content."""
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    req = Request(rid, [0] * spec.prompt_len, params, arrival_time=now)
    if caching:
        req.block_hashes = list(names) if names is not None else sim_names(rid, spec, block_size)
    return req


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
                 timeline_interval: float = 0.0, role: str = "colocated", enable_caching: bool = False,
                 host_tier: bool = False):
        self.index = index
        self.role = role
        self.kv = KVCacheManager(num_blocks, block_size, num_host_blocks, enable_caching=enable_caching,
                                 host_tier=host_tier)
        self.policy = build_policy(config)
        self.scheduler = Scheduler(config, self.kv, self.policy, max_model_len)
        self.cost_model = cost_model
        self.max_model_len = max_model_len
        self.busy = False
        self.wake_pending = False
        self.plan: StepPlan | None = None
        self.last_plan: StepPlan | None = None  # the last step's plan (None: it was a run of decodes)
        self._shape: tuple[StepPlan | None, Any] = (None, None)  # last_plan and its shape, once asked
        self.end_event: Any = None  # the simulator's reusable step-end event
        self._crossing: tuple[list[tuple[str, int]], float] | None = None  # see run_decodes
        self._batch: tuple[Request, ...] | None = None  # a decode-only step in flight without a plan
        self._step_time = 0.0
        self.stall_s = 0.0  # seconds the next planned step waits (a blocking KV receive, tidal.sim.jitter)
        self.num_steps = 0
        self.busy_time = 0.0
        self.timeline = Timeline(timeline_interval)
        self.cache_delta: Any = None  # the names its pools gained and lost in its last step (when tracked)

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
        return self.scheduler.queued_block_demand()

    @property
    def hol_block_demand(self) -> int:
        return self.scheduler.hol_block_demand()

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

    @property
    def token_budget(self) -> int:
        return self.scheduler.last_caps.token_budget

    @property
    def queued_prefill_tokens(self) -> int:
        return self.scheduler.queued_prefill_tokens()

    @property
    def queued_prefill_position(self) -> float:
        return self.scheduler.queued_prefill_position()

    @property
    def num_free_host_blocks(self) -> int:
        return self.kv.host_pool.num_free

    @property
    def kv_reused_tokens(self) -> int:
        return self.scheduler.kv_reused_tokens

    def last_step_shape(self) -> tuple[int, float, float | None, int, float] | None:
        """The last step's prefill tokens, their chunks' mean prefix and sum of squares, its decode
        count and their mean context (a worker's step report carries the same), or None when it
        computed no prompt tokens."""
        from tidal.policies.profile_table import step_shape

        plan = self.last_plan
        if plan is None or not plan.composition.num_prefill_tokens:
            return None
        if self._shape[0] is not plan:  # the router reads it on every dispatch: computed once a step
            self._shape = (plan, step_shape(plan.chunks))
        return self._shape[1]

    @property
    def step_decode_context(self) -> float:
        """The mean context of the last step's decodes (0 when it was a run of decodes: the
        router reads it only beside a prefill)."""
        shape = self.last_step_shape()
        return shape[4] if shape is not None else 0.0

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
        if self.stall_s:
            dt, self.stall_s = dt + self.stall_s, 0.0
        self.plan, self._step_time, self.busy = plan, dt, True
        return dt, []

    def _sample(self, now: float, batch: int) -> None:
        sched, kv = self.scheduler, self.kv
        demand = (kv.pool.num_used + self.queued_block_demand) / kv.num_blocks if kv.num_blocks else 0.0
        self.timeline.sample(now, kv.usage, len(sched.waiting) + len(sched.swapped), len(sched.running), batch,
                             demand)

    def run_decodes(self, now: float, before: float, on_step: Callable[[list[RequestUpdate], float], None],
                    on_run: Callable[[list[str], list[float]], None] | None = None) -> float:
        """Run whole steps at once, begin and end, while each is one the scheduler vouches is only
        decodes (:meth:`Scheduler.decode_positions`), the cost model can time it without a plan,
        and it ends before ``before``; ``on_step(updates, end)`` after each. Returns when the next
        step begins (``now`` if none ran). The state afterwards is exactly that of ``begin_step``
        and ``end_step`` at those times.

        With ``on_run``, runs of such steps that finish nobody and take no timeline sample go
        without per-step updates (:meth:`_run_quiet`): ``on_run(request ids, end of each step)``
        after each run; each request took one token a step.

        The decode-only step that would end at or after ``before`` is kept for
        :meth:`begin_crossing`, which begins it as an event at the returned time."""
        self._crossing = None
        timer = getattr(self.cost_model, "decode_step_time", None)  # times a decode-only step without a plan
        if timer is None or self.role != "colocated":
            return now
        sched, tl = self.scheduler, self.timeline
        quiet = on_run is not None and hasattr(self.cost_model, "decode_step_time_at")
        positions = sched.decode_positions()
        while positions is not None:
            room = sched.decode_run_room(SIM_TOKEN) if quiet else 0
            if room > 1:
                start = now
                now = self._run_quiet(positions, room, now, before, on_run)
                if now != start:
                    positions = sched.decode_positions()
                    continue
            dt = timer(positions)
            if not now + dt < before:
                self._crossing = (positions, dt)
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

    def _run_quiet(self, positions: list[tuple[str, int]], room: int, now: float, before: float,
                   on_run: Callable[[list[str], list[float]], None]) -> float:
        """Up to ``room`` (:meth:`Scheduler.decode_run_room`) steps of the decodes at ``positions``,
        each as ``run_decodes`` would run it, stopping before one that would end at or after
        ``before``, begin when a timeline sample is due, or find too few free blocks (those go
        step by step). A request needs a block at the step whose token opens one, and gets it in
        running order among the others that do, as ``allocate_one_more`` gives them."""
        kv, tl, timer = self.scheduler.kv, self.timeline, self.cost_model.decode_step_time_at
        bs = kv.block_size
        ps = [p for _, p in positions]
        opens: dict[int, list[tuple[str, int]]] = {}  # step mod bs -> (request, position) whose token opens a block
        for rid, p in positions:
            opens.setdefault(-p % bs, []).append((rid, p))
        ends: list[float] = []
        for j in range(room):
            if tl.due(now):
                break
            dt = timer(ps, j)
            if not now + dt < before:
                break
            grow = opens.get(j % bs)
            if grow:
                held = [(rid, p + j) for rid, p in grow]
                if kv.blocks_for_one_more(held) > (kv.num_plain_free_blocks if kv.host_tier else kv.num_free_blocks):
                    break  # (with a host tier, an eviction stores a block: a planned step)
                kv.allocate_one_more(held)
            self._step_time = dt
            self.num_steps += 1
            self.busy_time += dt
            now += dt
            ends.append(now)
        if ends:
            self.scheduler.end_decode_run(len(ends), SIM_TOKEN, now)
            on_run([rid for rid, _ in positions], ends)
        return now

    def begin_crossing(self, now: float) -> float | None:
        """Begin, at ``now`` (where :meth:`run_decodes` returned), the decode-only step it stopped
        before, as ``begin_step`` would but without a plan (``Scheduler.begin_decodes``): its
        duration, or None when there is none. :meth:`end_step` ends it with ``end_decodes``. What
        fires before that end only queues requests here (the simulator's fast path), which
        ``end_decodes`` does not read."""
        crossing, self._crossing = self._crossing, None
        if crossing is None:
            return None
        positions, dt = crossing
        batch = self.scheduler.begin_decodes(positions)
        if self.timeline.due(now):
            self._sample(now, len(batch))
        self._batch, self._step_time, self.busy = batch, dt, True
        return dt

    def end_step(self, now: float) -> list[RequestUpdate]:
        batch, plan = self._batch, self.plan
        assert batch is not None or plan is not None, "end_step without a step in flight"
        self._batch, self.plan, self.busy = None, None, False
        self.last_plan = plan
        self.num_steps += 1
        self.busy_time += self._step_time
        if batch is not None:  # begun by begin_crossing
            return self.scheduler.end_decodes(batch, SIM_TOKEN, now)
        sampled = {c.request_id: SIM_TOKEN for c in plan.chunks if c.sample}
        result = StepResult(plan.step_id, sampled, step_time_s=self._step_time, composition=plan.composition)
        return self.scheduler.update(plan, result, now)

    def stats(self) -> dict:
        sched = self.scheduler
        return {"index": self.index, "role": self.role, "num_blocks": self.kv.num_blocks, "block_size": self.kv.block_size,
                "steps": self.num_steps, "busy_time_s": self.busy_time,
                "num_preemptions": sched.num_preemptions, "num_swap_preemptions": sched.num_swap_preemptions,
                "num_swap_fallbacks": sched.num_swap_fallbacks, "policy_state": self.policy.state().to_dict(),
                "prefix_queries": sched.prefix_queries, "prefix_hits": sched.prefix_hits,
                "prefix_host_hits": sched.prefix_host_hits, "num_host_blocks": self.kv.host_pool.num_blocks}
