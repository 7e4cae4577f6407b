"""Engine streams of one HTTP request, server-sent events, and client-disconnect handling.

The lifetime rule: whatever way a request ends (finished, client gone, server error), every
engine stream it opened is closed, and closing an unfinished AsyncLLM stream aborts the request so
its KV blocks are free before the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tidal.core.sampling import SamplingParams
from tidal.engine.outputs import RequestOutput
from tidal.server.errors import ServerShuttingDown
from tidal.server.metrics import RequestTracker, ServerMetrics

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def run_watched(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (then raise ClientDisconnected).

    The body has been read already, so the next ASGI message can only be ``http.disconnect``.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gone.set()
                task.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if gone.is_set():
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()


class EventStreamResponse(StreamingResponse):
    """SSE response that always watches for the client going away and always closes its body
    iterator (whose ``finally`` closes the engine streams), instead of leaving that to the GC."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[Any]] | None = None,
                 **kw: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(kw.pop("headers", None) or {})}
        super().__init__(content, headers=headers, **kw)
        # also run when the body never started (the client left first): closing a generator that
        # never ran does not run its ``finally``
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the connection broke while sending
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()


class Drain:
    """The requests being answered, so that a shutdown can end them cleanly: :meth:`begin` (called
    when the server stops accepting connections, before it waits for the open ones) makes every live
    stream end with an error event and ``[DONE]``, and refuses new requests with 503."""

    def __init__(self) -> None:
        self.stopping = False
        self.live: weakref.WeakSet[EngineStreams] = weakref.WeakSet()  # never what keeps one alive

    def begin(self) -> None:
        self.stopping = True
        for s in list(self.live):
            s.interrupt(ServerShuttingDown("the server is shutting down; retry the request"))


@dataclass
class PromptInput:
    text: str | None  # None when the prompt came as token ids
    token_ids: list[int]
    params: SamplingParams | None = None  # its own, when they differ from the request's (fitted to the context)


class EngineStreams:
    """One AsyncLLM stream per prompt of a request, started together and iterated as one."""

    def __init__(self, llm: Any, metrics: ServerMetrics, start_time: float, drain: Drain | None = None):
        self.llm = llm
        self.metrics = metrics
        self.start_time = start_time
        self.drain = drain
        self._q: asyncio.Queue | None = None  # outputs of every live stream, while iterating
        self._interrupt: BaseException | None = None
        self.gens: list[AsyncIterator[RequestOutput]] = []
        self.trackers: list[RequestTracker] = []
        self.firsts: list[RequestOutput] = []
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    async def start(self, prompts: list[PromptInput], params: SamplingParams, base_id: str,
                    priority: int, request_class: str) -> None:
        """Submit every prompt and wait for each one's first output: a full queue, a rejected
        prompt or a dead engine raise here, before any response has been started."""
        if self.drain is not None:
            if self.drain.stopping:
                raise ServerShuttingDown("the server is shutting down; retry the request")
            self.drain.live.add(self)
        for i, p in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            self.gens.append(self.llm.generate(p.text, p.params or params, rid, prompt_token_ids=p.token_ids,
                                               priority=priority, request_class=request_class))
            self.trackers.append(self.metrics.tracker(self.start_time))
        try:
            results = await asyncio.gather(*(g.__anext__() for g in self.gens), return_exceptions=True)
        except asyncio.CancelledError:  # the client went away before the first output: an abort
            for tr in self.trackers:
                tr.num_choices = params.n
            await self.aclose(count=True)  # closing the engine streams aborts their requests
            raise
        except BaseException:
            await self.aclose(count=False)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.aclose(count=False)
            first = errors[0]
            if isinstance(first, StopAsyncIteration):
                raise RuntimeError("the engine ended a request without output")
            raise first
        self.firsts = list(results)  # type: ignore[arg-type]
        for tr, out, p in zip(self.trackers, self.firsts, prompts, strict=True):
            tr.accepted(len(p.token_ids), params.n)
            tr.observe(out)

    def interrupt(self, exc: BaseException) -> None:
        """End the iteration with ``exc`` (from the event loop's thread)."""
        self._interrupt = exc
        if self._q is not None:
            self._q.put_nowait((-1, exc))

    async def iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs, the first outputs included, until every stream finished
        (or :meth:`interrupt` ends it: the exception is raised here)."""
        for i, out in enumerate(self.firsts):
            yield i, out
        live = [i for i, out in enumerate(self.firsts) if not out.finished]
        if not live:
            return
        q: asyncio.Queue = asyncio.Queue()
        self._q = q
        if self._interrupt is not None:
            raise self._interrupt

        async def pump(i: int) -> None:
            try:
                async for out in self.gens[i]:
                    q.put_nowait((i, out))
                q.put_nowait((i, None))
            except Exception as e:
                q.put_nowait((i, e))

        self._tasks = [asyncio.create_task(pump(i)) for i in live]
        remaining = len(live)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                self.trackers[i].observe(item)
                yield i, item

    async def aclose(self, count: bool = True) -> None:
        """Close every engine stream (aborting unfinished requests); idempotent.

        The synchronous part comes first: this may run inside a cancelled anyio scope (the client
        went away mid-stream), where any await can be interrupted. Cancelling a pump task aborts
        its engine request by itself (the CancelledError runs the engine stream's ``finally``)."""
        if self._closed:
            return
        self._closed = True
        if self.drain is not None:
            self.drain.live.discard(self)
        for t in self._tasks:
            t.cancel()
        if count:
            for tr in self.trackers:
                tr.close()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for g in self.gens:
            with contextlib.suppress(Exception):  # already closed
                await g.aclose()  # type: ignore[attr-defined]
