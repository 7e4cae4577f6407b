"""The configuration of several instances: one tree, validated once, sent to the workers whole.

:class:`ServingConfig` is the root: the engine's :class:`~tidal.config.EngineConfig` (model,
cache, scheduler) and the :class:`ClusterConfig` (layout, router, backend, KV transport and
chunking, the ``--kv-pressure`` mode). Each part checks itself on construction and the root
checks what spans parts (each role's policy, the pressure mode against the layout), so a bad
combination is a one-line :class:`~tidal.config.ConfigError` before any worker starts. A worker
gets its role's :class:`~tidal.config.EngineConfig` as an object (:meth:`ServingConfig.engine_for`),
never a dictionary of keyword arguments to rebuild it from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tidal.cluster.dispatch import ClusterLayout, check_role_policies, role_scheduler
from tidal.cluster.pressure.events import PRESSURE_MODES, check_pressure_mode
from tidal.cluster.router import ROUTERS
from tidal.config import ConfigError, EngineConfig

BACKENDS = ("process", "ray")
TRANSPORTS = ("shm", "ray")


RAY_PLACEMENTS = ("spread", "strict-spread", "pack", "strict-pack")
SPLIT_PLACEMENTS = ("load", "fixed")


@dataclass(frozen=True)
class ClusterConfig:
    layout: ClusterLayout = field(default_factory=ClusterLayout)
    prefill_batching: str | None = None  # the prefill instances' policy (default: the engine's batching)
    router: str = "least-outstanding"
    backend: str = "process"  # process | ray
    ray_address: str | None = None
    threads_per_instance: int | None = None  # default: the cores split evenly
    transport: str = "shm"  # shm | ray (KV hand-offs)
    layers_per_chunk: int = 8
    tokens_per_chunk: int = 0
    restart: bool = True
    # more than a worker's longest wait for a kernel build elsewhere (tidal.config.start_wait_s: 600 s) and its own start
    start_timeout_s: float = 900.0
    # each step of a request's move (reserve, transfer, free: tidal.cluster.moves) before it falls back
    move_timeout_s: float = 120.0
    # preempt | drop (KunServe: tidal.runtime.pressure) | migrate (tidal.runtime.migrate) | auto (tidal.runtime.auto)
    kv_pressure: str = "preempt"
    # Ray: the workers' placement group (one bundle per instance) and what each bundle holds
    ray_placement: str = "spread"  # spread | strict-spread | pack | strict-pack (Ray's strategies)
    num_gpus_per_instance: float = 0.0
    # each instance's KV pool in blocks, for instances of unequal memory (default: the engine's own sizing)
    kv_blocks: tuple[int, ...] | None = None
    step_log: str | None = None  # a file: one JSON line per worker step report (profiling a layout)
    split_placement: str = "load"  # --mode split: load (DynaServe Sec. 3.1: either of a pair is alpha) | fixed

    def __post_init__(self) -> None:
        if self.kv_blocks is not None and (len(self.kv_blocks) != self.layout.instances
                                           or any(n <= 0 for n in self.kv_blocks)):
            raise ConfigError(f"kv_blocks needs one positive block count per instance ({self.layout.instances}), "
                              f"got {self.kv_blocks}")
        if self.ray_placement not in RAY_PLACEMENTS:
            raise ConfigError(f"--ray-placement must be one of {', '.join(RAY_PLACEMENTS)}; got {self.ray_placement!r}")
        if self.num_gpus_per_instance < 0:
            raise ConfigError(f"--num-gpus-per-instance must be >= 0, got {self.num_gpus_per_instance}")
        if self.num_gpus_per_instance and self.backend != "ray":
            raise ConfigError("--num-gpus-per-instance reserves GPUs for Ray actors: it needs --backend ray")
        if self.split_placement not in SPLIT_PLACEMENTS:
            raise ConfigError(f"--split-placement must be one of {', '.join(SPLIT_PLACEMENTS)}; got "
                              f"{self.split_placement!r}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"kv transport must be one of {', '.join(TRANSPORTS)}; got {self.transport!r}")
        if self.threads_per_instance is not None and self.threads_per_instance <= 0:
            raise ConfigError(f"threads per instance must be > 0, got {self.threads_per_instance}")
        if self.layers_per_chunk < 0 or self.tokens_per_chunk < 0:
            raise ConfigError("layers and tokens per KV chunk must be >= 0 (0: all in one chunk)")
        if self.start_timeout_s <= 0:
            raise ConfigError(f"start timeout must be > 0 s, got {self.start_timeout_s}")
        if self.move_timeout_s <= 0:
            raise ConfigError(f"move timeout must be > 0 s, got {self.move_timeout_s}")
        if self.kv_pressure not in PRESSURE_MODES:
            raise ConfigError(f"--kv-pressure must be one of {', '.join(PRESSURE_MODES)}; got {self.kv_pressure!r}")
        try:  # what the layout alone decides; the model's layer count is checked where it is known
            check_pressure_mode(self.kv_pressure, self.layout.instances, None, self.layout.mode != "colocate")
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class ServingConfig:
    """The whole tree of a serving cluster (engine, scheduler, cache, cluster, pressure)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        from tidal.policies import check_policy

        # each role's policy (BucketServe Sec. III: the prefill instances may batch by their own)
        check_role_policies(self.engine.scheduler, self.cluster.layout, self.cluster.prefill_batching, check_policy)

    def check_model(self, num_layers: int) -> None:
        """What needs the model's shape (read once, from the checkpoint's metadata)."""
        c = self.cluster
        try:
            check_pressure_mode(c.kv_pressure, c.layout.instances, num_layers, c.layout.mode != "colocate")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def engine_for(self, role: str, index: int | None = None, **model: object) -> EngineConfig:
        """The engine config of instance ``index``, of ``role`` (its own policy and policy arguments,
        its own pool where ``cluster.kv_blocks`` sizes it), with ``model`` fields set (the dtype
        resolved once for all, the instance's threads)."""
        e, blocks = self.engine, self.cluster.kv_blocks
        cache = e.cache if blocks is None or index is None else dataclasses.replace(e.cache, num_blocks_override=blocks[index])
        sched = role_scheduler(e.scheduler, role, self.cluster.prefill_batching)
        if self.cluster.kv_pressure == "auto":  # it may switch a worker to swap: every worker keeps its host pool
            sched = dataclasses.replace(sched, swap_pool=True)
        return dataclasses.replace(e, model=dataclasses.replace(e.model, **model), cache=cache, scheduler=sched)


__all__ = ["BACKENDS", "TRANSPORTS", "ClusterConfig", "ServingConfig"]
