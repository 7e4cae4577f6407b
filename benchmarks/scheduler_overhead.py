"""Scheduler overhead: the time one instance's scheduler takes per step (``Scheduler.schedule`` and
``Scheduler.update``, the policy's hooks included) with 1,000 requests waiting and the running
batch the policy keeps, next to the step time the simulator's analytic cost model gives the same
plan on a GPU (default: Llama-3-8B on one A100-80G), as a percentage, for each batching policy.

The queue is kept at ``--waiting`` requests: every request admitted is replaced by a new arrival.
Prompts and outputs are drawn like the Azure conversation trace (lognormal, means 1,155 / 211).
The model step is the simulator's modelled time, not a measurement: this benchmark measures only
the scheduler, in CPU time of its thread on this CPU (so other work on a shared machine does not
inflate it).

    .venv/bin/python benchmarks/scheduler_overhead.py [--waiting 1000] [--steps 400] [--output PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from tidal.common.machine import machine_info
from tidal.common.results import command_line, write_result
from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import StepResult
from tidal.core.request import Request
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler
from tidal.policies import build_policy
from tidal.sim.build import ClusterSpec, make_cost_model, resolve
from tidal.workload import lognormal_lengths

PROG = "benchmarks/scheduler_overhead.py"
POLICIES = {
    "continuous": {},
    "bucket": {},
    "memory": {},
    "sla": {"tbt_slo_ms": 50.0},
    "slo-compose": {"tbt_slo_ms": 50.0},
    "static": {},
}


class Workload:
    """Azure-conversation-like requests, made on demand."""

    def __init__(self, seed: int, max_len: int):
        self.rng = np.random.default_rng(seed)
        self.max_len = max_len
        self.n = 0

    def request(self, now: float) -> Request:
        p = int(min(lognormal_lengths(self.rng, 1, 1155, 1.0)[0], self.max_len // 2))
        o = int(min(lognormal_lengths(self.rng, 1, 211, 1.0)[0], self.max_len - p - 1))
        self.n += 1
        return Request(f"r{self.n}", [0] * max(p, 1), SamplingParams(max_tokens=max(o, 1), ignore_eos=True),
                       arrival_time=now)


def run_policy(name: str, extra: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    spec = ClusterSpec(model=args.model, hardware=args.hardware, instances=1, tp=1,
                       scheduler=SchedulerConfig(batching=name, max_num_seqs=args.max_num_seqs,
                                                 max_num_batched_tokens=args.max_num_batched_tokens, **extra))
    arch, hw, blocks, max_len = resolve(spec)
    cost = make_cost_model(spec, arch, hw)
    sched = Scheduler(spec.scheduler, KVCacheManager(blocks, spec.block_size), build_policy(spec.scheduler), max_len)
    work = Workload(args.seed, max_len)
    now = 0.0
    for _ in range(args.waiting):
        sched.add_request(work.request(now))
    sched_s: list[float] = []
    model_s: list[float] = []
    running: list[int] = []
    waiting: list[int] = []
    cpu = time.thread_time  # CPU time of this thread: the other work on a shared machine does not count
    for step in range(args.warmup + args.steps):
        t0 = cpu()
        plan = sched.schedule(now)
        t1 = cpu()
        dt = cost.step_time(plan) if plan.chunks else 0.001
        result = StepResult(plan.step_id, {c.request_id: 0 for c in plan.chunks if c.sample}, step_time_s=dt,
                            composition=plan.composition)
        n_running = sched.num_running
        now += dt
        t2 = cpu()
        sched.update(plan, result, now)
        t3 = cpu()
        while len(sched.waiting) < args.waiting:  # keep the queue full: an arrival per admission
            sched.add_request(work.request(now))
        if step >= args.warmup and plan.chunks:
            sched_s.append((t1 - t0) + (t3 - t2))
            model_s.append(dt)
            running.append(n_running)
            waiting.append(len(sched.waiting))
    mean_sched, mean_model = statistics.fmean(sched_s), statistics.fmean(model_s)
    return {"policy": name, "config": extra, "steps": len(sched_s),
            "scheduler_ms_median": 1e3 * statistics.median(sched_s), "scheduler_ms_mean": 1e3 * mean_sched,
            "model_step_ms_median": 1e3 * statistics.median(model_s), "model_step_ms_mean": 1e3 * mean_model,
            "overhead_pct": 100.0 * mean_sched / mean_model,
            "overhead_pct_median_step": 100.0 * statistics.median(s / m for s, m in zip(sched_s, model_s, strict=True)),
            "running_mean": statistics.fmean(running), "waiting_mean": statistics.fmean(waiting)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    p.add_argument("--waiting", type=int, default=1000, help="requests kept waiting")
    p.add_argument("--steps", type=int, default=400, help="steps measured per policy")
    p.add_argument("--warmup", type=int, default=100, help="steps run first (the running batch forms)")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="a100-80g")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/scheduler_overhead.json")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad:
        print(f"{PROG}: error: unknown policy {bad[0]!r}; available: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    command = command_line(PROG, argv if argv is not None else sys.argv[1:])
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine.get('cpu_model')} ({machine.get('cores')} cores), load average {machine.get('loadavg')}")
    print(f"model step: the simulator's analytic cost model, {args.model} on one {args.hardware} "
          f"(modelled, not measured); scheduler: CPU time measured on this machine")
    print(f"{args.waiting} waiting, max_num_seqs {args.max_num_seqs}, token budget {args.max_num_batched_tokens}, "
          f"{args.steps} steps after {args.warmup}")
    print(f"{'policy':<14}{'running':>9}{'sched ms':>10}{'(median)':>10}{'step ms':>9}{'overhead':>10}")
    rows = []
    for name in names:
        r = run_policy(name, POLICIES[name], args)
        rows.append(r)
        print(f"{name:<14}{r['running_mean']:>9.1f}{r['scheduler_ms_mean']:>10.3f}{r['scheduler_ms_median']:>10.3f}"
              f"{r['model_step_ms_mean']:>9.2f}{r['overhead_pct']:>9.2f}%", flush=True)
    report = {"command": command, "machine": machine, "model": args.model, "hardware": args.hardware,
              "model_step": "simulator analytic cost model (modelled GPU step)", "waiting": args.waiting,
              "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              "steps": args.steps, "warmup": args.warmup, "policies": rows}
    write_result(report, args.output, False, prog=PROG)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
