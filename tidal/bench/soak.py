"""``tidal bench soak``: a bounded overload run that checks the server survives it intact.

It measures the server's capacity (a closed loop of short requests; or takes ``--capacity``),
then sends Poisson arrivals at ``--multiple`` (default 3) times that rate for ``--duration``
seconds: streamed and plain completions, with clients that disconnect (before the response, or
after the first chunk) and malformed requests mixed in, while ``/health`` is sampled every
``--health-interval``. When the server is idle again it reports requests completed, refused
(429/503), failed (any other status, a 5xx, a broken or unfinished stream, a malformed request
accepted), the KV blocks still in use (leaked: the server has nothing to run), the front end's
resident memory at start and end (``process_resident_memory_bytes`` of ``/metrics``) and every
``/health`` status. It prints progress lines and writes the JSON report; the exit code is 1
when anything failed, leaked or ``/health`` was ever not 200.

A refusal counts as one only with ``Retry-After`` and an OpenAI-style error body (else it is an
other error); a stream that was accepted and then broke is a *lost* stream. With ``--chaos``
(:mod:`tidal.bench.chaos`) a random worker of the server is SIGKILLed every
``--chaos-interval`` seconds of the arrivals: the run is clean when no request failed (none
lost, no other error: every one answered or refused with a retryable 503), no KV block leaked,
every killed worker is back and gone (``processes_left``), and ``/health`` answered 200 (or 503
while no instance was alive).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import aiohttp

from tidal.bench.chaos import Chaos, descendants
from tidal.bench.client import BenchError, normalize_base_url
from tidal.common import flags as F
from tidal.common.machine import machine_info
from tidal.common.results import command_line, run_command, write_json

PROG = "tidal bench soak"
DEFAULT_OUTPUT = os.path.join("results", "soak.json")
REFUSED = (429, 503)
LOST = "lost: "  # how a request that was accepted and then broke is labelled among the errors
WORDS = ("river", "stone", "light", "cloud", "market", "engine", "garden", "signal", "paper", "winter")

# (name, method, path, body bytes or JSON, content type): each must be refused with a 4xx
MALFORMED: tuple[tuple[str, str, str, Any, str], ...] = (
    ("invalid JSON", "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', "application/json"),
    ("JSON array body", "POST", "/v1/completions", b"[1, 2, 3]", "application/json"),
    ("no prompt", "POST", "/v1/completions", {"max_tokens": 4}, "application/json"),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, "application/json"),
    ("temperature as text", "POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, "application/json"),
    ("prompt as object", "POST", "/v1/completions", {"prompt": {"text": "hi"}}, "application/json"),
    ("n = 0", "POST", "/v1/completions", {"prompt": "hi", "n": 0}, "application/json"),
    ("unknown model", "POST", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}, "application/json"),
    ("chat without messages", "POST", "/v1/chat/completions", {"messages": []}, "application/json"),
    ("chat message without role", "POST", "/v1/chat/completions", {"messages": [{"content": "hi"}]},
     "application/json"),
    ("text/plain body", "POST", "/v1/completions", b"prompt=hi", "text/plain"),
    ("GET on a POST route", "GET", "/v1/completions", None, ""),
)


# ============================================================================ arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--capacity", type=F.positive_float, default=None,
                   help="the server's capacity in requests/s (default: measured by a closed loop first)")
    p.add_argument("--multiple", type=F.positive_float, default=3.0, help="arrival rate = multiple x capacity")
    p.add_argument("--duration", type=F.positive_float, default=60.0, help="seconds of arrivals")
    p.add_argument("--max-tokens", type=F.positive_int, default=16, help="max_tokens of every request")
    p.add_argument("--prompt-words", type=F.positive_int, default=24, help="longest prompt, in words")
    p.add_argument("--disconnect-fraction", type=float, default=0.15, help="requests whose client goes away")
    p.add_argument("--malformed-fraction", type=float, default=0.1, help="malformed requests (expect a 4xx)")
    p.add_argument("--measure-requests", type=F.positive_int, default=32,
                   help="requests of the capacity probe (a closed loop, as many at once as --max-num-seqs)")
    p.add_argument("--health-interval", type=F.positive_float, default=1.0, help="seconds between /health probes")
    p.add_argument("--progress-interval", type=F.positive_float, default=5.0, help="seconds between progress lines")
    p.add_argument("--request-timeout", type=F.positive_float, default=120.0, help="seconds one request may take")
    p.add_argument("--drain-timeout", type=F.positive_float, default=120.0,
                   help="seconds to wait for requests still running after the last arrival (then: failed)")
    p.add_argument("--idle-timeout", type=F.positive_float, default=60.0,
                   help="seconds to wait for the server to report nothing running before counting KV blocks")
    p.add_argument("--max-in-flight", type=F.positive_int, default=1024, help="client-side bound on open requests")
    p.add_argument("--chaos", action="store_true",
                   help="SIGKILL a random worker of the server (a process or a Ray actor) every --chaos-interval "
                        "seconds of the arrivals, and check every request is answered or refused with a 503")
    p.add_argument("--chaos-interval", type=F.positive_float, default=10.0, help="seconds between kills (--chaos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=DEFAULT_OUTPUT, help=f"JSON report (default {DEFAULT_OUTPUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("soak", help="overload soak: 3x capacity with disconnects and malformed requests; "
                                    "failures, leaked KV blocks, RSS, /health", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


# ============================================================================ the run
class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, model: str, log: Any = None):
        self.a, self.url, self.model, self.log = args, base_url, model, log or sys.stderr
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.health: list[tuple[float, int | str]] = []
        self.in_flight = 0
        self.t0 = time.monotonic()
        self.session: aiohttp.ClientSession | None = None
        self.probe: dict[str, int] = {}  # outcomes of the capacity probe's requests

    # ---------------------------------------------------------------- one request of each kind
    def _body(self, stream: bool) -> dict[str, Any]:
        n = self.rng.randint(1, self.a.prompt_words)
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(n))
        return {"model": self.model, "prompt": prompt, "max_tokens": self.a.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    def _fail(self, why: str) -> None:
        self.counts["failed"] += 1
        self.counts["lost" if why.startswith(LOST) else "other_errors"] += 1
        self.errors[why[:200]] += 1

    async def _refusal(self, r: aiohttp.ClientResponse) -> str:
        """A 429/503 is a refusal when it says when to retry and why (an OpenAI error body)."""
        body = await r.read()
        try:
            err = json.loads(body).get("error")
        except (ValueError, AttributeError):
            err = None
        if not isinstance(err, dict) or "message" not in err:
            return f"HTTP {r.status} without an OpenAI error body: {body[:80]!r}"
        if not r.headers.get("Retry-After"):
            return f"HTTP {r.status} without Retry-After ({err.get('code')})"
        return f"refused-{r.status}"

    async def normal(self, stream: bool) -> str:
        assert self.session is not None
        try:
            accepted = False
            async with self.session.post(f"{self.url}/v1/completions", json=self._body(stream)) as r:
                if r.status in REFUSED:
                    return await self._refusal(r)
                if r.status != 200:
                    return f"HTTP {r.status}: {(await r.text())[:120]}"
                accepted = True
                if not stream:
                    data = await r.json()
                    return "completed" if data.get("choices") and data.get("usage") else f"bad body {str(data)[:120]}"
                done = False
                async for line in r.content:
                    text = line.decode("utf-8", "replace").strip()
                    if text == "data: [DONE]":
                        done = True
                    elif text.startswith("data: ") and '"error"' in text[:40]:
                        return f"{LOST}error event in stream: {text[6:160]}"
                return "completed" if done else f"{LOST}stream ended without [DONE]"
        except asyncio.TimeoutError:
            return f"{LOST if accepted else ''}timed out"
        except aiohttp.ClientError as e:
            return f"{LOST if accepted and stream else ''}{type(e).__name__}: {e}"

    async def disconnect(self) -> str:
        """A streamed request whose client goes away: before the response (after 0-50 ms), or
        after the first chunk."""
        assert self.session is not None
        early = self.rng.random() < 0.5
        delay = self.rng.uniform(0.0, 0.05)

        async def go() -> str:
            async with self.session.post(f"{self.url}/v1/completions", json=self._body(True)) as r:
                if r.status in REFUSED:
                    return await self._refusal(r)
                if r.status != 200:
                    return f"HTTP {r.status}"
                async for _ in r.content:
                    break  # the first chunk: leave now (the context manager closes the connection)
                return "disconnected"

        try:
            if early:
                return await asyncio.wait_for(go(), delay) if delay > 0 else "disconnected"
            return await go()
        except asyncio.TimeoutError:
            return "disconnected"
        except aiohttp.ClientError as e:
            return f"{type(e).__name__}: {e}"

    async def malformed(self) -> str:
        assert self.session is not None
        name, method, path, body, ctype = self.rng.choice(MALFORMED)
        kw: dict[str, Any] = {}
        if isinstance(body, dict):
            kw["data"] = json.dumps(body).encode()
        elif body is not None:
            kw["data"] = body
        if ctype:
            kw["headers"] = {"Content-Type": ctype}
        try:
            async with self.session.request(method, f"{self.url}{path}", **kw) as r:
                if r.status in REFUSED:
                    return await self._refusal(r)
                await r.read()
                if 400 <= r.status < 500:
                    return "malformed_rejected"
                return f"malformed request ({name}) answered HTTP {r.status}"
        except aiohttp.ClientError as e:
            return f"{name}: {type(e).__name__}: {e}"

    async def one(self) -> None:
        self.in_flight += 1
        self.counts["sent"] += 1
        x = self.rng.random()
        try:
            if x < self.a.malformed_fraction:
                self.counts["malformed_sent"] += 1
                out = await self.malformed()
            elif x < self.a.malformed_fraction + self.a.disconnect_fraction:
                self.counts["disconnect_sent"] += 1
                out = await self.disconnect()
            else:
                out = await self.normal(stream=self.rng.random() < 0.75)
        finally:
            self.in_flight -= 1
        if out.startswith("refused-"):
            self.counts["refused"] += 1
            self.counts[out.replace("-", "_")] += 1
        elif out in ("completed", "disconnected", "malformed_rejected"):
            self.counts[out] += 1
        else:
            self._fail(out)

    # ---------------------------------------------------------------- probes
    async def get_json(self, path: str) -> dict[str, Any] | None:
        assert self.session is not None
        try:
            async with self.session.get(f"{self.url}{path}", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def rss(self) -> int | None:
        assert self.session is not None
        try:
            async with self.session.get(f"{self.url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        for line in text.splitlines():
            if line.startswith("process_resident_memory_bytes "):
                return int(float(line.split()[1]))
        return None

    async def health_loop(self, stop: asyncio.Event) -> None:
        assert self.session is not None
        while not stop.is_set():
            t = time.monotonic() - self.t0
            try:
                async with self.session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    await r.read()
                    self.health.append((round(t, 2), r.status))
            except asyncio.TimeoutError:
                self.health.append((round(t, 2), "timeout"))
            except aiohttp.ClientError as e:
                self.health.append((round(t, 2), type(e).__name__))
            with_timeout = asyncio.ensure_future(stop.wait())
            await asyncio.wait([with_timeout], timeout=self.a.health_interval)
            with_timeout.cancel()

    def progress(self, phase: str, kv: float | None = None) -> None:
        if self.a.no_progress:
            return
        c = self.counts
        bad = sum(1 for _, s in self.health if s != 200)
        print(f"[{time.monotonic() - self.t0:6.1f}s] {phase}: sent {c['sent']}  completed {c['completed']}  "
              f"refused {c['refused']}  failed {c['failed']} (lost {c['lost']})  disconnected {c['disconnected']}  "
              f"malformed->4xx {c['malformed_rejected']}  in flight {self.in_flight}  "
              f"health {len(self.health) - bad}/{len(self.health)} ok"
              + ("" if kv is None else f"  KV {100 * kv:.0f}%"), file=self.log, flush=True)

    async def measure_capacity(self, concurrency: int) -> float:
        """Completed requests per second of a closed loop of ``--measure-requests`` plain requests,
        ``concurrency`` at a time, after a warm-up round (not counted)."""
        # warm-up, one round at that concurrency: a fresh server's first steps of each batch shape are slower
        await asyncio.gather(*(self.normal(stream=False) for _ in range(concurrency)))
        left = self.a.measure_requests
        outcomes: Counter[str] = Counter()

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                out = await self.normal(stream=False)
                out = "refused" if out.startswith("refused-") else out
                outcomes[out if out in ("completed", "refused") else "failed"] += 1
                if out == "refused":  # a full queue is not the service rate: try that one again shortly
                    left += 1
                    await asyncio.sleep(0.2)
                if outcomes["refused"] + outcomes["failed"] > 4 * self.a.measure_requests:
                    return

        t = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t
        self.probe = dict(outcomes)
        if outcomes["completed"] == 0:
            raise BenchError(f"no request of the capacity probe completed at {self.url}: {dict(outcomes)}")
        return outcomes["completed"] / elapsed

    @staticmethod
    def activity(state: dict[str, Any] | None) -> dict[str, int]:
        """The server's counters of what it did (fail-overs, restarts, moves by outcome, hand-offs,
        splits, KV-pressure events), flat: a run's is the difference of two."""
        s = (state or {}).get("stats") or {}
        c = (state or {}).get("cluster") or s.get("cluster") or {}
        out = {k: s[k] for k in ("instance_failures", "instance_restarts", "failovers", "splits", "num_preemptions")
               if isinstance(s.get(k), int)}
        out.update({f"moves_{k}": v for k, v in (s.get("moves_ended") or {}).items()})
        if isinstance(c.get("num_handoffs"), int):
            out["handoffs"] = c["num_handoffs"]
        out.update({f"kv_pressure_{k}": v for k, v in ((c.get("kv_pressure") or {}).get("events_total") or {}).items()})
        return out

    @staticmethod
    def tree(state: dict[str, Any] | None) -> int | None:
        """Processes under the server (its workers, and a local Ray's), when it runs on this machine."""
        import socket

        if not state or not state.get("pid") or state.get("host") != socket.gethostname():
            return None
        return len(descendants(int(state["pid"])))

    async def wait_idle(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.a.idle_timeout
        while True:
            st = await self.get_json("/admin/state")
            s = (st or {}).get("stats", {})
            pending = ((st or {}).get("cluster") or {}).get("pending_handoffs", 0)
            if st is not None and s.get("num_requests_running") == 0 and s.get("num_requests_waiting") == 0 \
                    and not pending:
                return st
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.5)

    async def run(self) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.a.request_timeout, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as self.session:
            start_state = await self.get_json("/admin/state")
            if start_state is None:
                raise BenchError(f"GET {self.url}/admin/state failed: a tidal server is needed (KV blocks, state)")
            rss_start = await self.rss()
            stop_health = asyncio.Event()
            health_task = asyncio.create_task(self.health_loop(stop_health))
            capacity, measured = self.a.capacity, self.a.capacity is None
            if capacity is None:
                conc = min(int(start_state.get("scheduler", {}).get("max_num_seqs") or 8), self.a.measure_requests)
                capacity = await self.measure_capacity(conc)
                print(f"{PROG}: measured capacity {capacity:.3g} req/s ({self.a.measure_requests} requests, "
                      f"{conc} at a time, max_tokens {self.a.max_tokens}; {self.probe})", file=self.log, flush=True)
            rate = self.a.multiple * capacity
            print(f"{PROG}: {self.a.duration:g} s at {rate:.3g} req/s ({self.a.multiple:g} x capacity) against "
                  f"{self.url}, {self.a.disconnect_fraction:.0%} disconnects, {self.a.malformed_fraction:.0%} malformed"
                  + (f", a worker killed every {self.a.chaos_interval:g} s" if self.a.chaos else ""),
                  file=self.log, flush=True)
            tree_start = self.tree(start_state)
            chaos, stop_chaos, chaos_task = None, asyncio.Event(), None
            if self.a.chaos:
                chaos = Chaos(lambda: self.get_json("/admin/state"), self.a.chaos_interval,
                              random.Random(self.a.seed + 1), self.t0, self.log, self.a.idle_timeout)
                chaos_task = asyncio.create_task(chaos.run(stop_chaos))
            tasks: set[asyncio.Task] = set()
            t_start = time.monotonic()
            next_arrival, next_progress = t_start, t_start + self.a.progress_interval
            while (now := time.monotonic()) < t_start + self.a.duration:
                if now >= next_arrival:
                    if self.in_flight < self.a.max_in_flight:
                        task = asyncio.create_task(self.one())
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    else:
                        self.counts["not_sent"] += 1
                    next_arrival += self.rng.expovariate(rate)
                if now >= next_progress:
                    st = await self.get_json("/admin/state")
                    self.progress("load", (st or {}).get("stats", {}).get("kv_cache_usage_perc"))
                    next_progress += self.a.progress_interval
                await asyncio.sleep(max(0.0, min(next_arrival, next_progress) - time.monotonic()))
            arrivals_s = time.monotonic() - t_start
            stop_chaos.set()
            if chaos_task is not None:
                await chaos_task
            self.progress("arrivals done, draining")
            if tasks:
                _, pending = await asyncio.wait(set(tasks), timeout=self.a.drain_timeout)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for _ in pending:
                    self._fail(f"still running {self.a.drain_timeout:g} s after the last arrival")
            if chaos is not None:
                await chaos.finish(self.a.idle_timeout)  # every killed instance back, then idle
            idle = await self.wait_idle()
            tree_end = self.tree(idle or start_state)
            before, after = self.activity(start_state), self.activity(idle or await self.get_json("/admin/state"))
            activity = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
            stop_health.set()
            await health_task
            rss_end = await self.rss()
            self.progress("done")
        s = (idle or {}).get("stats", {})
        leaked = s["num_kv_blocks"] - s["num_free_kv_blocks"] if idle else None
        statuses = Counter(str(st) for _, st in self.health)
        c = self.counts
        ok_health = {"200", "503"} if self.a.chaos else {"200"}  # 503: no instance alive for a moment
        return {
            "base_url": self.url, "model": self.model,
            "capacity_rps": capacity, "capacity_measured": measured, "capacity_probe": self.probe,
            "multiple": self.a.multiple, "rate_rps": rate, "duration_s": arrivals_s,
            "sent": c["sent"], "completed": c["completed"], "refused": c["refused"], "failed": c["failed"],
            "refused_503": c["refused_503"], "refused_429": c["refused_429"], "lost_streams": c["lost"],
            "other_errors": c["other_errors"],
            "disconnected": c["disconnected"], "disconnects_sent": c["disconnect_sent"],
            "malformed_sent": c["malformed_sent"], "malformed_rejected": c["malformed_rejected"],
            "not_sent": c["not_sent"], "errors": dict(self.errors.most_common()),
            "idle": idle is not None, "leaked_kv_blocks": leaked, "kv_blocks_total": s.get("num_kv_blocks"),
            "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
            "health_samples": len(self.health), "health_statuses": dict(statuses),
            "health_always_200": bool(self.health) and set(statuses) == {"200"},
            "health_ok": bool(self.health) and set(statuses) <= ok_health,
            "processes_start": tree_start, "processes_end": tree_end, "server_activity": activity,
            **({"chaos": chaos.report()} if chaos is not None else {}),
            # a gap far above --health-interval: this client (or the whole machine) stalled, not only the server
            "health_max_gap_s": max((b[0] - a[0] for a, b in zip(self.health, self.health[1:], strict=False)),
                                    default=None),
            "health": self.health,
        }


def clean(r: dict[str, Any]) -> bool:
    chaos = r.get("chaos")
    if chaos is not None:
        return (r["failed"] == 0 and r["leaked_kv_blocks"] == 0 and r["health_ok"] and chaos["kills"] > 0
                and chaos["processes_left"] == 0 and chaos["not_back"] == 0)
    return r["failed"] == 0 and r["leaked_kv_blocks"] == 0 and r["health_always_200"]


def format_summary(r: dict[str, Any]) -> str:
    def mib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**20:.1f} MiB"

    lines = [f"{' Soak ':=^60}",
             f"{r['base_url']} ({r['model']}): {r['duration_s']:.0f} s at {r['rate_rps']:.3g} req/s = "
             f"{r['multiple']:g} x capacity {r['capacity_rps']:.3g} req/s ({'measured' if r['capacity_measured'] else 'given'})"]
    for label, key in (("requests sent", "sent"), ("completed", "completed"), ("refused (429/503)", "refused"),
                       ("  of which 503 + Retry-After", "refused_503"), ("failed", "failed"),
                       ("  lost streams", "lost_streams"), ("  other errors", "other_errors"),
                       ("client disconnects", "disconnected"),
                       ("malformed -> 4xx", "malformed_rejected"), ("malformed sent", "malformed_sent"),
                       ("leaked KV blocks (idle)", "leaked_kv_blocks")):
        v = r.get(key)
        lines.append(f"{label:<34}{'-' if v is None else v:>12}")
    lines.append(f"{'server RSS start -> end':<34}{mib(r['rss_start_bytes']):>12} -> {mib(r['rss_end_bytes'])}")
    lines.append(f"{'/health samples':<34}{r['health_samples']:>12}  "
                 + ", ".join(f"{k}: {v}" for k, v in r["health_statuses"].items()))
    gap = r.get("health_max_gap_s")
    if gap is not None:
        lines.append(f"{'longest gap between /health samples':<34}{gap:>10.1f} s  (interval "
                     f"{r['config']['health_interval']:g} s; far more: the client or machine stalled)")
    ch = r.get("chaos")
    if ch is not None:
        back = "-" if ch["back_after_s_max"] is None else f"{ch['back_after_s_mean']:.1f} s mean, {ch['back_after_s_max']:.1f} s max"
        lines.append(f"{'workers killed (SIGKILL)':<34}{ch['kills']:>12}  every {ch['interval_s']:g} s; back after {back}"
                     + (f"; {ch['not_back']} not back" if ch["not_back"] else ""))
        lines.append(f"{'killed processes left':<34}{ch['processes_left']:>12}"
                     + (f"  skipped: {ch['skipped']}" if ch["skipped"] else ""))
    if r.get("server_activity"):
        lines.append("server: " + ", ".join(f"{k} {v}" for k, v in sorted(r["server_activity"].items())))
    if r.get("processes_start") is not None:
        lines.append(f"{'processes under the server':<34}{r['processes_start']:>12} -> {r['processes_end']}")
    for msg, n in r["errors"].items():
        lines.append(f"  {n} x {msg}")
    if not r["idle"]:
        lines.append("  the server still had work --idle-timeout after the run: its KV blocks were not counted")
    rule = ("0 failed (0 lost, every refusal a 503/429 with Retry-After), 0 leaked KV blocks, every killed worker "
            "back and gone, /health 200 or 503" if ch is not None else "0 failed, 0 leaked KV blocks, /health always 200")
    lines.append(f"verdict: {'CLEAN' if clean(r) else 'NOT CLEAN'} ({rule})")
    lines.append("=" * 60)
    return "\n".join(lines)


async def _model(base_url: str, model: str | None) -> str:
    if model:
        return model
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), trust_env=False) as s:
        try:
            async with s.get(f"{base_url}/v1/models") as r:
                data = await r.json() if r.status == 200 else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise BenchError(f"cannot reach {base_url}: {e}") from None
    names = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
    if not names:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    return names[0]


def run_soak(args: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    for name in ("disconnect_fraction", "malformed_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            raise BenchError(f"--{name.replace('_', '-')} must be in [0, 1]")
    if args.disconnect_fraction + args.malformed_fraction > 1:
        raise BenchError("--disconnect-fraction + --malformed-fraction must be at most 1")
    base_url = normalize_base_url(args.base_url)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    async def go() -> dict[str, Any]:
        model = await _model(base_url, args.model)
        return await Soak(args, base_url, model, log).run()

    result = asyncio.run(go())
    config = {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}
    return {**result, "clean": clean(result), "started_at": started, "config": config, "machine": machine_info(),
            "command": command_line(PROG)}


def run(args: argparse.Namespace) -> int:
    def work() -> dict[str, Any]:
        result = run_soak(args)
        write_json(result, args.output)
        return result

    def done(result: dict[str, Any]) -> int:
        print(format_summary(result))
        print(f"wrote {args.output}")
        return 0 if result["clean"] else 1

    return run_command(PROG, work, done, (BenchError,))


def main(argv: list[str] | None = None) -> int:
    """``python -m tidal.bench.soak ...`` == ``tidal bench soak ...``."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["MALFORMED", "add_arguments", "add_parser", "clean", "format_summary", "main", "run", "run_soak"]
