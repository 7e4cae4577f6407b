"""The front end's commands to its workers: queued by any thread, sent by the I/O thread.

A ZeroMQ PUSH socket with no worker connected (one that died, or one still starting) blocks a
send, and with it the lock the sender holds: so the outbox never blocks. A command for a dead
worker is dropped (its failure handling covers its requests); one for a live worker that cannot
take it yet waits, with every later one for that worker, for the next flush. A pipe wakes the I/O
thread's poller when a command is queued.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from tidal.runtime.protocol import encode_command


class Outbox:
    def __init__(self) -> None:
        self.queue: deque[tuple[int, Any]] = deque()
        self.wake_r, self.wake_w = os.pipe()  # the I/O thread polls wake_r

    def put(self, i: int, msg: Any) -> None:
        """Queue the command ``msg`` (:mod:`tidal.runtime.protocol`) for worker ``i`` and wake the I/O thread."""
        self.queue.append((i, msg))
        self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")

    def clear_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self.wake_r, 4096)

    def flush(self, socks: Sequence[Any], alive: Callable[[int], bool]) -> None:
        """Send what the sockets take now, without blocking; ``alive(i)``: worker ``i`` still runs."""
        held, waiting = set(), deque()
        while self.queue:
            i, msg = self.queue.popleft()
            if i in held:
                waiting.append((i, msg))
                continue
            try:
                socks[i].send(encode_command(msg), zmq.NOBLOCK)
            except zmq.Again:
                if alive(i):
                    held.add(i)
                    waiting.append((i, msg))
            except zmq.ZMQError:
                pass
        self.queue.extend(waiting)

    def close(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
