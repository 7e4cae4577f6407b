"""ClusterLLM: N engine workers behind one front end with AsyncLLM's interface.

The HTTP server talks to it exactly as to :class:`tidal.engine.async_engine.AsyncLLM`
(``generate`` streams, ``stats``, ``engine`` for the tokenizer and config). Inside:

- the pure :class:`~tidal.cluster.dispatch.Dispatcher` and
  :class:`~tidal.cluster.monitor.GlobalMonitor` pick an instance per request and, when
  disaggregated, the decode instance of each hand-off (the simulator drives the same objects);
- one I/O thread owns the ZeroMQ sockets: it sends the commands queued by the event loop,
  receives every worker's outputs and routes them to the request streams, forwards KV chunk
  handles from prefill to decode workers, and watches the workers' process sentinels;
- with ``--mode split`` (DynaServe), a split planner picks a pair of instances and a split point
  per request: the alpha member computes the first ``s`` tokens of KV and streams them, chunk by
  chunk as it computes, to the beta member, which holds a reservation and continues the request;
- when a worker dies, its requests are re-run on the live instances from their prompt plus the
  tokens already streamed (recompute), their streams continue, and the worker is restarted.
  Only when no instance is alive does a request fail (the server answers 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import zmq

from tidal.cluster.dispatch import Dispatcher, check_role_policies, role_scheduler
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.router import RouteRequest, build_router
from tidal.common.progress import startup_line
from tidal.config import ConfigError, EngineConfig, default_cpu_threads
from tidal.core.admission import admit
from tidal.core.sampling import SamplingParams
from tidal.engine.async_engine import EngineDeadError, QueueFullError
from tidal.engine.llm_engine import RequestSnapshot, dtype_name
from tidal.engine.outputs import RequestOutput
from tidal.runtime.kv_transfer import build_transport
from tidal.runtime.outbox import Outbox
from tidal.runtime.records import ClusterConfig, FrontEngine, Handoff, Tracked
from tidal.runtime.split_front import SplitCoordinator
from tidal.runtime.worker import WorkerConfig

log = logging.getLogger("tidal.cluster")
START_ATTEMPTS = 3  # a worker that dies this many times in a row before it is ready is not restarted


class ClusterLLM:
    def __init__(self, engine_config: EngineConfig, cluster: ClusterConfig, engine_kwargs: dict[str, Any],
                 splitter: Any = None):
        from tidal.policies import check_policy

        # before any worker starts: each role's policy (BucketServe Sec. III: the prefill instances
        # may batch by their own, e.g. length buckets)
        check_role_policies(engine_config.scheduler, cluster.layout, cluster.prefill_batching, check_policy)
        self.config, self.cluster = engine_config, cluster
        self.engine = FrontEngine(engine_config)
        self.layout = cluster.layout
        self.pressure = self._pressure()  # --kv-pressure drop: KunServe's coordinator (else None)
        n = self.layout.instances
        self.threads = cluster.threads_per_instance or max(1, default_cpu_threads() // n)
        self.engine_kwargs = dict(engine_kwargs)
        self.engine_kwargs.pop("num_threads", None)
        mc = engine_config.model
        if mc.dtype == "auto":  # resolved once, here: every worker runs one dtype (KV moves between them)
            self.engine_kwargs["dtype"] = dtype_name("auto", mc.device, 4 * self.engine.arch.num_params())
        self.transport_tag = str(os.getpid())  # this cluster's shared-memory segments are tidal-kv-<pid>-*
        self.transport = build_transport(cluster.transport, self.transport_tag)
        self.backend = self._make_backend()
        if cluster.transport == "shm" and not self.backend.single_machine:
            self.backend.shutdown()
            raise ConfigError("--kv-transport shm moves KV only between processes of one machine, and the Ray "
                              "cluster has several: use --kv-transport ray")
        self.ctx = zmq.Context()
        tag = uuid.uuid4().hex[:10]
        self._ipc_dir = tempfile.mkdtemp(prefix=f"tidal-{tag}-")
        self.out = self.ctx.socket(zmq.PULL)
        self.out_address = self._bind(self.out, "out")
        self.cmd_socks, self.cmd_addresses = [], []
        for i in range(n):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            self.cmd_socks.append(s)
            self.cmd_addresses.append(self._bind(s, f"cmd{i}"))
        self.handles: list[Any] = [None] * n
        self.generation = [0] * n
        empty = [InstanceStatus(i, 1, 1, 16) for i in range(n)]
        self.monitor = GlobalMonitor(empty, self.layout.roles())
        for rec in self.monitor.instances:
            rec.alive = False  # until its worker says ready
        self.dispatcher = Dispatcher(self.layout, self.monitor, build_router(cluster.router))
        # --mode split (or a given planner): DynaServe's coordinator (else None)
        self.split = SplitCoordinator(self, splitter) if splitter is not None or self.layout.split else None
        self.kv_bytes_moved = 0
        self.weights: list[str | None] = [None] * n  # what each worker runs (its ready message says)
        self.requests: dict[str, Tracked] = {}  # by the client's request id
        self.by_wid: dict[str, Tracked] = {}  # by the id its current run has on the workers (Tracked.wid)
        self.outbox = Outbox()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.dead: BaseException | None = None
        self.num_failures = 0
        self.num_restarts = 0
        self.unready_deaths = [0] * n  # per instance: deaths in a row before its ready message
        self.num_failovers = 0
        self._t0 = time.monotonic()

    @property
    def splitter(self) -> Any:
        """The split planner (Alg. 1) with ``--mode split``, else None."""
        return self.split.planner if self.split is not None else None

    @property
    def splits(self) -> deque[dict[str, Any]]:
        """The latest split decisions (``/admin/splits``)."""
        return self.split.log if self.split is not None else deque()

    # ---------------------------------------------------------------- setup
    def _bind(self, sock: Any, name: str) -> str:
        if self.cluster.backend == "ray":  # actors may run on other machines of the Ray cluster
            host = self.backend.control_host
            port = sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        addr = f"ipc://{os.path.join(self._ipc_dir, name)}"
        sock.bind(addr)
        return addr

    def _pressure(self) -> Any:
        from tidal.cluster.pressure import check_pressure_mode
        from tidal.config import ConfigError

        mode = self.cluster.kv_pressure
        try:
            check_pressure_mode(mode, self.layout.instances, self.engine.arch.num_layers, self.layout.mode != "colocate")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if mode == "migrate":  # the Llumnix-like baseline
            from tidal.runtime.migrate import MigrateCoordinator

            return MigrateCoordinator(self)
        if mode != "drop":
            return None
        from tidal.runtime.pressure import DropCoordinator, model_memory

        mc = self.config.model
        dtype_bytes = {"float32": 4}.get(dtype_name(mc.dtype, mc.device, 4 * self.engine.arch.num_params()), 2)
        return DropCoordinator(self, model_memory(self.engine.arch, dtype_bytes))

    def _make_backend(self) -> Any:
        from tidal.runtime.backend import ProcessBackend, RayBackend

        if self.cluster.backend == "ray":
            return RayBackend(self.cluster.ray_address)
        return ProcessBackend()

    def role_kwargs(self, role: str) -> dict[str, Any]:
        """The engine arguments of an instance of ``role``: its own policy and policy arguments."""
        sched = role_scheduler(self.config.scheduler, role, self.cluster.prefill_batching)
        return {**self.engine_kwargs, "batching": sched.batching, "policy_args": dict(sched.policy_args)}

    def _worker_config(self, i: int) -> WorkerConfig:
        role = self.layout.roles()[i]
        return WorkerConfig(i, role, self.role_kwargs(role), self.threads, self.cmd_addresses[i],
                            self.out_address, self.cluster.transport, self.cluster.layers_per_chunk,
                            self.cluster.tokens_per_chunk, self.generation[i], transport_tag=self.transport_tag)

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ---------------------------------------------------------------- lifecycle (AsyncLLM's interface)
    def start(self) -> None:
        if self._thread is not None:
            return
        n = self.layout.instances
        t0 = time.perf_counter()
        where = "worker N engine" if self.cluster.backend != "ray" else "in Ray's logs: log_to_driver is off"
        startup_line(f"starting {n} instances (their own start-up lines: {where}) ...")
        for i in range(n):
            self.handles[i] = self.backend.start(self._worker_config(i))
        self._thread = threading.Thread(target=self._io_loop, name="tidal-cluster-io", daemon=True)
        self._thread.start()
        ready = self.wait_ready()
        if ready and self.dead is None:
            startup_line(f"{n} instances ready in {time.perf_counter() - t0:.1f} s")
            return
        # a worker could not start (_on_worker_death said why), or the time ran out: stop what did
        self.shutdown()
        raise self.dead or EngineDeadError(f"the instances did not all start within {self.cluster.start_timeout_s:.0f} s")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every instance reported ready once (or ``timeout``)."""
        return self._ready.wait(timeout if timeout is not None else self.cluster.start_timeout_s)

    def shutdown(self) -> None:
        self._stop.set()
        self.outbox.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        for i, h in enumerate(self.handles):
            if h is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.cmd_socks[i].send(pickle.dumps(("shutdown",)), zmq.NOBLOCK)
        for h in self.handles:
            if h is not None:
                h.join(10)
        with self._lock:
            for t in self.requests.values():
                self._release_handoff(t)
        for s in (*self.cmd_socks, self.out):
            s.close(0)
        self.ctx.term()
        self.backend.shutdown()
        self.outbox.close()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._ipc_dir):
                os.unlink(os.path.join(self._ipc_dir, name))
            os.rmdir(self._ipc_dir)

    @property
    def is_running(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive() and \
            any(r.alive for r in self.monitor.instances)

    # ---------------------------------------------------------------- API
    async def generate(self, prompt: str | list[int] | None, params: SamplingParams, request_id: str | None = None,
                       *, prompt_token_ids: list[int] | None = None, priority: int = 0,
                       request_class: str = "online") -> AsyncIterator[RequestOutput]:
        from tidal.core.scheduler import RequestRejected

        if self.dead is not None:
            raise EngineDeadError(f"the cluster front end has stopped: {self.dead}")
        if prompt_token_ids is None:
            prompt_token_ids = (self.engine.tokenizer.encode(prompt) if isinstance(prompt, str)
                                else list(prompt or []))
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        rid = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        t = Tracked(rid, list(prompt_token_ids), params, priority, request_class, asyncio.get_running_loop(), q)
        max_q = self.config.scheduler.max_queued_requests
        with self._lock:
            if not self._admit(max_q):
                raise QueueFullError(f"the server's waiting queue is full ({max_q} requests); retry later")
            if rid in self.requests or rid in self.by_wid:
                raise RequestRejected(f"request id {rid!r} is already in use")
            self.requests[rid] = t
            self.by_wid[rid] = t
            if not self._place(t, fresh=True):
                del self.requests[rid], self.by_wid[rid]
                raise EngineDeadError("no serving instance is alive")
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def _admit(self, max_q: int | None) -> bool:
        """The queue bound over the instances (under the lock): their backlog, plus the hand-offs
        waiting for a decode instance, must stay within ``max_q`` counting the new request."""
        cap = self.config.scheduler.max_num_seqs
        live = [r for r in self.monitor.instances if r.alive]
        entry = [r.admission_load(cap) for r in live if r.routable and r.role != "decode"]
        return admit([r.admission_load(cap) for r in live], max_q, len(self.monitor.pending_handoffs), entry)

    def abort(self, request_id: str) -> None:
        with self._lock:
            t = self.requests.pop(request_id, None)
            if t is None:
                return
            self.by_wid.pop(t.wid, None)
            self._end_move(t)
            for i in {t.instance, *(() if t.handoff is None else (t.handoff.src, t.handoff.dst))}:
                if i is not None and i >= 0:
                    self._send(i, ("abort", t.wid))
                    self.monitor.on_finish(i, request_id)
            self._drop_handoff(t)
            if self.splitter is not None:
                self.splitter.on_finish(request_id, None)

    @property
    def stats(self) -> dict[str, Any]:
        with self._lock:
            inst = self.monitor.instances
            # a group's KV is its head's pool (a tail's pool mirrors it): count routable instances
            total = sum(r.num_blocks for r in inst if r.routable)
            free = sum(r.num_free_blocks for r in inst if r.routable)
            return {
                "num_requests_running": sum(r.status.num_running for r in inst if r.alive),
                "num_requests_waiting": sum(r.status.num_waiting for r in inst if r.alive)
                + len(self.monitor.pending_handoffs),
                "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
                "num_kv_blocks": total, "num_free_kv_blocks": free,
                "num_preemptions": sum(r.status.num_preemptions for r in inst),
                "instance_failures": self.num_failures, "instance_restarts": self.num_restarts,
                "failovers": self.num_failovers,
                "splits": self.split.num_splits if self.split is not None else 0, "kv_bytes_moved": self.kv_bytes_moved,
                "cluster": {"mode": self.layout.mode, "router": self.cluster.router, "backend": self.cluster.backend,
                            "threads_per_instance": self.threads, "weights": list(self.weights),
                            **self.monitor.snapshot(self.now()),
                            **({"kv_pressure": self.pressure.snapshot()} if self.pressure is not None else {})},
            }

    # ---------------------------------------------------------------- placing requests (under the lock)
    def _place(self, t: Tracked, fresh: bool) -> bool:
        """Dispatch ``t`` to an instance: a new request, or a re-run from its streamed tokens."""
        if fresh and self.splitter is not None:
            placed = self.split.place(t)
            if placed is not None:
                return placed
        req = RouteRequest(t.rid, len(t.prompt_ids) + len(t.tokens), t.params.max_tokens or 0)
        i = self.dispatcher.dispatch(req, self.now())
        if i is None:
            return False
        t.instance = i
        if fresh:
            self._send(i, ("add", t.wid, t.prompt_ids, t.params, t.priority, t.request_class, None))
        else:
            snap = RequestSnapshot(t.wid, None, list(t.prompt_ids), list(t.tokens), t.params, 0, {}, t.priority,
                                   t.request_class, text_sent=t.text_sent)
            self._send(i, ("import", snap, False))
        return True

    def _failover(self, t: Tracked) -> None:
        self._end_move(t)
        self._drop_handoff(t)
        if self.splitter is not None:
            self.splitter.on_finish(t.rid, None)  # its planned parts are void; it runs whole now
        # a new id on the workers: outputs of the old run still in flight from a live instance (one
        # that was told to abort it) must not reach the client twice
        self.by_wid.pop(t.wid, None)
        t.wid = f"{t.rid}~{t.failovers + 1}"
        self.by_wid[t.wid] = t
        if t.params.n > 1 or not self._place(t, fresh=not t.tokens and t.text_sent == 0):
            self._deliver(t, EngineDeadError("the instance serving this request failed and no other can take it"
                                             if t.params.n == 1 else "an instance failed under an n > 1 request"))
            self.requests.pop(t.rid, None)
            self.by_wid.pop(t.wid, None)
            return
        t.failovers += 1
        self.num_failovers += 1

    def _end_move(self, t: Tracked) -> None:
        if self.pressure is not None:
            self.pressure.forget(t)  # a migration of ``t`` in flight: its reservation goes

    def _drop_handoff(self, t: Tracked) -> None:
        """Forget ``t``'s hand-off: its reservation on the target, and the chunks in flight."""
        h = t.handoff
        if h is not None and h.dst is not None:
            self.monitor.on_handoff(t.rid, h.src, h.dst, ok=False)
        self._release_handoff(t)
        t.handoff = None

    def _release_handoff(self, t: Tracked) -> None:
        if t.handoff is not None:
            for h in t.handoff.handles:
                self.transport.release(h)
            t.handoff.handles.clear()

    def _try_handoff(self, t: Tracked) -> None:
        h = t.handoff
        if h is None or h.dst is not None:
            return
        dst = self.pressure.target(t.wid) if self.pressure is not None else None  # a migration's own target
        if dst is None:
            dst = self.dispatcher.choose_decode(t.rid, h.blocks, self.now())
        if dst is None:
            return  # waits, visible in the monitor's pending hand-offs
        h.dst = dst
        self._send(dst, ("import", h.meta, True))
        for k, handle in enumerate(h.handles):
            self._send(dst, ("kv", t.wid, handle, k == h.num_chunks - 1))

    # ---------------------------------------------------------------- I/O thread
    def _send(self, i: int, msg: tuple) -> None:
        self.outbox.put(i, msg)

    def _deliver(self, t: Tracked, item: Any) -> None:
        t.loop.call_soon_threadsafe(t.queue.put_nowait, item)

    def _alive(self, i: int) -> bool:
        h = self.handles[i]
        return h is not None and h.alive()

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.out, zmq.POLLIN)
        poller.register(self.outbox.wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                sentinels = {h.sentinel: i for i, h in enumerate(self.handles) if h is not None and h.sentinel}
                for fd in sentinels:
                    poller.register(fd, zmq.POLLIN)
                events = dict(poller.poll(500))
                for fd in sentinels:
                    poller.unregister(fd)
                if self.outbox.wake_r in events:
                    self.outbox.clear_wakeups()
                with self._lock:
                    self.outbox.flush(self.cmd_socks, self._alive)
                while True:
                    try:
                        raw = self.out.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._on_message(pickle.loads(raw))
                with self._lock:
                    for fd, i in sentinels.items():
                        if fd in events or not self.handles[i].alive():
                            self._on_worker_death(i, "the worker process exited")
                    for i, h in enumerate(self.handles):  # Ray actors have no sentinel
                        if h is not None and h.sentinel is None and not h.alive():
                            self._on_worker_death(i, "the worker actor died")
        except BaseException as e:  # a bug here must not hang every stream
            log.exception("cluster I/O loop failed")
            self.dead = e
            with self._lock:
                for t in self.requests.values():
                    self._deliver(t, EngineDeadError(f"cluster front end failed: {e}"))

    def _on_message(self, msg: tuple) -> None:
        i, gen, kind, *rest = msg
        if gen != self.generation[i]:
            return  # from a worker that has since died
        now = self.now()
        if kind == "ready":
            self.weights[i] = rest[1]
            if self.pressure is not None and hasattr(self.pressure, "on_layer_bytes"):
                self.pressure.on_layer_bytes(rest[2])
            self.unready_deaths[i] = 0
            rec = self.monitor.instances[i]
            if rec.failures:
                self.monitor.on_restart(rest[0], now)
                if self.splitter is not None:
                    self.splitter.on_restart(i)
            else:
                self.monitor.on_status(rest[0], now)
                rec.alive = True
            if all(r.alive for r in self.monitor.instances):
                self._ready.set()
        elif kind in ("out", "idle"):
            if kind == "out":
                for out in rest[0]:
                    self._on_output(i, out)
            self.monitor.on_status(rest[-1], now)
            if self.split is not None:
                self.split.record_step(rest[-1])
            for t in list(self.requests.values()):
                if t.handoff is not None and t.handoff.dst is None:
                    self._try_handoff(t)
            if self.pressure is not None:
                self.pressure.tick(now)
        elif kind == "grouped" and self.pressure is not None:  # KunServe: a drop took effect on worker i
            self.pressure.on_grouped(i, *rest, now)
        elif kind == "exchange_done" and self.pressure is not None:
            self.pressure.on_exchange_done(i, *rest, now)
        elif kind == "ungrouped" and self.pressure is not None:
            self.pressure.on_ungrouped(i, *rest, now)
        elif kind == "restored" and self.pressure is not None:
            self.pressure.on_restored(i, *rest, now)
        elif kind == "rejected":
            rid, message, param = rest
            t = self.by_wid.pop(rid, None)
            if t is not None:
                self.requests.pop(t.rid, None)
                self.monitor.on_finish(i, t.rid)
                from tidal.core.scheduler import RequestRejected

                self._deliver(t, RequestRejected(message, param=param))
        elif kind == "handoff":
            rid, meta, blocks, nchunks = rest
            t = self.by_wid.get(rid)
            if t is None:
                return
            t.handoff = Handoff(i, meta, blocks, nchunks)
            self._try_handoff(t)
        elif kind == "kv":
            rid, handle, last = rest
            t = self.by_wid.get(rid)
            if t is None or t.handoff is None:
                self.transport.release(handle)  # aborted meanwhile
                return
            t.handoff.handles.append(handle)
            self.kv_bytes_moved += handle.nbytes
            if t.split_log is not None:
                t.split_log["kv_bytes"] += handle.nbytes
            if t.handoff.dst is not None:
                self._send(t.handoff.dst, ("kv", rid, handle, last))
        elif kind == "split_done":
            self.split.on_split_done(i, *rest)
        elif kind == "landed":
            t = self.by_wid.get(rest[0])
            if t is not None and t.handoff is not None:
                if self.pressure is not None and self.pressure.target(t.wid) == i:
                    self.pressure.on_landed(t, i)  # a migration
                else:
                    self.monitor.on_handoff(t.rid, t.handoff.src, i, ok=True)
                t.instance, t.handoff = i, None  # the decode worker released the chunks it read
        elif kind == "refused":
            t = self.by_wid.get(rest[0])
            if t is not None and t.handoff is not None and t.handoff.split is not None and t.handoff.dst == i:
                self.split.unsplit(t)
            elif t is not None and t.handoff is not None and t.handoff.dst == i and self.pressure is not None \
                    and self.pressure.target(t.wid) == i:
                self.pressure.on_refused(t, i)
            elif t is not None and t.handoff is not None and t.handoff.dst == i:
                self.monitor.on_handoff(t.rid, t.handoff.src, i, ok=False)
                t.handoff.dst = None  # retried when an instance reports room
            elif t is not None:  # a fail-over import found no room here: try again elsewhere
                self.monitor.on_finish(i, t.rid)
                self._failover(t)
        elif kind == "unmoved" and self.pressure is not None:  # a migration the source could not start
            t = self.by_wid.get(rest[0])
            if t is not None:
                self.pressure.on_unmoved(t)
        elif kind == "fatal":
            log.error("worker %d failed: %s\n%s", i, rest[0], rest[1])

    def _on_output(self, i: int, out: RequestOutput) -> None:
        t = self.by_wid.get(out.request_id)
        if t is None:
            return
        if out.request_id != t.rid:  # a re-run after a fail-over: the client knows the first id
            out = dataclasses.replace(out, request_id=t.rid)
        c = out.outputs[0]
        if len(out.outputs) == 1:
            t.tokens.extend(c.delta_token_ids)
            t.text_sent += len(c.delta_text)
            if self.splitter is not None and c.delta_token_ids:
                self.splitter.on_progress(i, t.rid, decoded=len(c.delta_token_ids))
        if out.finished:
            t.finished = True
            self.requests.pop(t.rid, None)
            self.by_wid.pop(t.wid, None)
            self.monitor.on_finish(i, t.rid)
            self._end_move(t)
            h = t.handoff
            if h is not None and h.split is not None:  # alpha finished before its split point
                self._send(h.dst, ("abort", t.wid))
                self._drop_handoff(t)
            if self.splitter is not None:
                self.splitter.on_finish(t.rid, len(t.tokens) if len(out.outputs) == 1 else None)
        self._deliver(t, out)

    def _on_worker_death(self, i: int, why: str) -> None:
        if not self.monitor.instances[i].alive and self.handles[i] is None:
            return
        log.warning("instance %d died (%s); re-running its requests elsewhere", i, why)
        if not self.monitor.instances[i].alive:
            self.unready_deaths[i] += 1
        self.num_failures += 1
        if self.pressure is not None:  # KunServe Sec. 4.4: its pipeline group dissolves
            self.pressure.on_failure(i, self.now())
        lost = self.monitor.on_failure(i)
        if self.splitter is not None:
            self.splitter.on_failure(i)
        self.handles[i].join(1)
        self.handles[i] = None
        self.generation[i] += 1
        affected = [t for t in self.requests.values()
                    if t.rid in lost or t.instance == i
                    or (t.handoff is not None and i in (t.handoff.src, t.handoff.dst))]
        for t in affected:
            if t.handoff is not None:  # a hand-off touching the dead instance: recompute instead
                for j in (t.handoff.src, t.handoff.dst):
                    if j is not None and j != i:
                        self._send(j, ("abort", t.wid))
                        self.monitor.on_finish(j, t.rid)
            self._failover(t)
        if self.unready_deaths[i] >= START_ATTEMPTS:  # it cannot start (its error is in the log above)
            log.error("instance %d died %d times before it was ready; not restarting it", i, self.unready_deaths[i])
            if not self._ready.is_set():  # the cluster is starting: start() fails with this
                self.dead = EngineDeadError(f"instance {i} died {self.unready_deaths[i]} times before it was ready "
                                            f"({why}); its error is in the log above")
                self._ready.set()
        elif self.cluster.restart and not self._stop.is_set():
            self.handles[i] = self.backend.start(self._worker_config(i))
            self.num_restarts += 1


__all__ = ["ClusterConfig", "ClusterLLM"]
