"""KunServe on this CPU: 2 real instances with a KV budget small enough to throttle, under bursts.

The run is set in the memory-bound regime of Sec. 2.2, as the simulated shrunken-pool sensitivity
row is (:mod:`tidal.experiments.kunserve_regime`; a CPU's KV budget has no "0.9 of the GPU" to
take the paper's regime from), by :func:`resolve`: (1) the compute capacity of the 2
instances with a pool that never throttles (``probe_kv_cache_memory``), measured as the
throughput-saturating rate (``probe_requests`` sent at once: completed requests per second);
(2) the highest mean rate whose busiest ``window_s`` window of the very arrivals ``tidal bench
serve`` will send stays at or under 85 % of it; (3) vLLM (``preempt``) on those arrivals with the
large pool, ``/admin/state`` sampled: the pool is 2x its mean KV in use (the burst's peak then
overflows it). A ``rate`` or ``kv_cache_memory`` given skips its step.

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
from dataclasses import dataclass, replace
from typing import Any

import httpx
import numpy as np

from tidal.experiments import kunserve_regime as R
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
    rate: float | None = None  # None: the highest whose busiest window is at most 85 % of the measured capacity
    burstiness: float = 0.5
    num_requests: int = 24
    max_input_len: int = 384
    max_output_len: int = 96
    slo: str = "ttft=5000,tpot=500"
    kv_cache_memory: str | None = None  # per instance; None: 2x vLLM's mean KV in use with a large pool
    probe_requests: int = 24  # the capacity probe: this many at once
    probe_kv_cache_memory: str = "256MiB"  # the probe's and the sizing run's pool: never throttles
    window_s: float = 20.0  # the burst windows kept under 85 % of the capacity
    seed: int = 0

    def engine_flags(self, kv_cache_memory: str | None = None) -> list[str]:
        kv = kv_cache_memory or self.kv_cache_memory or self.probe_kv_cache_memory
        return ["--dtype", "auto", "--kv-cache-memory", kv, "--max-num-batched-tokens", "256",
                "--instances", "2", "--threads-per-instance", "1"]

    def arrivals(self, rate: float) -> np.ndarray:
        """The arrival times ``tidal bench serve`` sends at ``rate`` (the same workload options)."""
        from tidal import workload as W

        specs = W.make_requests(W.WorkloadOptions(workload=self.workload, num_requests=self.num_requests, rate=rate,
                                                  burstiness=self.burstiness, seed=self.seed,
                                                  max_input_len=self.max_input_len,
                                                  max_output_len=self.max_output_len))
        return np.asarray([s.arrival_s for s in specs])


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


def run_system(key: str, setup: RealSetup, out_json: str, kv_cache_memory: str | None = None,
               num_requests: int | None = None, rate: str | None = None) -> dict:
    """One system's run: its server, the load, the sampled timeline; the row of the table."""
    name, flags = SYSTEMS[key]
    proc, url, log = serve(flags, setup.engine_flags(kv_cache_memory))
    sampler = StateSampler(url)
    try:
        cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", setup.workload,
               "--max-input-len", str(setup.max_input_len), "--max-output-len", str(setup.max_output_len),
               "--num-requests", str(num_requests or setup.num_requests), "--rate", rate or str(setup.rate),
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
            "completed": r["completed"], "num_requests": r["num_requests"],
            "request_throughput": r["request_throughput"],
            "preemptions": sum(i.get("num_preemptions", 0) or 0 for i in final.get("instances", [])),
            "events": sampler.events, "timeline": sampler.samples}


def kv_in_use(timeline: list[dict]) -> dict[str, float]:
    """From ``/admin/state`` samples: the time-mean KV blocks in use per instance (averaged over the
    instances), the peak of any instance, and the pool's blocks."""
    tls = {}
    for smp in timeline:
        for i in smp["instances"]:
            if i.get("num_blocks"):
                tl = tls.setdefault(i["index"], {"t": [], "kv_usage": [], "blocks": i["num_blocks"]})
                tl["t"].append(smp["t"])
                tl["kv_usage"].append((i["num_blocks"] - i["num_free_blocks"]) / i["num_blocks"])
    if not tls:
        raise RuntimeError("the sizing run sampled no instance state from /admin/state")
    blocks = min(tl["blocks"] for tl in tls.values())
    return {**R.kv_in_use(list(tls.values()), blocks), "num_blocks": blocks}


def resolve(setup: RealSetup, stem: str, log: Callable[[str], None] = print) -> tuple[RealSetup, dict[str, Any]]:
    """The setup with its rate and pool chosen (see the module's notes), and how they were chosen."""
    from tidal.config import parse_size

    regime: dict[str, Any] = {}
    if setup.rate is None:  # Sec. 2.2: a burst that overflows memory while compute keeps up
        row = run_system("preempt", setup, f"{stem}_probe.json", setup.probe_kv_cache_memory,
                         setup.probe_requests, "inf")
        cap = row["request_throughput"]  # the throughput-saturating rate of the 2 instances
        rate, peak = R.rate_under_capacity(cap, setup.arrivals, None, window_s=setup.window_s)
        regime.update(capacity=cap, capacity_definition=f"{setup.probe_requests} requests at once, a pool that "
                      "never throttles: completed requests per second (the throughput-saturating rate)",
                      max_window_rate=peak, max_window_share=peak / cap)
        log(f"real capacity probe: {cap:.3f} req/s; mean rate {rate:.3f} req/s, its busiest {setup.window_s:g} s "
            f"window {peak:.3f} req/s = {peak / cap:.0%} of it")
        setup = replace(setup, rate=round(rate, 4))
    if setup.kv_cache_memory is None:
        row = run_system("preempt", setup, f"{stem}_sizing.json", setup.probe_kv_cache_memory)
        kv = kv_in_use(row["timeline"])
        block_bytes = parse_size(setup.probe_kv_cache_memory) / kv["num_blocks"]
        need = -(-(setup.max_input_len + setup.max_output_len) // 16) + 1  # one longest request must fit
        blocks = max(R.pool_blocks(kv["mean_blocks"]), need)
        regime.update(unlimited_mean_blocks=kv["mean_blocks"], unlimited_peak_blocks=kv["peak_blocks"],
                      num_blocks=blocks, floor_blocks=need, sizing_ttft_p99_ms=row["ttft_p99_ms"])
        log(f"real KV in use with a {setup.probe_kv_cache_memory} pool: mean {kv['mean_blocks']:.0f} blocks, peak "
            f"{kv['peak_blocks']:.0f} per instance -> pool {blocks} blocks (vLLM's P99 TTFT then "
            f"{row['ttft_p99_ms']:.0f} ms)")
        setup = replace(setup, kv_cache_memory=str(int(blocks * block_bytes)))
    return setup, regime


def run(keys: list[str], setup: RealSetup, stem: str, log: Callable[[str], None] = print) -> list[dict]:
    """Every system in ``keys``, one after another; per-system JSON at ``STEM_KEY.json``."""
    rows = []
    for key in keys:
        if key not in SYSTEMS:
            raise ValueError(f"unknown system {key!r} (known: {', '.join(SYSTEMS)})")
        if setup.rate is None or setup.kv_cache_memory is None:
            raise ValueError("resolve() the setup's rate and pool first")
        row = run_system(key, setup, f"{stem}_{key}.json")
        rows.append(row)
        log(f"{row['system']}: TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, TPOT p50/p99 "
            f"{row['tpot_p50_ms']:.0f}/{row['tpot_p99_ms']:.0f} ms, goodput {row['goodput_tok_s']:.1f} tok/s, "
            f"{len(row['events'])} pressure events")
    return rows
