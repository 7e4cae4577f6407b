"""What a coordinator (``--kv-pressure migrate`` / ``drop``, ``--mode split``) may use of the
cluster front end: a narrow protocol, so a coordinator depends on these names only and its tests
drive it with a small stand-in, never with :class:`~tidal.runtime.cluster.ClusterLLM`'s insides.
All of it is called under the front end's lock (from the I/O thread or the event loop)."""

from __future__ import annotations

from typing import Any, Protocol

from tidal.cluster.dispatch import ClusterLayout
from tidal.cluster.monitor import GlobalMonitor
from tidal.cluster.moves import Command, MoveKind
from tidal.config import EngineConfig
from tidal.runtime.records import ClusterConfig, Tracked


class Front(Protocol):
    config: EngineConfig
    cluster: ClusterConfig
    layout: ClusterLayout
    monitor: GlobalMonitor
    requests: dict[str, Tracked]  # by the client's request id
    by_wid: dict[str, Tracked]  # by the id its current run has on the workers

    @property
    def cache_routing(self) -> bool:
        """The workers report their cached blocks; the monitor keeps a cache view per instance."""

    @property
    def ready(self) -> bool:
        """Every instance reported ready once."""

    @property
    def max_model_len(self) -> int: ...

    def now(self) -> float: ...

    def send(self, i: int, cmd: Any) -> None:
        """Queue a :mod:`tidal.runtime.protocol` command for worker ``i``."""

    def failover(self, t: Tracked) -> None:
        """Re-run ``t`` from its prompt and streamed tokens where the router sends it."""

    def recompute(self, t: Tracked, src: int, abort: bool = True) -> None:
        """``t`` leaves instance ``src`` (told to abort it when ``abort``) and is re-run elsewhere."""

    def drop_handoff(self, t: Tracked) -> None:
        """End ``t``'s move from outside the machine: its reservation on the target, the chunks in flight."""

    def begin_move(self, t: Tracked, kind: MoveKind, src: int, blocks: int, num_chunks: int = 0,
                   dst: int | None = None, meta: Any = None, split: int | None = None, started: bool = False) -> None:
        """Start moving ``t`` (:class:`tidal.cluster.moves.Move`; the front end carries out its commands)."""

    def carry_out(self, t: Tracked, cmds: list[Command]) -> None:
        """Do what ``t``'s move says (the commands an event on it returned)."""

    def group_address(self, name: str) -> str:
        """A fresh control address for the workers of a pipeline group to talk on."""

    def worker_pid(self, i: int) -> int | None: ...


__all__ = ["Front"]
