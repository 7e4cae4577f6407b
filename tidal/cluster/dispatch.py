"""The global dispatcher: where a request runs, and in disaggregated mode where its decode goes.

Pure decision code shared by the simulator and the real runtime.

- ``colocate``: every instance prefills and decodes; a router (``tidal.cluster.router``) picks one
  among the live instances.
- ``disaggregate`` (BucketServe Sec. III, prefill/decode disaggregation): the first
  ``prefill_instances`` instances only prefill; the router picks one of them. When a request's
  prefill is done, its KV goes to the decode instance with the most free KV blocks that can
  hold it (free blocks less the blocks already queued there, at least the request's need). If
  none can, the request waits on its prefill instance and the monitor shows it as a pending
  hand-off; it is retried whenever an instance reports.

  While a role has no live instance (one died and restarts), the survivors cover for it: with
  no prefill instance alive a decode instance takes new requests and runs them whole, and with
  no decode instance alive a prefill instance keeps what it prefills and decodes it itself
  (:meth:`Dispatcher.can_hand_off`): 1P1D degrades to colocated until the role is back.

- ``split`` (DynaServe): instances pair up (``2k`` alpha, ``2k+1`` beta, :func:`tidal.cluster.split.pairs`)
  and every instance prefills and decodes; :class:`tidal.cluster.split.SplitPlanner` picks the pair
  and the split point of each request, not this dispatcher.

An optional ``recorder`` receives every decision with the monitor's view it was taken on
(:mod:`tidal.cluster.decisions`), so the real runtime's and the simulator's can be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from tidal.cluster.cache_router import NoInstanceMeetsSLO
from tidal.cluster.decisions import Decision, views_of
from tidal.cluster.monitor import GlobalMonitor
from tidal.cluster.router import Router, RouteRequest
from tidal.cluster.split import pairs
from tidal.config import ConfigError, SchedulerConfig

MODES = ("colocate", "disaggregate", "split")


@dataclass(frozen=True)
class ClusterLayout:
    """How many instances, and which role each plays."""

    instances: int = 1
    mode: str = "colocate"
    prefill_instances: int = 0

    def __post_init__(self) -> None:
        if self.instances < 1:
            raise ConfigError(f"instances must be >= 1, got {self.instances}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if self.mode == "disaggregate":
            if self.instances < 2:
                raise ConfigError("--mode disaggregate needs at least 2 instances (one prefill, one decode)")
            if not 1 <= self.prefill_instances < self.instances:
                raise ConfigError(f"--prefill-instances must be in [1, instances - 1] = [1, {self.instances - 1}] "
                                  f"with --mode disaggregate; got {self.prefill_instances}")
        elif self.prefill_instances:
            raise ConfigError("--prefill-instances needs --mode disaggregate")
        if self.mode == "split":
            pairs(self.instances)  # an even number >= 2 (ConfigError)

    def pairs(self) -> list[tuple[int, int]]:
        """DynaServe's instance pairs with --mode split: (2k alpha, 2k+1 beta); none otherwise."""
        return pairs(self.instances) if self.mode == "split" else []

    def roles(self) -> list[str]:
        if self.mode in ("colocate", "split"):  # split: unified instances (DynaServe Sec. 3.1)
            return ["colocated"] * self.instances
        return ["prefill"] * self.prefill_instances + ["decode"] * (self.instances - self.prefill_instances)

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregate"

    @property
    def split(self) -> bool:
        return self.mode == "split"



class Dispatcher:
    def __init__(self, layout: ClusterLayout, monitor: GlobalMonitor, router: Router,
                 recorder: Callable[[Decision], None] | None = None):
        if len(monitor.instances) != layout.instances:
            raise ValueError("the monitor and the layout disagree on the number of instances")
        self.layout, self.monitor, self.router = layout, monitor, router
        self.recorder = recorder

    def dispatch(self, req: RouteRequest, now: float) -> int | None:
        """The instance that takes ``req`` first (a prefill instance when disaggregated; a decode
        instance, which runs it whole, when no prefill instance is alive), or None when no
        instance is alive at all."""
        role = "prefill" if self.layout.disaggregated else None
        live = self.monitor.routable(role)
        if not live and self.layout.disaggregated:  # the prefill role is down: P/D degrades to colocated
            live = self.monitor.routable("decode")
        names = req.block_hashes
        if self.router.uses_cache and names:  # each instance's cached prefix of this prompt (replays bring theirs)
            req = replace(req, cached=tuple(r.cached_tokens(names) for r in live))
        views = views_of(self.monitor) if self.recorder is not None else ()
        index = None
        if live:
            try:
                index = live[self.router.route(req, live)].index
            except NoInstanceMeetsSLO:  # --admission-ttft-slo: refused, not queued
                index = None
        if self.recorder is not None:
            self.recorder(Decision("dispatch", req.request_id, now, views, index,
                                   request=replace(req, block_hashes=()) if names else req))
        if index is not None:
            k = next(j for j, r in enumerate(live) if r.index == index)
            cached = req.cached[k] if req.cached else 0
            self.monitor.on_dispatch(index, req.request_id, now, max(req.prompt_len - cached, 1),
                                     names if self.router.uses_cache else (), start=min(cached, req.prompt_len - 1))
        return index

    def can_hand_off(self) -> bool:
        """Disaggregated: some decode instance is alive to take a hand-off. When none is, a
        prefilled request stays on its prefill instance and decodes there (waiting for a decode
        instance to come back would stall every stream for a restart)."""
        return any(r.role == "decode" for r in self.monitor.alive("decode"))

    def runs_whole(self, index: int) -> bool:
        """A request placed on ``index`` now runs there to its end: always but on a prefill
        instance, and on one of those while no decode instance is alive."""
        return self.monitor.instances[index].role != "prefill" or not self.can_hand_off()

    def choose_decode(self, request_id: str, blocks_needed: int, now: float = 0.0) -> int | None:
        """BucketServe's hand-off target: the live decode instance with the most free KV that can
        hold ``blocks_needed`` blocks; None (and a pending hand-off) when none can. ``now`` is
        only recorded."""
        fits = [r for r in self.monitor.alive("decode") if r.role == "decode" and r.handoff_room >= blocks_needed]
        best = max(fits, key=lambda r: (r.handoff_room, -r.num_outstanding, -r.index)).index if fits else None
        if self.recorder is not None:
            self.recorder(Decision("handoff", request_id, now, views_of(self.monitor), best, blocks=blocks_needed))
        if best is None:
            self.monitor.on_handoff_wait(request_id, blocks_needed)
        else:
            self.monitor.on_handoff_start(request_id, best, blocks_needed)
        return best


def role_scheduler(scheduler: SchedulerConfig, role: str, prefill_batching: str | None) -> SchedulerConfig:
    """The scheduler config of an instance of ``role``. BucketServe Sec. III: the prefill instances
    may batch by their own policy (``prefill_batching``, e.g. its length buckets) while the decode
    instances run ``scheduler.batching``; each keeps only the ``--policy-arg``s naming its policy."""
    if not prefill_batching:
        return scheduler
    batching = prefill_batching if role == "prefill" else scheduler.batching
    names = {n.strip() for n in batching.split("+")}
    return replace(scheduler, batching=batching,
                   policy_args={k: v for k, v in scheduler.policy_args.items() if k.split(".")[0] in names})


def check_role_policies(scheduler: SchedulerConfig, layout: ClusterLayout, prefill_batching: str | None,
                        check: Callable[[SchedulerConfig], None]) -> None:
    """``--prefill-batching`` only with disaggregation; each role's policy passes ``check``; every
    ``--policy-arg`` names a policy some role runs (else it would be dropped silently)."""
    if prefill_batching and not layout.disaggregated:
        raise ConfigError("--prefill-batching needs --mode disaggregate")
    roles: Iterable[str] = sorted(set(layout.roles()))
    configs = [role_scheduler(scheduler, r, prefill_batching) for r in roles]
    for c in configs:
        check(c)
    names = {n.strip() for c in configs for n in c.batching.split("+")}
    for key in scheduler.policy_args:
        if key.split(".")[0] not in names:
            raise ConfigError(f"policy argument {key!r} names a policy no instance runs "
                              f"(--batching / --prefill-batching: {', '.join(sorted(names))})")


__all__ = ["MODES", "ClusterLayout", "Dispatcher", "check_role_policies", "role_scheduler"]
