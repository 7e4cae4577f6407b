"""KunServe on this CPU: 2 real instances with a KV budget small enough to throttle, under bursts.

The run is set in the memory-bound regime of Sec. 2.2, as the simulated shrunken-pool sensitivity
row is (:mod:`tidal.experiments.kunserve_regime`; a CPU's KV budget has no "0.9 of the GPU" to
take the paper's regime from), by :func:`resolve`: (1) the compute capacity of the 2
instances with a pool that never throttles (``probe_kv_cache_memory``), measured as the
throughput-saturating rate (``probe_requests`` sent at once: completed requests per second);
(2) the highest mean rate whose busiest ``window_s`` window of the very arrivals ``tidal bench
serve`` will send stays at or under 85 % of it on every seed; (3) vLLM (``preempt``) on each seed's
arrivals with the large pool, ``/admin/state`` sampled: the pool is 2x its mean KV in use over the
seeds (the burst's peak then overflows it). A ``rate`` or ``kv_cache_memory`` given skips its step.

Each policy for memory pressure is a ``tidal serve --instances 2 --kv-pressure ...`` process of its
own (:mod:`tidal.experiments.server_proc`, one at a time): ``preempt`` with recompute (vLLM), ``preempt``
with swap (InferCept-like), ``migrate`` (Llumnix-like: running requests move with their KV to the
instance with room) and ``drop`` (KunServe: the throttled pair drops half of its layers each, runs
as one pipeline and exchanges KV, Sec. 4). Every run sees the same BurstGPT-shaped requests (Gamma
arrivals, burstiness < 1) through ``tidal bench serve``; ``/admin/state`` is sampled meanwhile for
each instance's KV capacity and use over time and the drop and restore events. Every system runs
on each of ``seeds`` (the arrivals' draws), all of a seed's systems before the next seed's, so that
a cut-off run keeps whole seeds; its record (:func:`record`) says whether it finished.
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
    seeds: tuple[int, ...] = (0, 1, 2)  # the arrivals' draws: every system runs on each

    def engine_flags(self, kv_cache_memory: str | None = None) -> list[str]:
        kv = kv_cache_memory or self.kv_cache_memory or self.probe_kv_cache_memory
        return ["--dtype", "auto", "--kv-cache-memory", kv, "--max-num-batched-tokens", "256",
                "--instances", "2", "--threads-per-instance", "1"]

    def arrivals(self, rate: float, seed: int) -> np.ndarray:
        """The arrival times ``tidal bench serve`` sends at ``rate`` with ``seed`` (the same workload options)."""
        from tidal import workload as W

        specs = W.make_requests(W.WorkloadOptions(workload=self.workload, num_requests=self.num_requests, rate=rate,
                                                  burstiness=self.burstiness, seed=seed,
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


def run_system(key: str, setup: RealSetup, seed: int, out_json: str, kv_cache_memory: str | None = None,
               num_requests: int | None = None, rate: str | None = None) -> dict:
    """One system's run on one seed's arrivals: its server, the load, the sampled timeline; the row of
    the table."""
    name, flags = SYSTEMS[key]
    proc, url, log = serve(flags, setup.engine_flags(kv_cache_memory))
    sampler = StateSampler(url)
    try:
        cmd = [sys.executable, "-m", "tidal.cli", "bench", "serve", "--base-url", url, "--workload", setup.workload,
               "--max-input-len", str(setup.max_input_len), "--max-output-len", str(setup.max_output_len),
               "--num-requests", str(num_requests or setup.num_requests), "--rate", rate or str(setup.rate),
               "--burstiness", str(setup.burstiness), "--seed", str(seed), "--slo", setup.slo,
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
    return {"system": name, "key": key, "seed": seed, "ttft_p50_ms": r["ttft_ms"]["p50"], "ttft_p99_ms": r["ttft_ms"]["p99"],
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
        row = run_system("preempt", setup, setup.seeds[0], f"{stem}_probe.json", setup.probe_kv_cache_memory,
                         setup.probe_requests, "inf")
        cap = row["request_throughput"]  # the throughput-saturating rate of the 2 instances
        rate, peak = R.rate_under_capacity(cap, lambda r: [setup.arrivals(r, s) for s in setup.seeds], None,
                                           window_s=setup.window_s)
        regime.update(capacity=cap, capacity_definition=f"{setup.probe_requests} requests at once, a pool that "
                      "never throttles: completed requests per second (the throughput-saturating rate)",
                      max_window_rate=peak, max_window_share=peak / cap)
        log(f"real capacity probe: {cap:.3f} req/s; mean rate {rate:.3f} req/s, its busiest {setup.window_s:g} s "
            f"window over the seeds {peak:.3f} req/s = {peak / cap:.0%} of it")
        setup = replace(setup, rate=round(rate, 4))
    if setup.kv_cache_memory is None:
        sized = []
        for seed in setup.seeds:  # vLLM with the large pool on each seed's arrivals
            row = run_system("preempt", setup, seed, f"{stem}_sizing_s{seed}.json", setup.probe_kv_cache_memory)
            sized.append((kv_in_use(row["timeline"]), row["ttft_p99_ms"]))
        mean = float(np.mean([kv["mean_blocks"] for kv, _ in sized]))
        block_bytes = parse_size(setup.probe_kv_cache_memory) / sized[0][0]["num_blocks"]
        need = -(-(setup.max_input_len + setup.max_output_len) // 16) + 1  # one longest request must fit
        blocks = max(R.pool_blocks(mean), need)  # Sec. 2.2: the burst's peak overflows 2x the mean in use
        regime.update(unlimited_mean_blocks=mean, unlimited_peak_blocks=max(kv["peak_blocks"] for kv, _ in sized),
                      unlimited_mean_blocks_per_seed=[kv["mean_blocks"] for kv, _ in sized],
                      num_blocks=blocks, floor_blocks=need, sizing_ttft_p99_ms=[p99 for _, p99 in sized])
        each = ", ".join(f"{kv['mean_blocks']:.0f}" for kv, _ in sized)
        log(f"real KV in use with a {setup.probe_kv_cache_memory} pool: mean {mean:.0f} blocks over the seeds "
            f"({each}), peak "
            f"{regime['unlimited_peak_blocks']:.0f} per instance -> pool {blocks} blocks")
        setup = replace(setup, kv_cache_memory=str(int(blocks * block_bytes)))
    return setup, regime


def run(keys: list[str], setup: RealSetup, stem: str, log: Callable[[str], None] = print,
        on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every system in ``keys`` on each seed, one server after another (a seed's systems before the
    next seed's); per-run JSON at ``STEM_KEY_sSEED.json``; ``on_row`` gets the rows so far after each
    run, so a cut-off run keeps what it measured."""
    for key in keys:
        if key not in SYSTEMS:
            raise ValueError(f"unknown system {key!r} (known: {', '.join(SYSTEMS)})")
    if setup.rate is None or setup.kv_cache_memory is None:
        raise ValueError("resolve() the setup's rate and pool first")
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    rows: list[dict] = []
    total = len(setup.seeds) * len(keys)
    for seed in setup.seeds:
        for key in keys:
            row = run_system(key, setup, seed, f"{stem}_{key}_s{seed}.json")
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            log(f"[{len(rows)}/{total}] {row['system']}, seed {seed}: TTFT p50/p99 {row['ttft_p50_ms']:.0f}/"
                f"{row['ttft_p99_ms']:.0f} ms, TPOT p50/p99 {row['tpot_p50_ms']:.0f}/{row['tpot_p99_ms']:.0f} ms, "
                f"goodput {row['goodput_tok_s']:.1f} tok/s, {len(row['events'])} pressure events")
    return rows


def record(command: str, setup: RealSetup, regime: dict[str, Any], rows: list[dict], complete: bool,
           machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's record (``kunserve_real.json``): its rows without the sampled timelines (each keeps
    its count of pressure events and their kinds); ``complete`` False until every seed has run."""
    return {"command": command, "machine": machine, "setup": {**setup.__dict__, "seeds": list(setup.seeds)},
            "regime": regime, "engine_flags": setup.engine_flags(), "complete": complete,
            "rows": [{k: v for k, v in r.items() if k not in ("timeline", "events")}
                     | {"num_events": len(r["events"]), "event_kinds": sorted({e.get("kind", "") for e in r["events"]})}
                     for r in rows]}


def check_record(real: dict[str, Any], path: str) -> dict[str, Any]:
    """A recorded ``kunserve_real.json`` as the claims read it, or ValueError naming what is wrong:
    not such a record, one from before the seeds (rows by system), a run cut off, a seed without
    every system."""
    missing = {"setup", "regime", "rows"} - set(real)
    if missing:
        raise ValueError(f"{path}: not a kunserve_real.json (no {', '.join(sorted(missing))})")
    if not isinstance(real["rows"], list):
        raise ValueError(f"{path}: a record from before the real runs had seeds (one run a system); run it again")
    if real.get("complete") is False:
        raise ValueError(f"{path}: the run was cut off after {len(real['rows'])} runs; run it again")
    names = {name for name, _ in SYSTEMS.values()}
    for seed in sorted({r["seed"] for r in real["rows"]}):
        lack = names - {r["system"] for r in real["rows"] if r["seed"] == seed}
        if lack:
            raise ValueError(f"{path}: seed {seed} lacks {', '.join(sorted(lack))}")
    return real


def by_system(real: dict[str, Any]) -> tuple[list[int], dict[str, list[dict[str, Any]]]]:
    """The seeds every system ran, and per system its rows on those seeds, in seed order."""
    rows = real["rows"]
    names = {r["system"] for r in rows}
    seeds = sorted(set.intersection(*({r["seed"] for r in rows if r["system"] == n} for n in names))) if names else []
    return seeds, {n: sorted((r for r in rows if r["system"] == n and r["seed"] in seeds), key=lambda r: r["seed"])
                   for n in names}
