"""``--kv-pressure auto`` over the global monitor (pure): both shells drive this one object.

:class:`AutoPressure` keeps one response per instance (a group: its first stage), chosen at each
throttle onset by :mod:`tidal.cluster.pressure.choose` from an :class:`Episode` it builds from the
monitor (the queue, the peers' room, the drop plan Fig. 6 would make now) and from what only the
shell knows (each instance's running requests in its scheduler's preemption order). Then:

- ``recompute`` / ``swap``: the instance's scheduler preempts that way (the shell sets its mode);
- ``migrate``: :meth:`migrations` names the requests to move, the Llumnix-like controller's
  answer for the instances whose response is migrate, to instances running alone;
- ``drop``: :attr:`kun`, KunServe's controller with a gate that lets only those throttles through,
  makes the drop plan; its restore (Sec. 4.4) is KunServe's own. :meth:`decide`, :meth:`observe`
  and :meth:`applied` are the controller's, so a shell's KunServe executor drives this object as it
  drives :class:`~tidal.cluster.pressure.KunServeController`.
- ``undo_at_limit`` (an ablation of ours, off by default): once KunServe's own limit signal fires
  (Sec. 4.4's autoscale: KV use still rising after a drop; the paper adds GPUs there),
  :meth:`decide` restores the groups, the deepest first, even while throttled (what the members
  cannot hold is the executor's to preempt), and no drop is offered until the cluster's KV demand
  is back under the restore threshold (Sec. 4.4's 50 %) with every instance alone.

Every choice is logged as a ``choose`` :class:`~tidal.cluster.pressure.events.PressureDecision`
(its reason and predicted seconds) and handed whole to ``choices`` (an
:class:`~tidal.cluster.pressure.choose.AutoChoice`, which :func:`~tidal.cluster.pressure.choose.replay`
decides again). Time is an argument.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from tidal.cluster.monitor import GlobalMonitor, InstanceRecord
from tidal.cluster.pressure.choose import AutoChoice, AutoChooser, AutoParams
from tidal.cluster.pressure.controller import KunServeController, Plan
from tidal.cluster.pressure.drop_plan import DropPlan, ModelMemory
from tidal.cluster.pressure.events import PressureDecision, Recorder
from tidal.cluster.pressure.migrate import Migration, MigrationController
from tidal.cluster.pressure.predict import DropOption, Episode, Prices, Victim
from tidal.cluster.pressure.record import DecisionRecorder
from tidal.cluster.pressure.restore import AutoscaleSignal, RestorePolicy
from tidal.cluster.pressure.throttle import Throttle, ThrottleDetector

ChoiceRecorder = Callable[[AutoChoice], None]
CHOICE_LOG = 256  # the latest choices kept (the runtime's /admin/state shows them)


class AutoPressure:
    def __init__(self, monitor: GlobalMonitor, model: ModelMemory, prices: Prices, *,
                 params: AutoParams | None = None, detector: ThrottleDetector | None = None,
                 restore: RestorePolicy | None = None, autoscale: AutoscaleSignal | None = None,
                 recorder: Recorder | None = None, decisions: DecisionRecorder | None = None,
                 choices: ChoiceRecorder | None = None):
        self.monitor, self.model, self.prices = monitor, model, prices
        self.detector = detector or ThrottleDetector()
        self.chooser = AutoChooser(params)
        self.recorder, self.choices = recorder, choices
        self.kun = KunServeController(monitor, model, detector=self.detector, restore=restore, autoscale=autoscale,
                                      recorder=recorder, decisions=decisions, gate=self._gate)
        self.migration = MigrationController(monitor, self.detector, recorder)
        self.mode: dict[int, str] = {}  # each instance's response (its last episode's choice)
        self.log: list[AutoChoice] = []  # the latest choices (CHOICE_LOG)
        self.counts: dict[str, int] = {}  # choices made, by response
        self._blocked: set[int] = set()  # instances whose choice was made while a drop was out of reach for now
        self.limited_since: float | None = None  # undo_at_limit: when KunServe's limit signal fired (None: not now)

    @property
    def params(self) -> AutoParams:
        return self.chooser.params

    def _gate(self, t: Throttle) -> bool:
        return self.mode.get(t.index) == "drop" and not self._at_limit()

    def _at_limit(self) -> bool:
        """``undo_at_limit``: KunServe's limit signal has fired (or its spell is not over): no drop."""
        s = self.kun.autoscale
        return self.params.undo_at_limit and (self.limited_since is not None or (s.armed and s.fired))

    # ---------------------------------------------------------------- the choice
    def onsets(self, now: float, running: Mapping[int, Sequence[Victim]], drop_ready: bool = True,
               queued: Mapping[int, Sequence[Victim]] | None = None) -> list[AutoChoice]:
        """Choose for every throttle that starts an episode now. ``running``: each instance's running
        requests in its scheduler's preemption order; ``drop_ready``: False while the shell is
        executing a change of groups (a drop is not possible now); ``queued``: each instance's
        requests waiting for their first token, in queue order (the memory wait recycles through them)."""
        throttles = self.detector.scan(self.monitor)
        self.kun._note_throttles(throttles, now)  # the onset's throttle is logged before its choice
        hot = {i for t in throttles for i in t.members}
        made = []
        ready = drop_ready and self.kun.pending is None
        for t in throttles:
            # an episode goes on under its choice, unless that choice was made while a drop was out of
            # reach only because a change was under way: once it is in reach, the choice is made again
            if self.chooser.in_episode(t.index, now) and not (ready and t.index in self._blocked):
                continue
            q = () if queued is None else queued.get(t.index, ())
            c = self.chooser.choose(now, self.episode(t, running.get(t.index, ()), hot, drop_ready, q), self.prices)
            if c.episode.drop.blocked:
                self._blocked.add(t.index)
            else:
                self._blocked.discard(t.index)
            self.mode[t.index] = c.choice
            self.counts[c.choice] = self.counts.get(c.choice, 0) + 1
            self.log.append(c)
            del self.log[:-CHOICE_LOG]
            made.append(c)
            if self.recorder is not None:
                self.recorder(PressureDecision("choose", now, t.members, {"index": t.index, **c.summary()}))
            if self.choices is not None:
                self.choices(c)
        self.chooser.throttled([t.index for t in throttles], now)
        return made

    def episode(self, t: Throttle, running: Sequence[Victim], hot: Collection[int] = (),
                drop_ready: bool = True, queued: Sequence[Victim] = ()) -> Episode:
        """What the prediction reads about throttle ``t``, from the monitor and the shell's ``running``."""
        st = self.monitor.instances[t.index].status
        rec = self.monitor.instances[t.index]
        grouped = len(t.members) > 1  # a group's KV is spread over its stages: it does not migrate
        peers = () if grouped else tuple(max(0, self._room(r)) for r in self._alone() if r.index not in hot
                                         and r.index != t.index)
        drop = (self._drop_option(t) if drop_ready else
                DropOption(why_not="a change of groups or a migration is under way", blocked=True))
        return Episode(t.index, max(0, t.shortage_blocks), getattr(st, "queued_prefill_tokens", 0), st.num_waiting,
                       tuple(running), getattr(st, "num_free_host_blocks", 0), peers, rec.recent_step_s or 0.0, drop,
                       alone=not grouped, queue=tuple(queued))

    def first_token(self, rid: str, now: float) -> None:
        """Request ``rid`` had its first token (what ``learn`` measures an episode by)."""
        self.chooser.first_token(rid, now)

    def _room(self, r: InstanceRecord) -> int:
        st = r.status
        return st.num_free_blocks - st.queued_block_demand - self.detector.reserve(st.num_blocks)

    def _alone(self) -> list[InstanceRecord]:
        return [r for r in self.monitor.routable() if len(r.group) <= 1]

    def _drop_option(self, t: Throttle) -> DropOption:
        """What the drop plan (Fig. 6) would do now for ``t`` alone (the plan KunServe's controller
        makes when the choice lets ``t`` through its gate)."""
        kun = self.kun
        if self._at_limit():
            return DropOption(why_not="KunServe's limit signal fired (Sec. 4.4): no drop until KV demand is back "
                                      "under the restore threshold")
        if kun.pending is not None:
            return DropOption(why_not="a drop or restore plan is being executed", blocked=True)
        st = self.monitor.instances[t.index].status
        block_bytes = self.model.block_bytes(st.block_size)
        shortage = max(0, t.shortage_blocks)
        headroom = {r.index: r.status.num_free_blocks - r.status.queued_block_demand for r in self.monitor.routable()}
        plan = kun.planner.plan(kun.groups, kun.layers, shortage * block_bytes, {t.index: shortage}, headroom)
        if plan is None:
            return DropOption(why_not="no merge frees memory (one group left, or stages as many as layers)")
        g, old = plan.group_of(t.index), set(kun.group_of(t.index))
        if set(g) == old:  # the plan merges other groups first: no relief for this one
            return DropOption(why_not="the plan would merge other, smaller groups first")
        heads = sorted({kun.group_of(i)[0] for i in g if i not in old})
        peers = [self.monitor.instances[h] for h in heads]
        mine = self.monitor.instances[t.index]
        used = sum(r.status.num_blocks - r.status.num_free_blocks for r in (mine, *peers)) * st.block_size
        return DropOption(len(g), plan.freed_total // block_bytes, sum(max(0, self._room(r)) for r in peers),
                          sum(getattr(r.status, "queued_prefill_tokens", 0) for r in (mine, *peers)),
                          sum(r.status.num_waiting for r in (mine, *peers)), used * (len(g) - 1) // len(g))

    # ---------------------------------------------------------------- executing the responses
    def decide(self, now: float) -> Plan | None:
        """KunServe's controller, gated: a drop for the throttles whose response is drop, or a restore
        (with ``undo_at_limit``, also the restores that undo the groups once its limit signal fired)."""
        kun = self.kun
        plan = kun.decide(now)
        if plan is not None or kun.pending is not None or not self.params.undo_at_limit:
            return plan
        if self.limited_since is None and self._at_limit():
            self.limited_since = now
            kun.note("limit", now, tuple(i for g in kun.groups if len(g) > 1 for i in g),
                     reason="KunServe's limit signal: no drop until KV demand is back under the restore threshold",
                     usage=round(kun.usage(), 4))
        if self.limited_since is None:
            return None
        deepest = min((g for g in kun.groups if len(g) > 1), key=lambda g: (-len(g), g), default=None)
        if deepest is not None:
            return kun.plan_restore(deepest, now, reason="limit")
        usage = kun.usage()
        if usage < kun.restore_policy.threshold:
            kun.note("limit-over", now, (), usage=round(usage, 4), since=round(self.limited_since, 4))
            self.limited_since = None
        return None

    def observe(self, now: float) -> None:
        """While the shell executes a plan: the throttle and autoscale log stays current."""
        self.kun.observe(now)

    def applied(self, plan: Plan, now: float) -> None:
        """The shell executed ``plan``: the groups it formed or split start new episodes."""
        self.kun.applied(plan, now)
        touched = [i for g in plan.changed for i in g] if isinstance(plan, DropPlan) else list(plan.group)
        self.chooser.forget(touched)

    def on_failure(self, index: int, now: float) -> tuple[int, ...]:
        """KunServe Sec. 4.4: ``index`` failed; its group dissolves and its members start new episodes."""
        g = self.kun.on_failure(index, now)
        self.chooser.forget(g)
        return g

    # KunServe's controller, as its executors read it
    @property
    def pending(self) -> Plan | None:
        return self.kun.pending

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return self.kun.groups

    @property
    def base_blocks(self) -> dict[int, int]:
        return self.kun.base_blocks

    def withdraw(self, plan: Plan | None) -> None:
        self.kun.withdraw(plan)

    def group_of(self, index: int) -> tuple[int, ...]:
        return self.kun.group_of(index)

    def note(self, kind: str, now: float, instances: tuple[int, ...], **details: Any) -> None:
        self.kun.note(kind, now, instances, **details)

    def migrations(self, now: float, running: Mapping[int, Sequence[tuple[str, int]]],
                   leaving: Mapping[int, int] | None = None, incoming: Mapping[int, int] | None = None
                   ) -> list[Migration]:
        """The Llumnix-like moves (``running``: each instance's movable requests, (id, blocks)) out of
        the throttled instances whose response is migrate, to instances running alone."""
        alone = {r.index for r in self._alone()}
        sources = {i: v for i, v in running.items() if self.mode.get(i) == "migrate" and i in alone}
        if not sources:
            return []
        return self.migration.decide(now, sources, leaving, incoming, alone)

    def preemption_mode(self, index: int) -> str:
        """The scheduler's preemption mode for instance ``index``'s response: swap, else recompute (a
        pipeline group always recomputes)."""
        alone = len(self.monitor.instances[index].group) <= 1
        return "swap" if self.mode.get(index) == "swap" and alone else "recompute"

    def snapshot(self) -> dict[str, Any]:
        """For ``/admin/state`` and the dashboard: each instance's response, counts, the latest choices."""
        return {"modes": {str(k): v for k, v in sorted(self.mode.items())}, "choices_total": dict(self.counts),
                "params": self.params.to_dict(), "limited_since": self.limited_since,
                "choices": [{"time": round(c.time, 4), "index": c.index, **c.summary()} for c in self.log[-16:]]}


__all__ = ["CHOICE_LOG", "AutoPressure", "ChoiceRecorder"]
