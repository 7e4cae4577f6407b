"""Routers: which instance a new request goes to. Pure decision code (no clock, no threads),
shared by the simulator and the multi-instance runtime.

- ``round-robin``: instances in turn.
- ``least-outstanding``: the fewest unfinished requests (running + waiting), as in Llumnix's and
  vLLM's router baselines; ties go to the lower index.
- ``kv-aware``: the most free KV blocks after what is already queued there and this request
  need (KunServe's dispatcher balances on a memory load metric in the manner of Llumnix);
  ties go to the fewest outstanding requests, then the lower index.
- ``cache-aware``: where a request's prefix is cached and the load is light
  (:mod:`tidal.cluster.cache_router`).
- ``llumnix``: Llumnix's freeness, those free blocks per outstanding request (its F = (M - sum V)
  / B: how many more decode steps the batch can take before memory runs out). KunServe's
  dispatcher "incorporates the load-balancing design from Llumnix" (Sec. 3): this is it. A
  KunServe group, whose pool grew by the weights it dropped but whose compute did not, looks free
  to ``kv-aware`` until its pool is as full as the others and takes a burst it cannot prefill in
  time; per request it looks only as free as it is.
- ``llumnix-group``: tidal's rule on top of ``llumnix``, not the paper's (added after seeing
  KunServe's P99 TTFT, so it is reported as an ablation): a pipeline group takes a new request only
  while its prefill queue per member is the shortest there is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class InstanceLoad(Protocol):
    """What a router may look at on an instance."""

    @property
    def num_outstanding(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def queued_block_demand(self) -> int: ...

    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True)
class RouteRequest:
    """What a router knows of a request: its prompt and its most output; for a router that reads
    where KV lives, the names of its prompt's full blocks (``block_hashes``) and, filled in by the
    dispatcher, the prompt tokens each live instance holds cached (``cached``, in the order of the
    instances the router is given)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: tuple[bytes, ...] = ()
    cached: tuple[int, ...] = ()


class Router:
    name = "base"
    uses_cache = False  # True: the dispatcher gives it each instance's cached prefix (RouteRequest.cached)

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        raise NotImplementedError


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        i = self._next % len(instances)
        self._next = i + 1
        return i


class LeastOutstandingRouter(Router):
    name = "least-outstanding"

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        return min(range(len(instances)), key=lambda i: (instances[i].num_outstanding, i))


class KVAwareRouter(Router):
    name = "kv-aware"

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        def headroom(i: int) -> tuple[float, int, int]:
            inst = instances[i]
            need = -(-(req.prompt_len + 1) // inst.block_size)
            free = inst.num_free_blocks - inst.queued_block_demand - need
            return (-free / inst.num_blocks, inst.num_outstanding, i)
        return min(range(len(instances)), key=headroom)


def members(inst: InstanceLoad) -> int:
    """Instances in ``inst``'s KunServe pipeline group (1 when it runs alone)."""
    return max(1, len(getattr(inst, "group", ()) or ()))


def queue_per_member(inst: InstanceLoad) -> float:
    """Requests waiting for their prefill per member of the instance's pipeline group."""
    return getattr(inst, "num_queued", 0) / members(inst)


def freeness(req: RouteRequest, inst: InstanceLoad) -> float:
    """Llumnix's F = (M - sum V) / B: free blocks after the queue and this request, per outstanding
    request; an overloaded instance (F < 0) ranks lower the more it holds."""
    need = -(-(req.prompt_len + 1) // inst.block_size)
    free = inst.num_free_blocks - inst.queued_block_demand - need
    b = max(inst.num_outstanding, 1)
    return free / b if free >= 0 else free * b


class LlumnixRouter(Router):
    name = "llumnix"

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        return min(range(len(instances)), key=lambda i: (-freeness(req, instances[i]), instances[i].num_outstanding, i))


class LlumnixGroupRouter(Router):
    """tidal's ablation (not KunServe's): Llumnix's freeness, except that a pipeline group whose
    prefill queue per member is longer than the shortest queue there is takes no new request (its
    pool grew by the weights it dropped, its compute only k-fold)."""

    name = "llumnix-group"

    def route(self, req: RouteRequest, instances: Sequence[InstanceLoad]) -> int:
        shortest = min(queue_per_member(x) for x in instances)

        def key(i: int) -> tuple[bool, float, int, int]:
            inst = instances[i]
            busy_group = members(inst) > 1 and queue_per_member(inst) > shortest
            return (busy_group, -freeness(req, inst), inst.num_outstanding, i)
        return min(range(len(instances)), key=key)


def _cache_aware() -> Router:
    from tidal.cluster.cache_router import CacheAwareRouter

    return CacheAwareRouter()


ROUTERS: dict[str, Callable[[], Router]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    LeastOutstandingRouter.name: LeastOutstandingRouter,
    KVAwareRouter.name: KVAwareRouter,
    LlumnixRouter.name: LlumnixRouter,
    "cache-aware": _cache_aware,
    LlumnixGroupRouter.name: LlumnixGroupRouter,
}


def build_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; available: {', '.join(ROUTERS)}")
    return ROUTERS[name]()
