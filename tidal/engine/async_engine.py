"""AsyncLLM: the engine loop on its own thread, streams of outputs per request for asyncio.

The server awaits ``generate(...)``, an async iterator of :class:`RequestOutput` deltas, one per
engine step that touched the request. Closing the iterator early (a client that disconnects)
aborts the request, and its KV blocks are freed before the next step is planned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tidal.core.admission import InstanceLoad, admit
from tidal.core.sampling import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.outputs import RequestOutput

STEP_EMA = 0.2  # the weight of a new step time in the moving average (the cluster monitor's)

log = logging.getLogger("tidal.async")


class EngineDeadError(RuntimeError):
    """The engine loop failed; the server should report 500 and stop."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (``--max-queued-requests``)."""


class InstanceUnavailableError(RuntimeError):
    """A fault, not a bug: no instance that could serve the request is alive right now (one died
    and restarts). The server refuses with 503 and ``Retry-After``; a retry later succeeds."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine, step_hooks: list[Callable[[LLMEngine, list[RequestOutput]], None]] | None = None):
        self.engine = engine
        self.step_hooks = step_hooks or []
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self._step_ema: float | None = None
        self._stats: dict[str, Any] = {**engine.stats(), "step_time_ema_s": None}
        self._pending_adds = 0  # submitted, not yet handled by the engine thread
        self._fresh = 0  # added to the engine since its last step (waiting, but not refused a slot yet)
        self._declined = 0  # left waiting by the last step
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tidal-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._cmds.put(("wake", None, None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # ------------------------------------------------------------------ API
    async def generate(self, prompt: str | list[int] | None, params: SamplingParams,
                       request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       priority: int = 0, request_class: str = "online") -> AsyncIterator[RequestOutput]:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead}")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        max_q = self.engine.config.scheduler.max_queued_requests
        with self._lock:
            if not admit([self._load()], max_q):
                raise QueueFullError(f"the server's waiting queue is full ({max_q} requests); retry later")
            self._pending_adds += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._streams[rid] = (loop, q)
        self._cmds.put(("add", (rid, prompt, params, prompt_token_ids, priority, request_class), fut))
        finished = False
        try:
            await asyncio.wrap_future(fut)  # raises RequestRejected & co. from add_request
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the consumer went away (client disconnect) or failed: free it now
                self._cmds.put(("abort", rid, None))

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))

    def _load(self) -> InstanceLoad:
        """The engine's load as the queue bound sees it (under ``_lock``): requests on their way and
        those added since the last step have not been refused a slot yet, so they are not a backlog."""
        s = self._stats
        cap = s.get("batch_size_cap")
        cap = cap if isinstance(cap, int) else self.engine.config.scheduler.max_num_seqs
        return InstanceLoad(cap=cap, running=s["num_requests_running"],
                            declined=self._declined,
                            untried=self._fresh + self._pending_adds)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block, between steps. Returns 1 (the instances told)."""
        await self.call(lambda e: e.reset_prefix_cache())
        return 1

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (admin actions)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    # ------------------------------------------------------------------ engine thread
    def _handle(self, cmd: tuple) -> None:
        kind, arg, fut = cmd
        if kind == "add":
            rid, prompt, params, toks, priority, rclass = arg
            if not fut.set_running_or_notify_cancel():  # the caller gave up before we got here: skip it
                with self._lock:
                    self._pending_adds -= 1
                return
            try:
                self.engine.add_request(rid, prompt, params, prompt_token_ids=toks, priority=priority,
                                        request_class=rclass)
                added = True
            except BaseException as e:  # rejected: the caller gets the exception
                added = False
                fut.set_exception(e)
            with self._lock:
                self._pending_adds -= 1
                self._fresh += added
            if added:
                fut.set_result(None)
        elif kind == "abort":
            self.engine.abort_request(arg)
        elif kind == "call":
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(arg(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _deliver(self, out: RequestOutput | BaseException, rid: str) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished_requests()
            try:
                cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
                self._handle(cmd)
                while True:
                    self._handle(self._cmds.get_nowait())
            except queue.Empty:
                pass
            with self._lock:
                self._stats = {**self.engine.stats(), "step_time_ema_s": self._step_ema}
                if not self.engine.has_unfinished_requests():
                    self._declined = self._fresh = 0
            if not self.engine.has_unfinished_requests():
                continue
            try:
                t0 = time.perf_counter()
                outs = self.engine.step()
                dt = time.perf_counter() - t0
                # the step time's moving average (tidal:instance_step_time_seconds, as a cluster's monitor keeps it)
                self._step_ema = dt if self._step_ema is None else (1 - STEP_EMA) * self._step_ema + STEP_EMA * dt
            except BaseException as e:  # a bug or OOM: fail every stream, stop the loop
                log.exception("engine step failed")
                self.dead = e
                for rid in list(self._streams):
                    self._deliver(EngineDeadError(f"engine step failed: {e}"), rid)
                return
            # the snapshot first: a client that sees its request finish must not then find the
            # engine's load as it was before this step (the queue bound reads it)
            with self._lock:  # every request added so far has been through a step's admission
                self._stats = {**self.engine.stats(), "step_time_ema_s": self._step_ema}
                self._declined, self._fresh = self._stats["num_requests_waiting"], 0
            for out in outs:
                self._deliver(out, out.request_id)
            for hook in self.step_hooks:
                hook(self.engine, outs)
