"""The sockets of a KunServe pipeline group (KunServe Sec. 4.1-4.3): one ZeroMQ PAIR link between
the group's head and each of its other stages, and the head's :class:`HubStageLink`.

A link carries small pickled metadata plus, for activations, the hidden states as raw bytes
(never a pickled tensor); KV goes through the KV transport (shared memory) and only its handles
cross a link. The stages never talk to each other: the head relays each microbatch's hidden
states from stage ``j`` to stage ``j + 1`` the moment they arrive, so with two microbatches in
flight every stage works while the others do (Sec. 4.3's overlap), at the price of one extra hop
of a few KB per microbatch and stage.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from tidal.engine.stage import ChunkMeta, chunk_meta

log = logging.getLogger("tidal.worker")
PEER_TIMEOUT_S = 120.0  # a peer that says nothing this long is gone (the front end sees its death)
WATCH_S = 0.5  # how often a member waiting on its peer checks that the peer's process lives


class PeerLost(RuntimeError):
    """A member of the group died (Sec. 4.4: the survivors restore their layers)."""


class PeerLink:
    """One PAIR socket between the group's head and one of its stages."""

    def __init__(self, ctx: Any, address: str, bind: bool, peer_pid: int | None = None):
        import zmq

        self.zmq, self.peer_pid = zmq, peer_pid
        self._checked = time.monotonic()
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if bind else self.sock.connect)(address)
        self.backlog: deque[tuple[tuple, torch.Tensor | None]] = deque()  # read while waiting for something else

    def _writable(self) -> None:
        """A PAIR socket blocks a send while no peer is connected: wait in slices, watching the
        peer's process (a dead peer raises :class:`PeerLost` instead of hanging the worker)."""
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while not self.sock.poll(int(1000 * WATCH_S), self.zmq.POLLOUT):
            self.check_peer()
            if time.monotonic() > deadline:
                raise PeerLost(f"the group's peer took no message for {PEER_TIMEOUT_S:.0f} s")

    def send(self, msg: tuple, tensor: torch.Tensor | None = None) -> None:
        self._writable()
        if tensor is None:
            self.sock.send(pickle.dumps((msg, None), protocol=pickle.HIGHEST_PROTOCOL))
            return
        t = tensor.detach().contiguous()
        meta = pickle.dumps((msg, (tuple(t.shape), str(t.dtype).removeprefix("torch."))))
        self.sock.send_multipart([meta, memoryview(t.view(torch.uint8).numpy())], copy=False)

    def check_peer(self, now: float | None = None) -> None:
        """Raise :class:`PeerLost` when the peer's process is gone (a local worker; checked at most
        every ``WATCH_S``)."""
        now = time.monotonic() if now is None else now
        if self.peer_pid is None or now - self._checked < WATCH_S:
            return
        self._checked = now
        try:
            os.kill(self.peer_pid, 0)
        except ProcessLookupError:
            raise PeerLost(f"the group's peer (pid {self.peer_pid}) is gone") from None
        except PermissionError:
            pass

    def recv(self, timeout_s: float | None) -> tuple[tuple, torch.Tensor | None] | None:
        if self.backlog:
            return self.backlog.popleft()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # in slices, watching the peer's process meanwhile
            wait = WATCH_S if deadline is None else min(WATCH_S, max(0.0, deadline - time.monotonic()))
            if self.sock.poll(int(1000 * wait)):
                break
            self.check_peer()
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return self._read()

    def wait_for(self, kind: str, timeout_s: float = PEER_TIMEOUT_S) -> tuple[tuple, torch.Tensor | None]:
        """The next message of ``kind``; others read meanwhile wait in the backlog, in order."""
        held: list = []
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                got = self.recv(max(0.0, deadline - time.monotonic()))
                if got is None:
                    raise RuntimeError(f"the group's peer sent no {kind!r} within {timeout_s:.0f} s")
                if got[0][0] == kind:
                    return got
                held.append(got)
        finally:
            self.backlog.extendleft(reversed(held))

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger_ms)


    def take(self, kind: str) -> tuple[tuple, torch.Tensor | None] | None:
        """The first message of ``kind`` already read or waiting on the socket, without blocking;
        the others read meanwhile go to the backlog, in order."""
        for k, got in enumerate(self.backlog):
            if got[0][0] == kind:
                del self.backlog[k]
                return got
        while self.sock.poll(0):
            got = self._read()
            if got[0][0] == kind:
                return got
            self.backlog.append(got)
        return None

    def _read(self) -> tuple[tuple, torch.Tensor | None]:
        frames = self.sock.recv_multipart()
        msg, spec = pickle.loads(frames[0])
        if spec is None:
            return msg, None
        shape, dtype = spec
        raw = torch.frombuffer(bytearray(frames[1]), dtype=torch.uint8)
        return msg, raw.view(getattr(torch, dtype)).view(shape)


class HubStageLink:
    """The head's :class:`~tidal.engine.stage.StageLink` to stages ``1 .. n-1`` in other processes
    (one :class:`PeerLink` each, in stage order). ``send`` puts a microbatch on the wire to stage 1
    and returns, so the head computes the next one meanwhile (Sec. 4.3's microbatches); while the
    head waits in ``recv`` it relays every stage's output to the next stage as it comes, and
    returns when the last stage's output for the asked microbatch is here."""

    def __init__(self, links: Sequence[PeerLink]):
        import zmq

        self.links = list(links)
        self.meta: dict[tuple[int, int], list[ChunkMeta]] = {}
        self.done: dict[tuple[int, int], torch.Tensor] = {}
        self.poller = zmq.Poller()
        for link in self.links:
            self.poller.register(link.sock, zmq.POLLIN)

    def send(self, step_id: int, index: int, h: torch.Tensor, chunks: Sequence[Any]) -> None:
        meta = self.meta[(step_id, index)] = chunk_meta(chunks)
        self.links[0].send(("act", step_id, index, meta), h)

    def recv(self, step_id: int, index: int) -> torch.Tensor:
        key = (step_id, index)
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while key not in self.done:
            if not self._relay():
                self.poller.poll(int(1000 * WATCH_S))
                for link in self.links:
                    link.check_peer()
                if time.monotonic() > deadline:
                    raise PeerLost(f"no stage answered microbatch {key} within {PEER_TIMEOUT_S:.0f} s")
        del self.meta[key]
        return self.done.pop(key)

    def _relay(self) -> bool:
        """Move every output that arrived one stage on; False when none had."""
        moved = False
        for j, link in enumerate(self.links):
            while (got := link.take("act_out")) is not None:
                moved = True
                (_, step_id, index), t = got[0], got[1]
                key = (step_id, index)
                if key not in self.meta or t is None:
                    log.warning("dropping an unexpected activation %s from stage %d", key, j + 1)
                elif j + 1 < len(self.links):
                    self.links[j + 1].send(("act", step_id, index, self.meta[key]), t)
                else:
                    self.done[key] = t
        return moved


__all__ = ["PEER_TIMEOUT_S", "WATCH_S", "HubStageLink", "PeerLink", "PeerLost"]
