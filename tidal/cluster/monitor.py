"""The global monitor: what the cluster knows of each instance, fed by events (pure, time is an argument).

BucketServe's global monitor (Sec. III) tracks every instance's load so the dispatcher can pick
where a request goes and, in disaggregated mode, which decode instance takes a prefilled
request. Here each instance reports an :class:`InstanceStatus` after its steps (KV blocks, running
and waiting requests, the queued KV demand, its last step time); the front end adds what it knows
sooner than any report: requests dispatched and not yet finished, arrivals, failures and restarts,
and hand-offs that wait for room on a decode instance. The simulator and the real runtime feed
the same object, so the same dispatch decisions come out of both.

A status is an :class:`InstanceStatus` (a worker's report, as of its last step) or any object
with its fields: the simulator hands in its live instances, so its front end sees each instance
as it is now (a report delay of zero; the runtime's view lags by up to one step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from tidal.cluster.cache_view import CacheView
from tidal.cluster.step_fit import StepFit
from tidal.core.admission import InstanceLoad as AdmissionLoad
from tidal.core.block_pool import CacheDelta

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """One instance's own report (sent by its worker after a step, or when idle)."""

    index: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_running: int = 0
    num_waiting: int = 0
    queued_block_demand: int = 0  # KV blocks its waiting requests need to start
    step_time_s: float | None = None  # its last step's measured time
    num_preemptions: int = 0
    hol_block_demand: int = 0  # KV blocks the head of its queue (first swapped, else first waiting) needs
    # what that step computed (a profile table's key: DynaServe Alg. 2's plen, ctx, dnum)
    step_prefill_tokens: int = 0
    step_decode_count: int = 0
    step_decode_context: float = 0.0
    step_prefill_prefix: float = 0.0  # the prefill chunks' token-weighted mean cached prefix
    step_prefill_sq: float | None = None  # the sum of their squared lengths (None: one chunk, p^2)
    # KV moved since its previous step report: seconds and chunks imported (landed here) and exported
    import_s: float = 0.0
    export_s: float = 0.0
    chunks_in: int = 0
    chunks_out: int = 0
    batching: str = ""  # the batching policy it runs (with --prefill-batching the roles differ)
    # the caps its policy set for that step, and the policy's state (PolicyState.to_dict()), for /admin/state
    batch_size_cap: int | None = None
    token_budget: int | None = None
    policy: dict[str, Any] | None = None
    # prefix caching since the worker started (tokens): prompt tokens looked up, found (device or host tier),
    # found in the host tier; and the cached blocks nobody holds (free space that may yet be hit)
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_host_hits: int = 0
    num_cached_blocks: int = 0
    # prompt tokens waiting for their prefill (queued requests' and the rest of half-done prefills), and
    # the block names its pools gained and lost since its last report (only when the front end asks)
    queued_prefill_tokens: int = 0
    queued_prefill_position: float = 0.0  # their mean KV position (the attention over long prompts' prefixes)
    cache_delta: CacheDelta | None = None
    num_swap_preemptions: int = 0  # of num_preemptions, those that swapped out (the rest recomputed)
    num_swap_fallbacks: int = 0  # preemptions that wanted to swap and recomputed (the host pool was full)
    num_free_host_blocks: int = 0  # room in its host pool (swap; --kv-pressure auto prices a swap with it)
    kv_reused_tokens: int = 0  # KV tokens imported here (hand-offs, migrations) that its prefix cache held already


_STATUS_FIELDS = tuple(f.name for f in fields(InstanceStatus))
_STATUS_DEFAULTS = {f.name: f.default for f in fields(InstanceStatus)}  # a live status may lack the newer ones


@dataclass
class InstanceRecord:
    """The monitor's view of one instance; fills :class:`tidal.cluster.router.InstanceLoad`."""

    index: int
    role: str
    status: InstanceStatus
    alive: bool = True
    outstanding: set[str] = field(default_factory=set)  # dispatched here, not finished (front end's count)
    arrivals: deque = field(default_factory=deque)  # times of recent dispatches (for the arrival rate)
    step_time_ema_s: float | None = None
    dispatched: int = 0  # requests ever dispatched here
    handoffs_in: int = 0  # hand-offs that landed here
    reserved: dict[str, int] = field(default_factory=dict)  # hand-offs on their way here: request -> blocks
    failures: int = 0
    restarts: int = 0
    last_report: float | None = None
    group: tuple[int, ...] = ()  # KunServe pipeline group it belongs to, stage order (empty: none)
    cache: CacheView = field(default_factory=CacheView)  # the block names it holds (tidal.cluster.cache_view)
    sent: deque = field(default_factory=deque)  # (request id, prompt tokens to compute, from) of recent dispatches
    steps: StepFit | None = None  # its prefill steps' times, when the monitor learns them (cache-aware routing)

    @property
    def routable(self) -> bool:
        """Takes new requests: alive, and not a later stage of a pipeline group (a group is
        dispatched to through its first stage, which reports the group's pool)."""
        return self.alive and (not self.group or self.group[0] == self.index)

    # ---- InstanceLoad ----
    @property
    def num_outstanding(self) -> int:
        return len(self.outstanding)

    def admission_load(self, cap: int) -> AdmissionLoad:
        """Its load for the queue bound: what its last report left waiting, and what the front end
        sent it since (dispatched, not finished, not in the report) as not yet tried."""
        st = self.status
        untried = max(0, len(self.outstanding) - st.num_running - st.num_waiting)
        return AdmissionLoad(cap, st.num_running, st.num_waiting, untried)

    @property
    def num_queued(self) -> int:
        """Requests waiting here for their prefill: the last report's, and those sent since."""
        a = self.admission_load(0)
        return a.declined + a.untried

    @property
    def num_running(self) -> int:
        return self.status.num_running

    @property
    def recent_step_s(self) -> float | None:
        """Its step time: the moving average of its reports, else its last step's."""
        return self.step_time_ema_s if self.step_time_ema_s is not None else getattr(self.status, "step_time_s", None)

    @property
    def token_budget(self) -> int | None:
        return getattr(self.status, "token_budget", None)

    def _sent_since(self) -> list[tuple[int, int]]:
        """(tokens to compute, from) of the requests sent here since its last report that are still
        outstanding (the most recent dispatches)."""
        untried = self.admission_load(0).untried
        out: list[tuple[int, int]] = []
        if untried:
            for rid, tokens, start in reversed(self.sent):
                if rid in self.outstanding:
                    out.append((tokens, start))
                    untried -= 1
                    if not untried:
                        break
        return out

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting here for their prefill: the last report's, and the uncached ones of
        the requests sent since (the most recent dispatches still outstanding)."""
        return getattr(self.status, "queued_prefill_tokens", 0) + sum(n for n, _ in self._sent_since())

    @property
    def queued_prefill_position(self) -> float:
        """The mean KV position of :attr:`queued_prefill_tokens` (the report's, and each request sent
        since from its cached prefix on)."""
        q = getattr(self.status, "queued_prefill_tokens", 0)
        tokens, total = q, q * getattr(self.status, "queued_prefill_position", 0.0)
        for n, start in self._sent_since():
            tokens, total = tokens + n, total + n * (start + n / 2)
        return total / tokens if tokens > 0 else 0.0

    @property
    def decode_context(self) -> float:
        """The mean context of its decodes in its last step."""
        return getattr(self.status, "step_decode_context", 0.0) or 0.0

    @property
    def step_fit(self) -> tuple[float, ...] | None:
        """The regression of its prefill steps' times on their shape (None until it has enough)."""
        return self.steps.fit() if self.steps is not None else None

    def cached_tokens(self, names: tuple[bytes, ...] | list[bytes]) -> int:
        """Leading prompt tokens of a request (its blocks' ``names``) that this instance holds cached."""
        return self.cache.prefix(names) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.status.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.status.num_blocks

    @property
    def block_size(self) -> int:
        return self.status.block_size

    @property
    def queued_block_demand(self) -> int:
        return self.status.queued_block_demand

    @property
    def handoff_room(self) -> int:
        """KV blocks a new hand-off could take: free, less the queued demand and the hand-offs on their way."""
        return self.status.num_free_blocks - self.status.queued_block_demand - sum(self.reserved.values())

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.status.num_free_blocks / self.status.num_blocks if self.status.num_blocks else 0.0


class GlobalMonitor:
    """Per-instance load, arrival rate and recent step time; pending hand-offs.

    ``window_s`` is the window of the arrival rate; ``ema`` the weight of a new step time.
    """

    def __init__(self, statuses: list[InstanceStatus], roles: list[str] | None = None, window_s: float = 10.0,
                 ema: float = 0.2, approx_cache: bool = False, learn_steps: bool = False):
        roles = roles or ["colocated"] * len(statuses)
        if len(roles) != len(statuses) or not statuses:
            raise ValueError("the monitor needs one role per instance, and at least one instance")
        bad = [r for r in roles if r not in ROLES]
        if bad:
            raise ValueError(f"unknown instance role {bad[0]!r}; roles: {', '.join(ROLES)}")
        self.instances = [InstanceRecord(s.index, r, s) for s, r in zip(statuses, roles, strict=True)]
        if approx_cache:  # no reports of names: each instance's view is what was routed there, pool-sized
            for rec in self.instances:
                rec.cache = CacheView(approx_capacity=max(1, rec.status.num_blocks))
        if learn_steps:  # the cache-aware router prices prefill work with each instance's own step times
            for rec in self.instances:
                rec.steps = StepFit()
        self.window_s, self.ema = window_s, ema
        self.pending_handoffs: dict[str, int] = {}  # request id -> KV blocks it needs on a decode instance
        self.num_dispatched = 0
        self.num_handoffs = 0

    # ---------------------------------------------------------------- events in
    def on_status(self, status: InstanceStatus, now: float) -> None:
        rec = self.instances[status.index]
        rec.status, rec.last_report = status, now
        delta = getattr(status, "cache_delta", None)
        if delta is not None:
            rec.cache.apply(delta)
        if status.step_time_s is not None and status.step_time_s > 0:
            t = status.step_time_s
            rec.step_time_ema_s = t if rec.step_time_ema_s is None else (1 - self.ema) * rec.step_time_ema_s + self.ema * t
            p = getattr(status, "step_prefill_tokens", 0)
            if p:
                self.on_step(status.index, p, status.step_prefill_prefix, status.step_prefill_sq,
                             status.step_decode_count, status.step_decode_context, t)

    def on_step(self, index: int, prefill_tokens: int, prefix: float, sq: float | None, decode_count: int,
                decode_context: float, time_s: float) -> None:
        """A step's shape and time, from a front end whose statuses are live (the simulator's), as a
        report carries them in the runtime."""
        rec = self.instances[index]
        if prefill_tokens and rec.steps is not None and time_s > 0:
            rec.steps.record(prefill_tokens, prefix, sq, decode_count, decode_context, time_s)

    def on_dispatch(self, index: int, request_id: str, now: float, prompt_tokens: int = 0,
                    names: tuple[bytes, ...] = (), start: int = 0) -> None:
        """``request_id`` was sent to ``index``; ``prompt_tokens``: those it must compute there (its
        uncached prompt, from token ``start``), ``names``: its prompt's blocks (an approximate cache
        view takes them)."""
        rec = self.instances[index]
        rec.sent.append((request_id, prompt_tokens, start))
        while len(rec.sent) > 4 * len(rec.outstanding) + 64:
            rec.sent.popleft()
        if names:
            rec.cache.note_routed(names)
        rec.outstanding.add(request_id)
        rec.dispatched += 1
        rec.arrivals.append(now)
        self.num_dispatched += 1
        self._trim(rec, now)

    def on_finish(self, index: int, request_id: str) -> None:
        self.instances[index].outstanding.discard(request_id)

    def on_handoff_wait(self, request_id: str, blocks: int) -> None:
        self.pending_handoffs[request_id] = blocks

    def on_handoff_cancel(self, request_id: str) -> None:
        """A hand-off that waited for room will not happen (the request stays, finished or is re-run)."""
        self.pending_handoffs.pop(request_id, None)

    def on_handoff_start(self, request_id: str, dst: int, blocks: int) -> None:
        """A hand-off to ``dst`` began: its blocks are reserved there until it lands or fails."""
        self.pending_handoffs.pop(request_id, None)
        self.instances[dst].reserved[request_id] = blocks

    def on_reservation_end(self, request_id: str, dst: int) -> None:
        """A move into ``dst`` ended without a hand-off landing there: its blocks are free again."""
        self.instances[dst].reserved.pop(request_id, None)

    def on_handoff(self, request_id: str, src: int, dst: int, ok: bool = True) -> None:
        """The hand-off of ``request_id`` from prefill instance ``src`` to decode instance ``dst``
        landed (``ok``) or was refused (then the request stays on ``src``)."""
        self.instances[dst].reserved.pop(request_id, None)
        if ok:
            self.instances[src].outstanding.discard(request_id)
            self.instances[dst].outstanding.add(request_id)
            self.instances[dst].handoffs_in += 1
            self.num_handoffs += 1

    def on_move(self, request_id: str, src: int, dst: int) -> None:
        """``request_id`` now runs on ``dst`` (a migration, a group forming or splitting)."""
        self.instances[src].outstanding.discard(request_id)
        self.instances[dst].outstanding.add(request_id)

    def on_groups(self, groups: list[tuple[int, ...]] | tuple[tuple[int, ...], ...]) -> None:
        """The pipeline groups now executing (KunServe Sec. 4.1), each in stage order; an
        instance in none, or in a group of one, runs alone."""
        for rec in self.instances:
            rec.group = ()
        for g in groups:
            if len(g) > 1:
                for i in g:
                    self.instances[i].group = tuple(g)

    def on_failure(self, index: int) -> set[str]:
        """Instance ``index`` died: it is skipped until it restarts; returns the requests it held."""
        rec = self.instances[index]
        rec.alive = False
        rec.failures += 1
        rec.reserved.clear()
        rec.cache.clear()
        lost, rec.outstanding = rec.outstanding, set()
        return lost

    def on_restart(self, status: InstanceStatus, now: float) -> None:
        rec = self.instances[status.index]
        rec.alive, rec.restarts = True, rec.restarts + 1
        rec.cache.clear()
        rec.step_time_ema_s = None
        self.on_status(status, now)

    # ---------------------------------------------------------------- questions
    def alive(self, role: str | None = None) -> list[InstanceRecord]:
        """Live instances (of ``role``; colocated instances count for every role)."""
        return [r for r in self.instances if r.alive and (role is None or r.role in (role, "colocated"))]

    def routable(self, role: str | None = None) -> list[InstanceRecord]:
        """Live instances that take new requests: :meth:`alive`, less the later stages of pipeline groups."""
        return [r for r in self.alive(role) if r.routable]

    def arrival_rate(self, index: int, now: float) -> float:
        rec = self.instances[index]
        self._trim(rec, now)
        return len(rec.arrivals) / self.window_s

    def _trim(self, rec: InstanceRecord, now: float) -> None:
        while rec.arrivals and rec.arrivals[0] < now - self.window_s:
            rec.arrivals.popleft()

    def snapshot(self, now: float) -> dict[str, Any]:
        """JSON-able state for ``/admin/state`` and the load client."""
        return {
            "instances": [{
                "index": r.index, "role": r.role, "alive": r.alive, "outstanding": r.num_outstanding,
                "kv_usage": r.kv_usage, "arrival_rate": self.arrival_rate(r.index, now),
                "step_time_ema_s": r.step_time_ema_s, "failures": r.failures, "restarts": r.restarts,
                "reserved_blocks": sum(r.reserved.values()), "dispatched": r.dispatched,
                "handoffs_in": r.handoffs_in, "group": list(r.group),
                "cached_names": len(r.cache),
                **{k: getattr(r.status, k, _STATUS_DEFAULTS[k]) for k in _STATUS_FIELDS if k != "cache_delta"}}
                for r in self.instances],
            "pending_handoffs": len(self.pending_handoffs),
            "num_dispatched": self.num_dispatched,
            "num_handoffs": self.num_handoffs,
        }


__all__ = ["ROLES", "GlobalMonitor", "InstanceRecord", "InstanceStatus"]
