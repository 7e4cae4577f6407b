"""``tidal bench soak --chaos``: worker faults under load.

Every ``--chaos-interval`` seconds of the soak's arrivals, :class:`Chaos` SIGKILLs one worker of
the server (a process, or a Ray actor's process), picked at random among the live instances that
``/admin/state`` lists, and watches ``/admin/state`` until the instance is back (a new pid,
alive). It kills only processes under the server's own process tree on this machine (the server
says its pid and host), so it never touches anything else; a worker it cannot reach (a Ray
cluster's other node) is reported, not killed. At the end it says which of the killed processes
are still there (``processes_left``; a zombie counts: nobody reaped it).

The soak counts what the clients saw meanwhile: every request must be answered, or refused with
a 503 (or 429) that carries ``Retry-After`` and an OpenAI-style error body; a stream that was
accepted and then broke (an error event, no ``[DONE]``, a connection cut) is a *lost* stream.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time
from typing import Any


def process_state(pid: int) -> str | None:
    """``R``/``S``/``Z``... of a live (or zombie) process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (Linux ``/proc``; empty elsewhere)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            for c in kids:
                if c not in out:
                    out.add(c)
                    todo.append(c)
    return out


def victims(state: dict[str, Any], host: str) -> list[dict[str, Any]]:
    """The instances a kill may hit now: alive, with a worker pid on ``host`` (``/admin/state``'s
    ``cluster.instances``). A server of one instance (no cluster) has none: its engine runs in the
    server's own process."""
    insts = ((state.get("cluster") or {}).get("instances")) or []
    return [i for i in insts if i.get("alive") and i.get("pid") and (i.get("host") or host) == host]


class Chaos:
    """Kill a random live worker every ``interval`` seconds; watch each come back."""

    def __init__(self, get_state: Any, interval_s: float, rng: random.Random, t0: float, log: Any,
                 back_timeout_s: float = 300.0):
        self.get_state, self.interval, self.rng, self.t0, self.log = get_state, interval_s, rng, t0, log
        self.back_timeout_s = back_timeout_s
        self.host = socket.gethostname()
        self.kills: list[dict[str, Any]] = []
        self.skipped: dict[str, int] = {}
        self._watchers: list[asyncio.Task] = []

    def _skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: wait ``interval``, kill one worker."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
                return
            except asyncio.TimeoutError:
                pass
            await self.kill_one()

    async def kill_one(self) -> dict[str, Any] | None:
        state = await self.get_state()
        if state is None:
            self._skip("no /admin/state")
            return None
        server = state.get("pid")
        if not server or state.get("host") != self.host:
            self._skip("the server runs on another machine")
            return None
        live = victims(state, self.host)
        if not live:
            self._skip("no live worker to kill")
            return None
        inst = self.rng.choice(live)
        pid = int(inst["pid"])
        if pid not in descendants(int(server)):  # never anything but this server's own workers
            self._skip("the worker is not under the server's process tree")
            return None
        t = time.monotonic() - self.t0
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self._skip("the worker exited first")
            return None
        kill = {"t_s": round(t, 2), "instance": inst["index"], "role": inst.get("role"), "pid": pid,
                "back_after_s": None}
        self.kills.append(kill)
        print(f"[{t:6.1f}s] chaos: SIGKILL instance {inst['index']} ({inst.get('role')}, pid {pid})",
              file=self.log, flush=True)
        self._watchers.append(asyncio.create_task(self._watch_back(kill)))
        return kill

    async def _watch_back(self, kill: dict[str, Any]) -> None:
        """When the killed instance is alive again under a new pid."""
        start = time.monotonic()
        while time.monotonic() - start < self.back_timeout_s:
            await asyncio.sleep(0.25)
            st = await self.get_state()
            insts = ((st or {}).get("cluster") or {}).get("instances") or []
            rec = next((i for i in insts if i.get("index") == kill["instance"]), None)
            if rec is not None and rec.get("alive") and rec.get("pid") not in (None, kill["pid"]):
                kill["back_after_s"] = round(time.monotonic() - start, 2)
                return

    async def finish(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for every killed instance to be back."""
        if self._watchers:
            _, pending = await asyncio.wait(self._watchers, timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def report(self) -> dict[str, Any]:
        left = {k["pid"]: process_state(k["pid"]) for k in self.kills}
        backs = [k["back_after_s"] for k in self.kills if k["back_after_s"] is not None]
        return {
            "interval_s": self.interval, "kills": len(self.kills), "killed": self.kills,
            "skipped": dict(self.skipped),
            "not_back": sum(1 for k in self.kills if k["back_after_s"] is None),
            "back_after_s_max": max(backs) if backs else None,
            "back_after_s_mean": sum(backs) / len(backs) if backs else None,
            # a killed worker still there: running (it was not killed), or a zombie nobody reaped
            "processes_left": sum(1 for s in left.values() if s is not None),
            "processes_left_states": {str(p): s for p, s in left.items() if s is not None},
        }


__all__ = ["Chaos", "descendants", "process_state", "victims"]
