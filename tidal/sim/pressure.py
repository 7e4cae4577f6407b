"""KV memory pressure in the simulator: what an instance does when its queue cannot fit
(``tidal sim --kv-pressure``), and the plumbing its handlers share.

- ``preempt``: what the engine's scheduler does on its own (recompute, or swap with
  ``--preemption-mode swap``); the handler only watches, so throttles show on the timeline.
- ``migrate``: the Llumnix-like baseline (:mod:`tidal.sim.migrate`).
- ``drop``: KunServe (:mod:`tidal.sim.kunserve`).
- ``auto``: each throttle onset chooses one of recompute, swap, migrate, drop (:mod:`tidal.sim.auto`).

A handler is told of every step end (``after_step``) and may keep an instance from starting
its next step (``can_step``: an instance drains before its layers change). The decisions come
from the pure :mod:`tidal.cluster.pressure`; each is logged as a
:class:`~tidal.cluster.pressure.PressureDecision` (``events``). Pure: virtual time only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.cluster.handoff import DEFAULT_LAYERS_PER_CHUNK, plan_chunks
from tidal.cluster.moves import moved_request
from tidal.cluster.pressure import ChunkCost, ModelMemory, PressureDecision, ThrottleDetector
from tidal.core.request import Request
from tidal.sim.links import LinkSpec
from tidal.sim.loop import Event

if TYPE_CHECKING:
    from tidal.sim.instance import SimInstance
    from tidal.sim.simulator import ClusterSimulator


@dataclass(frozen=True)
class PressureConfig:
    """What the handlers need: the mode, the link between instances (KV exchange, migration,
    activations, weights), the model's memory shape and the pipeline's knobs."""

    mode: str
    link: LinkSpec
    model: ModelMemory
    hidden_bytes: int  # one token's activation between two stages (hidden size x dtype bytes)
    chunk_cost: ChunkCost  # Eq. 1 coefficients the lookahead balances with
    tp: int = 1
    layers_per_chunk: int = DEFAULT_LAYERS_PER_CHUNK  # KV moves in chunks of this many layers
    lookahead: bool = True  # False: token-count microbatches (Sarathi / vLLM pipelines)
    restore_threshold: float = 0.5
    overhead_s: float = 0.0  # the hardware's fixed per-step cost (each pipeline stage pays it)
    stage_gap_s: float = 0.0  # a pipeline stage's idle time per microbatch (tidal.sim.pipeline.PipelineCostModel)
    host_bytes_per_s: float = 0.0  # device <-> host (swap) of an instance, all its GPUs (auto prices a swap)
    auto_params: Any = None  # --kv-pressure auto: its AutoParams (None: the defaults)
    audit: bool = False  # note auto's predictions beside what happened (tidal.sim.auto_audit); not in drop runs


class Call(Event):
    """An event that calls ``fn(now)`` (landings of KV chunks, weights loaded)."""

    __slots__ = ("fn",)
    priority = 1

    def __init__(self, time: float, fn: Callable[[float], Any]):
        super().__init__(time)
        self.fn = fn

    def fire(self, loop):  # type: ignore[no-untyped-def]
        return self.fn(self.time)


class LinkQueue:
    """Each instance's outgoing link: transfers one after the other (chunks of one request
    back to back; Sec. 4.2's coordinated exchange lets activations pass between chunks, which
    this does not delay: they are small)."""

    def __init__(self, link: LinkSpec, n: int, tp: int = 1):
        self.link, self.tp = link, tp
        self.free_at = [0.0] * n
        self.bytes = [0] * n

    def send(self, src: int, now: float, chunk_bytes: list[int]) -> float:
        """Queue ``chunk_bytes`` on ``src``'s link at ``now``; the time the last one lands."""
        t = max(now, self.free_at[src])
        for b in chunk_bytes:
            t += self.link.chunk_time(b, self.tp)
            self.bytes[src] += b
        self.free_at[src] = t
        return t


def kv_chunk_bytes(cfg: PressureConfig, layers: tuple[int, int], num_tokens: int, cached: int = 0) -> list[int]:
    """The chunks (``tidal.cluster.handoff.plan_chunks``) of ``num_tokens`` tokens' KV of ``layers``
    that a destination holding the first ``cached`` of them reads (those reaching past them)."""
    per = cfg.model.kv_bytes_per_token_layer()
    return [int(len(c.layers) * c.num_tokens * per)
            for c in plan_chunks(range(*layers), 0, num_tokens, cfg.layers_per_chunk, 0) if c.end > cached]


def copy_request(req: Request, now: float, with_kv: bool) -> Request:
    """The request as another scheduler takes it (:func:`tidal.cluster.moves.moved_request`)."""
    return moved_request(req, with_kv)


class PressureHandler:
    """The ``preempt`` mode: the scheduler preempts by itself; throttles are only logged."""

    mode = "preempt"

    def __init__(self, cfg: PressureConfig, detector: ThrottleDetector | None = None):
        self.cfg = cfg
        self.detector = detector or ThrottleDetector()
        self.events: list[PressureDecision] = []
        self.sim: ClusterSimulator | None = None
        self._hot: set[int] = set()
        self.audit: Any = None  # a tidal.sim.auto_audit.PredictionAudit when cfg.audit

    def attach(self, sim: ClusterSimulator) -> None:
        self.sim = sim
        if self.cfg.audit and self.mode in ("preempt", "migrate"):
            from tidal.sim.auto import shadow_audit

            self.audit = shadow_audit(self.cfg, sim, "migrate" if self.mode == "migrate" else None)

    def record(self, decision: PressureDecision) -> None:
        self.events.append(decision)

    def note(self, kind: str, now: float, instances: tuple[int, ...], **details: Any) -> None:
        self.record(PressureDecision(kind, now, tuple(instances), details))

    def watch(self, now: float) -> None:
        """Log each throttle's onset (Sec. 2.2's "Throt." marks)."""
        assert self.sim is not None
        if self.audit is not None:
            self.audit.step(now)
        hot = set()
        for t in self.detector.scan(self.sim.monitor):
            hot.add(t.index)
            if t.index not in self._hot:
                self.note("throttle", now, t.members, shortage_blocks=t.shortage_blocks, hol_blocks=t.hol_blocks)
        self._hot = hot

    def after_step(self, inst: SimInstance, now: float) -> list[Event]:
        self.watch(now)
        return []

    def can_step(self, inst: SimInstance) -> bool:
        return True

    def on_first_token(self, request_id: str, now: float) -> None:
        """A request had its first token (``auto`` learns from it)."""

    def on_failure(self, index: int, request_id: str, now: float) -> list[Event] | None:
        """Instance ``index`` died holding ``request_id``: the events of ending its move, or None
        when no move of this handler's touches it (the simulator re-runs it elsewhere)."""
        return None

    def finish(self, now: float) -> None:
        """The run ended: put the simulator's instance list back as it began."""

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for e in self.events:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        out = {"mode": self.mode, "counts": kinds, "events": [e.to_dict() for e in self.events]}
        if self.audit is not None and self.sim is not None:
            out["audit"] = self.audit.rows(self.sim)
        return out


def build_pressure(cfg: PressureConfig) -> PressureHandler:
    if cfg.mode == "preempt":
        return PressureHandler(cfg)
    if cfg.mode == "migrate":
        from tidal.sim.migrate import MigrateHandler

        return MigrateHandler(cfg)
    if cfg.mode == "drop":
        from tidal.sim.kunserve import DropHandler

        return DropHandler(cfg)
    if cfg.mode == "auto":
        from tidal.sim.auto import AutoHandler

        return AutoHandler(cfg)
    raise ValueError(f"unknown --kv-pressure {cfg.mode!r}")


__all__ = ["Call", "LinkQueue", "PressureConfig", "PressureHandler", "build_pressure", "copy_request",
           "kv_chunk_bytes"]
