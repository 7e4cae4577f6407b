"""Starting, watching and stopping workers: local processes, or Ray actors.

A backend starts one worker for a :class:`~tidal.runtime.worker.WorkerConfig` and returns a
:class:`WorkerHandle` that says whether it is alive (and gives a file descriptor that becomes
readable when a local process dies) and stops it by its own id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import signal
import uuid
from typing import Any

from tidal.common.progress import startup_phase
from tidal.runtime.worker import WorkerConfig, worker_main


class WorkerHandle:
    sentinel: int | None = None  # readable when the worker died (local processes)

    def alive(self) -> bool:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def join(self, timeout: float) -> None:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return None


class ProcessHandle(WorkerHandle):
    def __init__(self, proc: Any):
        self.proc = proc
        self.sentinel = proc.sentinel

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)

    def join(self, timeout: float) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
            self.proc.join(5)

    @property
    def pid(self) -> int | None:
        return self.proc.pid


class ProcessBackend:
    control_host = "127.0.0.1"  # (unused: local workers talk over ipc:// sockets)
    single_machine = True

    name = "process"

    def __init__(self) -> None:
        # forked from a server process that imported torch, the engine and transformers once and
        # nothing else (no thread, no device): a worker starts without importing them anew, and
        # inherits no torch threads or locks of the front end (which a plain fork would)
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["tidal.runtime.forkserver_preload"])

    def start(self, cfg: WorkerConfig) -> ProcessHandle:
        cfg = dataclasses.replace(cfg, env=dict(os.environ))  # the forkserver's is the front end's when it started
        proc = self.ctx.Process(target=worker_main, args=(cfg,), name=f"tidal-worker-{cfg.index}", daemon=True)
        proc.start()
        return ProcessHandle(proc)

    def shutdown(self) -> None:
        pass


class RayHandle(WorkerHandle):
    def __init__(self, actor: Any, done: Any):
        self.actor, self.done = actor, done

    def alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.done], timeout=0)
        return not ready

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.wait([self.done], timeout=timeout)
        self.kill()


class RayBackend:
    """Workers as Ray actors (one CPU each by default). A local Ray is started when no cluster
    address is given, and stopped with the backend."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus_per_worker: float = 1.0, *, num_instances: int = 0,
                 placement: str = "spread", num_gpus_per_worker: float = 0.0, placement_timeout_s: float = 120.0):
        """``num_instances`` > 0: the workers go in a placement group of that many bundles (one
        per instance, each ``num_cpus_per_worker`` CPUs and ``num_gpus_per_worker`` GPUs), placed
        by ``placement`` (Ray's strategy: spread, strict-spread, pack, strict-pack); instance ``i``
        runs in bundle ``i``, also when restarted (Ray places a lost node's bundles again when a
        node has room)."""
        import ray

        self.ray = ray
        self.started_here = False
        if not ray.is_initialized():
            if address:
                check_reachable(address)
                try:
                    ray.init(address=address, log_to_driver=False)
                except Exception as e:  # noqa: BLE001 - Ray raises several kinds; the user needs one line
                    from tidal.config import ConfigError

                    raise ConfigError(f"cannot join the Ray cluster at --ray-address {address}: "
                                      f"{' '.join(str(e).split())[:200]}") from None
            else:
                with startup_phase("starting a local Ray", "Ray started"):
                    ray.init(num_cpus=max(os.cpu_count() or 1, 1), include_dashboard=False, log_to_driver=False)
                self.started_here = True

        # ``run`` holds the default group's one thread for the worker's life; the ``kv`` group answers
        # readers of the KV chunks this worker put (tidal.runtime.kv_transfer.RayTransport) meanwhile
        @ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker, max_restarts=0,
                    concurrency_groups={"kv": 1})
        class _Actor:
            def run(self, cfg: WorkerConfig) -> None:
                worker_main(cfg)

            @ray.method(concurrency_group="kv")
            def fetch(self, key: str) -> Any:
                from tidal.runtime.kv_transfer import serve_chunk

                return serve_chunk(key)

            @ray.method(concurrency_group="kv")
            def drop(self, keys: list[str]) -> None:
                from tidal.runtime.kv_transfer import drop_chunks

                drop_chunks(keys)

        self._actor_cls = _Actor
        self._tag = uuid.uuid4().hex[:8]  # this front end's actors' names: tidal-<tag>-<instance>-<generation>
        self.pg: Any = None
        if num_instances:
            self._place(num_instances, placement, num_cpus_per_worker, num_gpus_per_worker, placement_timeout_s)

    def _place(self, n: int, placement: str, cpus: float, gpus: float, timeout_s: float) -> None:
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        strategy = placement.upper().replace("-", "_")
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=f"tidal-{self._tag}")
        ready, _ = self.ray.wait([self.pg.ready()], timeout=timeout_s)
        if ready:
            return
        remove_placement_group(self.pg)
        self.pg = None
        nodes = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        have = ", ".join(f"{r.get('CPU', 0):g} CPU/{r.get('GPU', 0):g} GPU" for r in nodes)
        self.shutdown()
        from tidal.config import ConfigError

        raise ConfigError(f"the Ray cluster cannot place {n} instances of {bundle} with --ray-placement {placement} "
                          f"within {timeout_s:.0f} s; its {len(nodes)} live node(s) have {have}")

    @property
    def control_host(self) -> str:
        """Where the front end's ZeroMQ sockets listen: loopback when every actor runs on this
        machine (a Ray started here), else this node's address in the Ray cluster, which actors
        on other machines can reach."""
        return "127.0.0.1" if self.started_here else self.ray.util.get_node_ip_address()

    @property
    def single_machine(self) -> bool:
        return self.started_here or len({n["NodeManagerAddress"] for n in self.ray.nodes() if n.get("Alive")}) <= 1

    def start(self, cfg: WorkerConfig) -> RayHandle:
        opts: dict[str, Any] = {"name": f"tidal-{self._tag}-{cfg.index}-{cfg.generation}"}
        if self.pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=cfg.index)
        actor = self._actor_cls.options(**opts).remote()
        return RayHandle(actor, actor.run.remote(cfg))

    def shutdown(self) -> None:
        if getattr(self, "pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        if self.started_here:
            self.ray.shutdown()


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """A ``host:port`` Ray address that nothing listens on is a one-line error at once (Ray itself
    retries for about a minute); ``auto`` and other forms are left to Ray."""
    import socket

    from tidal.config import ConfigError

    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at --ray-address {address}: {e.strerror or e}") from None


def check_ray_available() -> None:
    """``--backend ray`` without Ray installed: a one-line error before anything starts."""
    try:
        import ray  # noqa: F401
    except ImportError:
        from tidal.config import ConfigError

        raise ConfigError("--backend ray needs Ray: pip install -e '.[ray]'") from None


__all__ = ["ProcessBackend", "ProcessHandle", "RayBackend", "RayHandle", "WorkerHandle", "check_ray_available", "check_reachable"]
