"""One engine instance in its own process (or Ray actor): commands in, outputs and status out.

The control path is ZeroMQ: the front end PUSHes commands to each worker's socket and PULLs
every worker's replies from one socket. Both are the typed messages of
:mod:`tidal.runtime.protocol` (one dataclass each, versioned frames); KV never travels on this
path, only :class:`tidal.runtime.kv_transfer.KVHandle`s naming the chunks. Each command has a
handler here (``on_<command>``, by type in :meth:`Worker.handle`); a client's
:class:`~tidal.core.scheduler.RequestRejected` is answered (``Rejected``, or ``Refused`` for an
import), any other exception is the worker's failure (``Fatal``, then it exits and the front end
re-runs its requests).

A prefill worker (BucketServe's disaggregation) pauses each request after its first token,
then writes one KV chunk per loop turn between its steps, so it keeps computing while the
chunks are in flight; after the last chunk it frees the request's blocks. An alpha part
(DynaServe Sec. 4.3) streams instead: after every step the KV of its newly computed tokens is
queued as chunks, so beta receives it while alpha computes on; at the split point the request
pauses, its last chunks go, then ``split_done``, and its blocks are freed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any

from tidal.common.progress import set_startup_label
from tidal.runtime import protocol as P
from tidal.runtime.kv_moves import KVMover, _Export

log = logging.getLogger("tidal.worker")


@dataclass(frozen=True)
class WorkerConfig:
    index: int
    role: str  # colocated | prefill | decode
    engine: Any  # EngineConfig: its role's, whole (tidal.cluster.config.ServingConfig.engine_for)
    cmd_address: str  # the worker PULLs its commands here
    out_address: str  # and PUSHes its messages here
    transport: str = "shm"
    layers_per_chunk: int = 8
    tokens_per_chunk: int = 0  # 0: a chunk spans all the request's tokens
    generation: int = 0  # restarts of this instance so far (tags its messages)
    mb_min_tokens: int = 16  # KunServe Fig. 11's MIN: a step of this many tokens or fewer is one microbatch
    transport_tag: str = ""  # the front end's: names its cluster's shared-memory KV segments
    env: dict[str, str] | None = None  # a local worker takes the front end's environment as it is now
    report_cache: bool = False  # put the block names its pools gain and lose in its step reports (cache-aware routing)


def instance_status(engine: Any, index: int, step_time_s: float | None = None) -> Any:
    from tidal.cluster.monitor import InstanceStatus
    from tidal.policies.profile_table import step_shape

    sched, kv = engine.scheduler, engine.kv_manager
    bs = kv.block_size
    queued = sched.queued_block_demand()
    p = d = 0
    ctx = prefix = 0.0
    sq: float | None = None
    plan = getattr(engine, "last_plan", None)
    if step_time_s is not None and plan is not None:  # with each chunk's own cached prefix (issue 39)
        p, prefix, sq, d, ctx = step_shape(plan.chunks)
    hol = sched.hol_block_demand()  # the simulator's definition too (a swapped head: its host blocks)
    return InstanceStatus(index, kv.num_blocks, kv.num_free_blocks, bs, sched.num_running, sched.num_waiting,
                          queued, step_time_s, sched.num_preemptions, hol, step_prefill_tokens=p,
                          step_decode_count=d, step_decode_context=ctx, step_prefill_prefix=prefix,
                          step_prefill_sq=sq, batching=engine.config.scheduler.batching,
                          batch_size_cap=sched.last_caps.max_num_seqs, token_budget=sched.last_caps.token_budget,
                          policy=engine.policy.state().to_dict(), prefix_queries=sched.prefix_queries,
                          prefix_hits=sched.prefix_hits, prefix_host_hits=sched.prefix_host_hits,
                          num_cached_blocks=kv.num_cached_blocks, queued_prefill_tokens=sched.queued_prefill_tokens(),
                          queued_prefill_position=sched.queued_prefill_position(),
                          cache_delta=kv.drain_delta() if kv.pool.log is not None else None,
                          num_swap_preemptions=sched.num_swap_preemptions, num_swap_fallbacks=sched.num_swap_fallbacks,
                          num_free_host_blocks=kv.host_pool.num_free, kv_reused_tokens=sched.kv_reused_tokens)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: send this process ``sig`` when its parent dies (a worker's parent is the forkserver,
    whose parent is the front end: each link dies with the one above), so no worker is ever orphaned.
    Also a ``preexec_fn``: the setting survives ``exec``."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent is already gone
            os._exit(1)


def in_ray_actor() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def node_name() -> str:
    """Where this worker runs: its Ray node's id in a Ray actor, else the host's name."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


class Worker(KVMover):
    def __init__(self, cfg: WorkerConfig):
        import zmq

        from tidal.engine.llm_engine import LLMEngine
        from tidal.runtime.kv_transfer import build_transport

        self.cfg = cfg
        self.ctx = zmq.Context()
        self.cmd = self.ctx.socket(zmq.PULL)
        self.cmd.connect(cfg.cmd_address)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.out.connect(cfg.out_address)
        if in_ray_actor():  # its stderr is Ray's log file: its start-up lines go to the front end's too
            from tidal.common.progress import set_startup_sink

            set_startup_sink(lambda line: self.send(P.Log(line)))
        try:
            self.engine = LLMEngine(cfg.engine)
        finally:
            from tidal.common.progress import set_startup_sink

            set_startup_sink(None)
        if cfg.report_cache:
            self.engine.kv_manager.track_names()
        from tidal.engine.loader import clear_cache

        clear_cache()  # a worker builds one engine: a per-process copy of the weights would only cost memory
        self.transport = build_transport(cfg.transport, cfg.transport_tag)
        self.exports: deque[_Export] = deque()
        self.handing_off: set[str] = set()
        self.kept: set[str] = set()  # a prefill instance's requests that run here to their end (no hand-off)
        self.importing: set[str] = set()  # paused imports whose KV chunks are still arriving
        # per import, the chunks (and a beta part's ``finish``) that arrived but wait for blocks,
        # in arrival order: an import holds blocks only for the KV that has landed
        self.waiting_kv: dict[str, deque] = {}
        self.head: Any = None  # KunServe: this worker heads a pipeline group (tidal.runtime.group)
        self.tail: Any = None  # or is the tail stage of one
        self.running = True
        self._handlers = self._handler_table()  # command type -> its handler
        self._io = [0.0, 0.0, 0, 0]  # since the last step report: import s, export s, chunks in, chunks out

    # ---------------------------------------------------------------- messages
    def send(self, reply: Any) -> None:
        from tidal.runtime.protocol import encode_reply

        self.out.send(encode_reply(self.cfg.index, self.cfg.generation, reply))

    def status(self, step_time_s: float | None = None) -> Any:
        st = instance_status(self.engine, self.cfg.index, step_time_s)
        if step_time_s is None or not any(self._io):
            return st
        io, self._io = self._io, [0.0, 0.0, 0, 0]  # a step report carries the KV moved since the last one
        return dataclasses.replace(st, import_s=io[0], export_s=io[1], chunks_in=io[2], chunks_out=io[3])

    def handle(self, cmd: Any) -> None:
        """Run one command (:mod:`tidal.runtime.protocol`). Only a client's
        :class:`~tidal.core.scheduler.RequestRejected` is answered here (``Rejected`` /
        ``Refused``); any other exception propagates: the worker fails (``Fatal``) and the front
        end counts it and re-runs its requests elsewhere."""
        self._handlers[type(cmd)](cmd)

    def _handler_table(self) -> dict[type, Any]:
        return {P.Add: self.on_add, P.Reserve: self.on_reserve, P.Finish: self.on_finish, P.Stay: self.on_stay,
                P.Abort: self.on_abort, P.Import: self.on_import, P.KVChunk: self.on_kv, P.Migrate: self.on_migrate,
                P.Group: self.on_group, P.Ungroup: lambda _: self.ungroup(), P.Restore: self.on_restore,
                P.Shutdown: self.on_shutdown, P.ResetPrefixCache: lambda _: self.engine.reset_prefix_cache(),
                P.Preemption: self.on_preemption}

    def on_add(self, cmd: Any) -> None:
        from tidal.core.scheduler import RequestRejected

        try:
            self.engine.add_request(cmd.request_id, None, cmd.params, prompt_token_ids=cmd.prompt_ids,
                                    priority=cmd.priority, request_class=cmd.request_class, pause_at=cmd.pause_at)
        except RequestRejected as err:
            self.send(P.Rejected(cmd.request_id, str(err), err.param))
            return
        if cmd.whole:
            self.kept.add(cmd.request_id)
        if cmd.pause_at is not None:
            self.exports.append(_Export(cmd.request_id, stream=True))

    def on_reserve(self, cmd: Any) -> None:
        from tidal.core.scheduler import RequestRejected

        try:
            self.engine.reserve_import(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.num_kv_tokens, cmd.priority,
                                       cmd.request_class, hold_tokens=0)
        except RequestRejected as err:
            self.send(P.Refused(cmd.request_id, str(err)))
            return
        self.importing.add(cmd.request_id)

    def on_finish(self, cmd: Any) -> None:
        if cmd.request_id in self.importing:
            self.waiting_kv.setdefault(cmd.request_id, deque()).append(cmd)
            self.land_arrived()

    def on_stay(self, cmd: Any) -> None:
        """The move fell back (its destination refused or died, or it timed out): the request runs
        on here. Its chunks already put are the front end's to release."""
        rid, e = cmd.request_id, self.engine
        if not e.num_sequences(rid):
            self.send(P.Refused(rid, "this instance let the request go already"))
            return
        for ex in list(self.exports):
            if ex.request_id == rid:
                self.exports.remove(ex)
        self.handing_off.discard(rid)
        self.kept.add(rid)  # a prefill instance hands it off no more: its decode runs here
        e.cancel_pause(rid)

    def on_abort(self, cmd: Any) -> None:
        rid = cmd.request_id
        self.engine.abort_request(rid)
        self.handing_off.discard(rid)
        self.kept.discard(rid)
        self.importing.discard(rid)
        self.waiting_kv.pop(rid, None)  # their handles are the front end's to release
        for ex in list(self.exports):
            if ex.request_id == rid:
                self.exports.remove(ex)
        if self.head is not None:
            self.head.forget(rid)

    def on_import(self, cmd: Any) -> None:
        from tidal.core.scheduler import RequestRejected

        try:
            self.engine.import_request(cmd.snapshot, paused=cmd.paused)
        except RequestRejected as err:
            self.send(P.Refused(cmd.snapshot.request_id, str(err)))
            return
        if cmd.paused:
            self.importing.add(cmd.snapshot.request_id)
        if cmd.whole:
            self.kept.add(cmd.snapshot.request_id)

    def on_kv(self, cmd: Any) -> None:
        if cmd.request_id not in self.importing:
            return  # not ours (refused or aborted): the front end still owns the handle
        self.waiting_kv.setdefault(cmd.request_id, deque()).append(cmd)
        self.land_arrived()

    def on_migrate(self, cmd: Any) -> None:
        self.migrate(cmd.request_id)

    def on_preemption(self, cmd: Any) -> None:
        """``--kv-pressure auto`` chose recompute or swap for this instance (a swap without host room recomputes)."""
        self.engine.scheduler.preemption_mode = cmd.mode

    def on_group(self, cmd: Any) -> None:
        """KunServe Sec. 4.1-4.2: become the head or a stage of a pipeline group."""
        from tidal.runtime.group import GroupHead, GroupTail
        from tidal.runtime.peer import PeerLost

        spec, e = cmd.spec, self.engine
        e.scheduler.recompute_swapped()  # their host copies would lack the layers the group's other stages hold
        try:
            pieces = self.leave_group()
            if spec.head == self.cfg.index:
                self.head = GroupHead(self, spec, pieces)
                self.send(P.Grouped("head", spec.members, self.head.moved, e.transfer.num_blocks, e.transfer.layer_ids))
            else:
                self.tail = GroupTail(self, spec, pieces)
                self.send(P.Grouped("tail", spec.members, self.tail.lost, e.transfer.num_blocks, e.transfer.layer_ids))
        except PeerLost:
            self.ungroup()
            return
        self.send(P.Idle(self.status()))

    def on_restore(self, cmd: Any) -> None:
        """KunServe Sec. 4.4: the pressure is gone; overlapped with serving."""

        if self.head is None or not self.head.begin_restore():
            e = self.engine
            self.send(P.Restored("refused", e.transfer.num_blocks, e.transfer.layer_ids))

    def on_shutdown(self, cmd: Any) -> None:
        self.running = False

    def leave_group(self) -> dict:
        """Before joining a new group (Fig. 6 merges groups): a head collapses its group (its
        stages' KV of its running requests comes back: returned, by request); a stage serves its
        head until released. Nothing to do for an instance that ran alone."""
        pieces = {}
        if self.head is not None:
            pieces, self.head = self.head.collapse(), None
        elif self.tail is not None:
            self.tail.until_handover()
            self.tail = None
        return pieces

    def ungroup(self) -> None:
        """KunServe Sec. 4.4's fault tolerance: a member of the group is gone. Every request
        here lost its KV of the other members' layers: abort them (``ungrouped`` names them; the front end
        re-runs them from their streamed tokens); restore the dropped layers from the host copy
        and serve alone. A no-op when this worker is not (or no longer) in a group."""
        e = self.engine
        g = self.head or self.tail
        if g is None and not e.dropped_weight_bytes:
            return
        lost = e.request_ids()
        e.abort_request(lost)
        self.waiting_kv.clear()  # their chunks' handles are the front end's to release
        self.importing.clear()
        if self.head is not None:
            for rid in {q[1] for q in self.head.queue}:
                self.head.forget(rid)
            self.head.release_pending()
        e.set_stage_link(None)
        if g is not None:
            g.close()
        self.head = self.tail = None
        if e.dropped_weight_bytes:
            e.restore_layers(sorted(e.dropped_weight_bytes))
        self.send(P.Ungrouped(lost, e.transfer.num_blocks))
        self.send(P.Idle(self.status()))

    def run(self) -> None:
        import zmq

        from tidal.runtime.peer import PeerLost

        self.send(P.Ready(self.status(), self.engine.describe_weights(), self.engine.model.layer_weight_bytes(),
                          node_name(), os.getpid(), socket.gethostname()))
        poller = zmq.Poller()
        poller.register(self.cmd, zmq.POLLIN)
        while self.running:
            try:
                self._turn(poller)
            except PeerLost as err:
                log.warning("%s: restoring the dropped layers and serving alone", err)
                self.ungroup()

    def _turn(self, poller: Any) -> None:
        """One turn of the loop: commands, one KV chunk, one step (or, on a tail, the head's work)."""
        import zmq

        e = self.engine
        if self.tail is not None:  # a tail stage: the head's activations and KV, and our commands
            self.tail.serve(0.02)
            if self.tail.dissolved:  # Sec. 4.4: reload the head's layers from the checkpoint, serve alone
                self.tail.close()
                self.tail = None
                e.restore_layers(sorted(e.dropped_weight_bytes))
                self.send(P.Restored("tail", e.transfer.num_blocks, e.transfer.layer_ids))
                self.send(P.Idle(self.status()))
                return
            if poller.poll(0):
                self.handle(P.decode_command(self.cmd.recv()))
            return
        busy = (e.has_runnable_requests() or any(x.ready for x in self.exports)
                or (self.head is not None and self.head.busy))
        if poller.poll(0 if busy else 100 if self.head is None else 20):  # a head also polls its tail's answers
            while True:
                try:
                    raw = self.cmd.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.handle(P.decode_command(raw))
                if not self.running:
                    return
        if self.exports:
            self.write_chunks()
        if self.head is not None:
            self.head.pump()
        if e.has_runnable_requests():
            self.step()
        elif self.waiting_kv and not self.exports:
            self.land_arrived()
            if self.waiting_kv and not e.has_runnable_requests():
                self.refuse_stuck_import()
        elif not busy:
            self.send(P.Idle(self.status()))
        if self.head is not None and self.head.restoring is not None:
            self.advance_restore()

    def advance_restore(self) -> None:
        """One piece of an overlapped restore (a staged layer), or its end: the group dissolved."""
        e = self.engine
        done = self.head.advance_restore()
        if done is None:
            return
        if done:
            self.send(P.Restored("head", e.transfer.num_blocks, e.transfer.layer_ids, self.head.num_back,
                                 self.head.restore_stats))
            self.head = None
        else:
            self.send(P.Restored("refused", e.transfer.num_blocks, e.transfer.layer_ids))
        self.send(P.Idle(self.status()))

    def step(self) -> None:
        """One engine step, then what follows it: hand-offs to start, alpha parts' KV to queue,
        arrived imports that may fit now, and the outputs with the instance's status."""
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        if self.kept:
            self.kept.difference_update(o.request_id for o in outs if o.finished)
        if self.cfg.role == "prefill":
            self.start_handoffs(outs)
        if any(x.stream for x in self.exports):
            self.stream_splits()
        if self.waiting_kv:
            self.land_arrived()  # the step may have freed blocks
        self.send(P.Out(outs, self.status(dt)))

    def close(self) -> None:
        if self.head is not None:
            self.head.release_pending()
        for g in (self.head, self.tail):
            if g is not None:
                g.close()
        # chunks of unfinished hand-offs that were already put are the front end's to release (it holds
        # their handles); the ones not yet put never existed
        self.cmd.close(0)
        self.out.close()
        self.ctx.term()


def worker_main(cfg: WorkerConfig) -> None:
    """Entry point of a worker process."""
    die_with_parent()
    if cfg.env is not None:  # forked from the forkserver: the environment as the front end has it now
        os.environ.clear()
        os.environ.update(cfg.env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every stack to stderr
    if threading.current_thread() is threading.main_thread():  # (a Ray actor runs it on a pool thread)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when workers stop
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s worker {cfg.index} %(levelname)s: %(message)s")
    set_startup_label(f"worker {cfg.index} engine")  # its start-up lines (kernel build, weights, timings)
    worker = None
    try:
        worker = Worker(cfg)
        worker.run()
    except BaseException as e:  # noqa: BLE001 - report, then die: the front end restarts us
        if worker is not None:
            with contextlib.suppress(Exception):
                worker.send(P.Fatal(f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise
    finally:
        if worker is not None:
            worker.close()


__all__ = ["Worker", "WorkerConfig", "instance_status", "worker_main"]
