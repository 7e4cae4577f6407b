"""What the memory-pressure handling decided, as plain records (pure).

Every decision of :mod:`tidal.cluster.pressure` -- a drop plan (KunServe Sec. 4.1), the start
and the end of a KV exchange (Sec. 4.2), a restore (Sec. 4.4), an autoscale signal (Sec. 4.4),
a Llumnix-like migration (the ``migrate`` baseline) -- is one :class:`PressureDecision`. Give
the deciding object a ``recorder`` (any callable taking a decision, e.g. ``list.append``), as
:class:`tidal.cluster.dispatch.Dispatcher` takes one for its dispatches
(:mod:`tidal.cluster.decisions`), so the simulator's log and the real runtime's can be compared
and drawn on a timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the ``--kv-pressure`` choices: what an instance does when its KV cannot hold its queue
PRESSURE_MODES = ("preempt", "migrate", "drop", "auto")
KINDS = ("throttle", "drop", "exchange", "exchange-done", "restore", "restore-done", "migrate",
         "autoscale", "choose", "limit", "limit-over")

Recorder = Callable[["PressureDecision"], None]


@dataclass(frozen=True, slots=True)
class PressureDecision:
    """One decision or execution event: ``kind`` (one of :data:`KINDS`) at ``time`` on
    ``instances``; ``details`` is JSON-able (the plan's groups and bytes, the request moved...)."""

    kind: str
    time: float
    instances: tuple[int, ...]
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown pressure decision kind {self.kind!r}; kinds: {', '.join(KINDS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "time": self.time, "instances": list(self.instances), **self.details}


def check_pressure_mode(mode: str, instances: int, num_layers: int | None = None,
                        disaggregated: bool = False) -> None:
    """One-line ``ValueError`` for a ``--kv-pressure`` the cluster cannot run: ``drop`` needs at
    least two instances (a group replaces dropped layers by a peer's copy, Sec. 3) and a model
    with at least two layers (a pipeline of two stages); ``migrate`` needs a peer to move to;
    ``auto`` chooses among all of them, so it needs what ``drop`` needs."""
    if mode not in PRESSURE_MODES:
        raise ValueError(f"--kv-pressure must be one of {', '.join(PRESSURE_MODES)}; got {mode!r}")
    if mode == "preempt":
        return
    if disaggregated:
        raise ValueError(f"--kv-pressure {mode} needs colocated instances (--mode colocate)")
    if instances < 2:
        raise ValueError(f"--kv-pressure {mode} needs at least 2 instances (got {instances}): "
                         + ("dropped layers must have a copy on a peer" if mode == "drop"
                            else "requests migrate to a peer" if mode == "migrate"
                            else "it chooses among migrating to a peer and dropping layers a peer holds"))
    if mode in ("drop", "auto") and num_layers is not None and num_layers < 2:
        raise ValueError(f"--kv-pressure {mode} needs a model whose layers can be split into pipeline stages; "
                         f"this one has {num_layers} layer")


__all__ = ["KINDS", "PRESSURE_MODES", "PressureDecision", "Recorder", "check_pressure_mode"]
