"""ClusterLLM: N engine workers behind one front end with AsyncLLM's interface.

The HTTP server talks to it exactly as to :class:`tidal.engine.async_engine.AsyncLLM`
(``generate`` streams, ``stats``, ``engine`` for the tokenizer and config). Inside:

- the pure :class:`~tidal.cluster.dispatch.Dispatcher` and
  :class:`~tidal.cluster.monitor.GlobalMonitor` pick an instance per request and, when
  disaggregated, the decode instance of each hand-off (the simulator drives the same objects);
- one I/O thread owns the ZeroMQ sockets: it sends the commands queued by the event loop
  (the typed messages of :mod:`tidal.runtime.protocol`), receives every worker's replies, each
  handled by its type's handler here, and routes them to the request streams, forwards KV chunk
  handles from prefill to decode workers, and watches the workers' process sentinels;
- with ``--mode split`` (DynaServe), a split planner picks a pair of instances and a split point
  per request: the alpha member computes the first ``s`` tokens of KV and streams them, chunk by
  chunk as it computes, to the beta member, which holds a reservation and continues the request;
- when a worker dies, its requests are re-run on the live instances from their prompt plus the
  tokens already streamed (recompute), their streams continue, and the worker is restarted.
  The survivors cover for a role nobody alive holds (:class:`~tidal.cluster.dispatch.Dispatcher`:
  P/D degrades to colocated, a split runs whole on a live instance). When no instance at all can
  take a re-run it waits (*parked*) until one is back, up to ``start_timeout_s``; a new request
  meanwhile is refused with :class:`InstanceUnavailableError` (the server's 503 with
  ``Retry-After``), never an internal error. A worker that fails otherwise (an exception other
  than a client's rejection: ``Fatal``) is handled the same way.

The coordinators of ``--kv-pressure`` and ``--mode split`` see this front end through the narrow
:class:`tidal.runtime.front.Front` protocol (``send``, ``failover``, ``recompute``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import zmq

from tidal.cluster.config import ServingConfig
from tidal.cluster.dispatch import Dispatcher
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.cluster.moves import MoveDeadlines, MoveRecord
from tidal.cluster.router import RouteRequest, build_router
from tidal.common.progress import startup_line
from tidal.config import ConfigError, default_cpu_threads
from tidal.core.admission import admit
from tidal.core.block_hash import block_hashes
from tidal.core.sampling import SamplingParams
from tidal.engine.async_engine import EngineDeadError, InstanceUnavailableError, QueueFullError
from tidal.engine.llm_engine import RequestSnapshot, dtype_name
from tidal.engine.outputs import RequestOutput
from tidal.runtime import protocol as P
from tidal.runtime.failover import START_ATTEMPTS, FailoverFront
from tidal.runtime.handoffs import HandoffFront
from tidal.runtime.kv_transfer import build_transport, unlink_segments
from tidal.runtime.outbox import Outbox
from tidal.runtime.records import ClusterConfig, FrontEngine, Tracked
from tidal.runtime.split_front import SplitCoordinator
from tidal.runtime.step_log import StepLog
from tidal.runtime.worker import WorkerConfig

MOVE_LOG = 4096  # the latest moves kept (ClusterLLM.move_records)
log = logging.getLogger("tidal.cluster")


class ClusterLLM(FailoverFront, HandoffFront):
    def __init__(self, config: ServingConfig, *, splitter: Any = None):
        """``config``: the whole tree, validated when it was built (each role's policy, the
        pressure mode against the layout); only what needs the model's shape is checked here."""
        engine_config, cluster = config.engine, config.cluster
        self.serving, self.config, self.cluster = config, engine_config, cluster
        from tidal.engine.loader import load_checkpoint

        checkpoint = load_checkpoint(engine_config.model.model)  # its metadata: the shape, before the tokenizer
        config.check_model(checkpoint.arch.num_layers)
        self.engine = FrontEngine(engine_config, checkpoint)
        self.layout = cluster.layout
        mc = engine_config.model
        # resolved once, here: every worker runs one dtype (KV moves between them)
        self.dtype = dtype_name(mc.dtype, mc.device, 4 * self.engine.arch.num_params())
        self.pressure = self._pressure()  # --kv-pressure migrate / drop: its coordinator (else None)
        n = self.layout.instances
        self.threads = cluster.threads_per_instance or max(1, default_cpu_threads() // n)
        # this cluster's shared-memory segments are tidal-kv-<pid>-<tag>-* (one name space per cluster)
        self.transport_tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.transport = build_transport(cluster.transport, self.transport_tag)
        self.backend = self._make_backend()
        if cluster.transport == "shm" and not self.backend.single_machine:
            self.backend.shutdown()
            raise ConfigError("--kv-transport shm moves KV only between processes of one machine, and the Ray "
                              "cluster has several: use --kv-transport ray")
        if cluster.kv_pressure in ("drop", "auto") and not self.backend.single_machine:
            self.backend.shutdown()  # (KunServe's members stream activations and KV over local sockets)
            raise ConfigError(f"--kv-pressure {cluster.kv_pressure} links a pipeline group's members over sockets of one machine, "
                              "and the Ray cluster has several: use --kv-pressure migrate or preempt")
        self._step_log = StepLog(cluster.step_log) if cluster.step_log else None
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
        router = build_router(cluster.router)
        self.monitor = GlobalMonitor(empty, self.layout.roles(), learn_steps=router.uses_cache)
        for rec in self.monitor.instances:
            rec.alive = False  # until its worker says ready
        self.dispatcher = Dispatcher(self.layout, self.monitor, router)
        # --mode split (or a given planner): DynaServe's coordinator (else None)
        self.split = SplitCoordinator(self, splitter) if splitter is not None or self.layout.split else None
        self.kv_bytes_moved = 0
        d = cluster.move_timeout_s  # every step of a move has this long (tidal.cluster.moves)
        self.move_deadlines = MoveDeadlines(reserve_s=d, transfer_s=d, free_s=d)
        self.moves_ended: dict[str, int] = {}
        self.move_records: deque[MoveRecord] = deque(maxlen=MOVE_LOG)
        self.weights: list[str | None] = [None] * n  # what each worker runs (its ready message says)
        self.nodes: list[str | None] = [None] * n  # where each runs (a Ray node's id, or the host's name)
        self.hosts: list[str | None] = [None] * n  # the host's name each runs on
        self.pids: list[int | None] = [None] * n
        self.requests: dict[str, Tracked] = {}  # by the client's request id
        self.by_wid: dict[str, Tracked] = {}  # by the id its current run has on the workers (Tracked.wid)
        # re-runs no live instance could take (every one that could is down): placed when one is back
        self.parked: dict[str, tuple[Tracked, float]] = {}  # by the client's request id: (request, since)
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
        self._replies = self._reply_table()  # reply type -> its handler (run by the I/O thread)

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
        from tidal.runtime.pressure import build_coordinator

        return build_coordinator(self.cluster.kv_pressure, self, self.dtype)

    def _make_backend(self) -> Any:
        from tidal.runtime.backend import ProcessBackend, RayBackend

        if self.cluster.backend == "ray":
            c = self.cluster
            return RayBackend(c.ray_address, num_instances=self.layout.instances, placement=c.ray_placement,
                              num_gpus_per_worker=c.num_gpus_per_instance)
        return ProcessBackend()

    def _worker_config(self, i: int) -> WorkerConfig:
        role = self.layout.roles()[i]
        dtype = self.dtype if self.config.model.dtype == "auto" else self.config.model.dtype
        engine = self.serving.engine_for(role, i, dtype=dtype, num_threads=self.threads)
        return WorkerConfig(i, role, engine, self.cmd_addresses[i],
                            self.out_address, self.cluster.transport, self.cluster.layers_per_chunk,
                            self.cluster.tokens_per_chunk, self.generation[i], transport_tag=self.transport_tag,
                            report_cache=self.cache_routing)

    @property
    def cache_routing(self) -> bool:
        """``--router cache-aware`` with prefix caching: the workers report their cached blocks and the
        front end places requests by the monitor's cache views."""
        return self.cluster.router == "cache-aware" and self.config.cache.enable_prefix_caching

    def now(self) -> float:
        return time.monotonic() - self._t0

    # ---------------------------------------------------------------- lifecycle (AsyncLLM's interface)
    def start(self) -> None:
        if self._thread is not None:
            return
        n = self.layout.instances
        t0 = time.perf_counter()
        where = "worker N engine" + (", forwarded from Ray's actors" if self.cluster.backend == "ray" else "")
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
                    self.cmd_socks[i].send(P.encode_command(P.Shutdown()), zmq.NOBLOCK)
        for h in self.handles:
            if h is not None:
                h.join(10)
        with self._lock:
            for t in self.requests.values():
                self._release_handoff(t)
        unlink_segments(f"tidal-kv-{self.transport_tag}-")  # chunks no receiver read (a worker died first)
        for s in (*self.cmd_socks, self.out):
            s.close(0)
        self.ctx.term()
        self.backend.shutdown()
        self.outbox.close()
        if self._step_log is not None:
            self._step_log.close()
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
        t = Tracked(rid, list(prompt_token_ids), params, priority, request_class, asyncio.get_running_loop(), q,
                    arrival_s=self.now())
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
                raise InstanceUnavailableError(self._unavailable())
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
        waiting for a decode instance and the parked re-runs, must stay within ``max_q`` counting
        the new request."""
        cap = self.config.scheduler.max_num_seqs
        live = [r for r in self.monitor.instances if r.alive]
        entry = [r.admission_load(cap) for r in live if r.routable and r.role != "decode"]
        return admit([r.admission_load(cap) for r in live], max_q,
                     len(self.monitor.pending_handoffs) + len(self.parked), entry)

    def _unavailable(self) -> str:
        dead = [r.index for r in self.monitor.instances if not r.alive]
        return (f"no instance can serve the request right now (instance{'s' if len(dead) != 1 else ''} "
                f"{', '.join(map(str, dead))} down{', restarting' if self.cluster.restart else ''}); retry shortly")

    def abort(self, request_id: str) -> None:
        with self._lock:
            t = self.requests.pop(request_id, None)
            if t is None:
                return
            self.by_wid.pop(t.wid, None)
            self.parked.pop(request_id, None)
            for i in {t.instance, *(() if t.handoff is None else (t.handoff.src, t.handoff.dst))}:
                if i is not None and i >= 0:
                    self.send(i, P.Abort(t.wid))
                    self.monitor.on_finish(i, request_id)
            self.drop_handoff(t)
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
                + len(self.monitor.pending_handoffs) + len(self.parked),
                "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
                "num_kv_blocks": total, "num_free_kv_blocks": free,
                "num_preemptions": sum(r.status.num_preemptions for r in inst),
                "prefix_caching": self.engine.config.cache.enable_prefix_caching,
                **{f"prefix_cache_{k}": sum(getattr(r.status, f"prefix_{k}", 0) for r in inst)
                   for k in ("queries", "hits", "host_hits")},
                "num_cached_kv_blocks": sum(r.status.num_cached_blocks for r in inst if r.routable),
                "num_swap_preemptions": sum(r.status.num_swap_preemptions for r in inst),
                "num_swap_fallbacks": sum(r.status.num_swap_fallbacks for r in inst),
                "kv_reused_tokens": sum(getattr(r.status, "kv_reused_tokens", 0) for r in inst),
                "instance_failures": self.num_failures, "instance_restarts": self.num_restarts,
                "failovers": self.num_failovers, "parked": len(self.parked), "moves_ended": dict(self.moves_ended),
                "splits": self.split.num_splits if self.split is not None else 0, "kv_bytes_moved": self.kv_bytes_moved,
                "cluster": {"mode": self.layout.mode, "router": self.cluster.router, "backend": self.cluster.backend,
                            "threads_per_instance": self.threads, "weights": list(self.weights),
                            **self._snapshot(),
                            **({"kv_pressure": self.pressure.snapshot()} if self.pressure is not None else {})},
            }

    def _snapshot(self) -> dict[str, Any]:
        """The monitor's view, each instance with where its worker runs (node, pid)."""
        snap = self.monitor.snapshot(self.now())
        for d in snap["instances"]:
            i = d["index"]
            d["node"], d["host"], d["pid"] = self.nodes[i], self.hosts[i], self.pids[i]
        return snap

    # ---------------------------------------------------------------- placing requests (under the lock)
    def _place(self, t: Tracked, fresh: bool) -> bool:
        """Dispatch ``t`` to an instance: a new request, or a re-run from its streamed tokens."""
        if fresh and self.splitter is not None:
            placed = self.split.place(t)
            if placed is not None:
                return placed
        names = ()
        if self.cache_routing:  # where its prefix lives
            names = tuple(block_hashes(t.prompt_ids + t.tokens, self.config.cache.block_size, t.params.cache_salt))
        req = RouteRequest(t.rid, len(t.prompt_ids) + len(t.tokens), t.params.max_tokens or 0, names)
        i = self.dispatcher.dispatch(req, self.now())
        if i is None:
            return False
        t.instance = i
        # a prefill instance while no decode instance is alive: it runs the request whole (P/D degrades)
        whole = self.layout.disaggregated and self.monitor.instances[i].role == "prefill" and \
            self.dispatcher.runs_whole(i)
        if fresh:
            self.send(i, P.Add(t.wid, t.prompt_ids, t.params, t.priority, t.request_class, whole=whole))
        else:
            snap = RequestSnapshot(t.wid, None, list(t.prompt_ids), list(t.tokens), t.params, 0, {}, t.priority,
                                   t.request_class, text_sent=t.text_sent, age_s=self.now() - t.arrival_s)
            self.send(i, P.Import(snap, False, whole=whole))
        return True

    # ---------------------------------------------------------------- the coordinators' view (tidal.runtime.front)
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def reset_prefix_cache(self) -> int:
        """Every live instance forgets its cached prefix blocks (each between its steps). Returns
        how many instances were told."""
        from tidal.runtime import protocol as P

        with self._lock:
            alive = [r.index for r in self.monitor.instances if r.alive]
        for i in alive:
            self.send(i, P.ResetPrefixCache())
        return len(alive)

    def send(self, i: int, cmd: Any) -> None:
        """Queue a command for worker ``i`` (sent by the I/O thread)."""
        self.outbox.put(i, cmd)

    def group_address(self, name: str) -> str:
        return f"ipc://{os.path.join(self._ipc_dir, name)}"

    def worker_pid(self, i: int) -> int | None:
        h = self.handles[i]
        return None if h is None else h.pid

    # ---------------------------------------------------------------- I/O thread
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
                        self._on_reply(*P.decode_reply(raw))
                with self._lock:
                    self.tick_moves(self.now())  # deadlines pass with no report too
                    if self.parked:
                        self._unpark(self.now())
                    for fd, i in sentinels.items():
                        h = self.handles[i]  # a Fatal reply may have replaced (or removed) it already
                        if h is not None and h.sentinel == fd and (fd in events or not h.alive()):
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

    def _reply_table(self) -> dict[type, Any]:
        return {P.Ready: self._on_ready, P.Out: self._on_status, P.Idle: self._on_status,
                P.Grouped: self._on_pressure, P.ExchangeDone: self._on_pressure, P.Ungrouped: self._on_pressure,
                P.Restored: self._on_pressure, P.Rejected: self._on_rejected, P.HandoffStarted: self._on_handoff,
                P.KVChunk: self._on_kv, P.SplitDone: self._on_split_done, P.Landed: self._on_landed,
                P.Refused: self._on_refused, P.Unmoved: self._on_unmoved, P.Log: self._on_log, P.Fatal: self._on_fatal}

    def _on_reply(self, i: int, gen: int, reply: Any) -> None:
        if gen != self.generation[i]:
            return  # from a worker that has since died
        self._replies[type(reply)](i, reply, self.now())

    def _on_ready(self, i: int, r: P.Ready, now: float) -> None:
        self.weights[i] = r.weights
        self.nodes[i], self.hosts[i], self.pids[i] = r.node, r.host or None, r.pid
        if self.pressure is not None:
            self.pressure.on_layer_bytes(r.layer_bytes)
        self.unready_deaths[i] = 0
        rec = self.monitor.instances[i]
        if rec.failures:
            self.monitor.on_restart(r.status, now)
            if self.splitter is not None:
                self.splitter.on_restart(i)
        else:
            self.monitor.on_status(r.status, now)
            rec.alive = True
        if all(rec.alive for rec in self.monitor.instances):
            self._ready.set()
        if self.parked:
            self._unpark(now)

    def _on_log(self, i: int, r: P.Log, now: float) -> None:
        """A start-up line of a worker whose own output is not this process's stderr (a Ray actor)."""
        print(r.line, file=sys.stderr, flush=True)

    def _on_status(self, i: int, r: P.Out | P.Idle, now: float) -> None:
        if isinstance(r, P.Out):
            for out in r.outputs:
                self._on_output(i, out)
        self.monitor.on_status(r.status, now)
        if self._step_log is not None and r.status.step_time_s:
            self._step_log.write(i, r.status, self.monitor.instances[i], now)
        if self.split is not None:
            self.split.record_step(r.status)
        self.tick_moves(now)  # waiting hand-offs ask again; a move past its deadline falls back
        if self.pressure is not None:
            self.pressure.tick(now)

    def _on_pressure(self, i: int, r: Any, now: float) -> None:
        """KunServe's replies (a drop took effect, an exchange or a restore ended, a group left)."""
        if self.pressure is None:
            return
        if isinstance(r, P.Grouped):
            self.pressure.on_grouped(i, r.role, r.members, r.request_ids, r.num_blocks, r.layer_ids, now)
        elif isinstance(r, P.ExchangeDone):
            self.record_moves(r.moves)  # the exchange's moves, run on the group's head
            self.pressure.on_exchange_done(i, r.members, r.exchanged, r.moved, now)
        elif isinstance(r, P.Ungrouped):
            self.pressure.on_ungrouped(i, r.lost, r.num_blocks, now)
        else:
            self.pressure.on_restored(i, r.role, r.num_blocks, r.layer_ids, r.num_back, r.stats, now)

    def _on_rejected(self, i: int, r: P.Rejected, now: float) -> None:
        from tidal.core.scheduler import RequestRejected

        t = self.by_wid.pop(r.request_id, None)
        if t is not None:
            self.requests.pop(t.rid, None)
            self.monitor.on_finish(i, t.rid)
            self._deliver(t, RequestRejected(r.message, param=r.param))

    def _on_output(self, i: int, out: RequestOutput) -> None:
        t = self.by_wid.get(out.request_id)
        if t is None:
            return
        if out.request_id != t.rid:  # a re-run after a fail-over: the client knows the first id
            out = dataclasses.replace(out, request_id=t.rid)
        c = out.outputs[0]
        t.delivered = True
        if len(out.outputs) == 1:
            if not t.tokens and c.delta_token_ids and self.pressure is not None:
                self.pressure.on_first_token(t.rid, self.now())  # --kv-pressure auto learns from it
            t.tokens.extend(c.delta_token_ids)
            t.text_sent += len(c.delta_text)
            if self.splitter is not None and c.delta_token_ids:  # the part's totals, as the simulator reports them
                n = t.sampled_on[i] = t.sampled_on.get(i, 0) + len(c.delta_token_ids)
                self.splitter.on_progress(i, t.rid, decoded=n)
        if out.finished:
            t.finished = True
            self.requests.pop(t.rid, None)
            self.by_wid.pop(t.wid, None)
            self.monitor.on_finish(i, t.rid)
            h = t.handoff
            if h is not None:  # alpha finished before its split point: beta's reservation goes
                if h.dst is not None and h.dst != i:
                    self.send(h.dst, P.Abort(t.wid))
                self.drop_handoff(t)
            if self.splitter is not None:
                self.splitter.on_finish(t.rid, len(t.tokens) if len(out.outputs) == 1 else None)
        self._deliver(t, out)



__all__ = ["START_ATTEMPTS", "ClusterConfig", "ClusterLLM", "ServingConfig"]
