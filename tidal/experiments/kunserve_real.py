"""KunServe on this CPU: 2 real instances with a KV budget small enough to throttle, under bursts.

Each policy for memory pressure is a ``tidal serve --instances 2 --kv-pressure ...`` process of its
own (:mod:`tidal.experiments.server_proc`, one at a time): ``preempt`` with recompute (vLLM), ``preempt``
with swap (InferCept-like), ``migrate`` (Llumnix-like: running requests move with their KV to the
instance with room) and ``drop`` (KunServe: the throttled pair drops half of its layers each, runs
as one pipeline and exchanges KV, Sec. 4). Every run sees the same BurstGPT-shaped requests (Gamma
arrivals, burstiness < 1) through ``tidal bench serve``; ``/admin/state`` is sampled meanwhile for
each instance's KV capacity and use over time and the drop and restore events.
``benchmarks/kunserve_serve.py`` prints and draws it; ``tidal reproduce kunserve`` puts it in the
table's real column.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tidal.experiments.server_proc import run_client, serve, stop

SYSTEMS = {
    "preempt": ("vLLM (preempt: recompute)", ["--kv-pressure", "preempt"]),
    "swap": ("InferCept-like (preempt: swap)", ["--kv-pressure", "preempt", "--preemption-mode", "swap",
                                                "--swap-space", "1GiB"]),
    "migrate": ("Llumnix-like (migrate)", ["--kv-pressure", "migrate"]),
    "drop": ("KunServe (drop)", ["--kv-pressure", "drop"]),
}


@dataclass
class RealSetup:
    workload: str = "burstgpt"
    rate: float = 1.5
    burstiness: float = 0.25
    num_requests: int = 48
    max_input_len: int = 384
    max_output_len: int = 96
    slo: str = "ttft=5000,tpot=500"
    kv_cache_memory: str = "24MiB"  # per instance: small enough to throttle
    seed: int = 0

    def engine_flags(self) -> list[str]:
        return ["--dtype", "auto", "--kv-cache-memory", self.kv_cache_memory, "--max-num-batched-tokens", "256",
                "--instances", "2", "--threads-per-instance", "1"]


class StateSampler(threading.Thread):
    """Polls ``/admin/state`` every ``period`` seconds: per instance (time, KV blocks, free blocks)."""

    def __init__(self, url: str, period: float = 0.5):
        super().__init__(daemon=True)
        self.url, self.period = url, period
        self.samples: list[dict] = []
        self.events: list[dict] = []  # KunServe's pressure events, when the sampler first saw them
        self.seen: set[tuple] = set()
        self.stopped = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=5, trust_env=False) as c:
            while not self.stopped.wait(self.period):
                try:
                    cluster = c.get(f"{self.url}/admin/state").json().get("cluster") or {}
                except (httpx.HTTPError, ValueError):
                    continue
                t = time.monotonic() - self.t0
                self.samples.append({"t": t, "instances": [{k: i.get(k) for k in ("index", "num_blocks",
                                                                                   "num_free_blocks", "kv_usage")}
                                                           for i in cluster.get("instances", [])]})
                for e in (cluster.get("kv_pressure") or {}).get("events") or []:
                    key = (e.get("kind"), e.get("time"))
                    if key not in self.seen:  # the front end's clock is its own: place it when first seen
                        self.seen.add(key)
                        self.events.append({**e, "seen_s": t})


def run_system(key: str, setup: RealSetup, out_json: str) -> dict:
    """One system's run: its server, the load, the sampled timeline; the row of the table."""
    name, flags = SYSTEMS[key]
    proc, url, log = serve(flags, setup.engine_flags())
    sampler = StateSampler(url)
    try:
        cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", setup.workload,
               "--max-input-len", str(setup.max_input_len), "--max-output-len", str(setup.max_output_len),
               "--num-requests", str(setup.num_requests), "--rate", str(setup.rate),
               "--burstiness", str(setup.burstiness), "--seed", str(setup.seed), "--slo", setup.slo,
               "--no-progress", "--no-plots", "--output", out_json]
        sampler.start()
        run_client(cmd)
        sampler.stopped.set()
        sampler.join(5)
        with open(out_json) as f:
            r = json.load(f)
        final = httpx.get(f"{url}/admin/state", timeout=10, trust_env=False).json().get("cluster") or {}
    finally:
        sampler.stopped.set()
        stop(proc)
        os.unlink(log)
    return {"system": name, "key": key, "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
            "tpot_p50_ms": r["tpot_ms"]["p50"], "tpot_p99_ms": r["tpot_ms"]["p99"],
            "goodput_tok_s": r["goodput"]["output_throughput"], "attainment": r["slo_attainment"],
            "completed": r["completed"],
            "preemptions": sum(i.get("num_preemptions", 0) or 0 for i in final.get("instances", [])),
            "events": sampler.events, "timeline": sampler.samples}


def run(keys: list[str], setup: RealSetup, stem: str, log: Callable[[str], None] = print) -> list[dict]:
    """Every system in ``keys``, one after another; per-system JSON at ``STEM_KEY.json``."""
    rows = []
    for key in keys:
        if key not in SYSTEMS:
            raise ValueError(f"unknown system {key!r} (known: {', '.join(SYSTEMS)})")
        row = run_system(key, setup, f"{stem}_{key}.json")
        rows.append(row)
        log(f"{row['system']}: TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, TPOT p50/p99 "
            f"{row['tpot_p50_ms']:.0f}/{row['tpot_p99_ms']:.0f} ms, goodput {row['goodput_tok_s']:.1f} tok/s, "
            f"{len(row['events'])} pressure events")
    return rows
