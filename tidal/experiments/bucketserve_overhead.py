"""BucketServe's Fig. 6 in the simulator: the end-to-end latency breakdown (a request's prefill,
queueing included, against its decode) and the bucketing overhead (Fig. 6a), and that overhead
against the number of buckets (Fig. 6b).

The overhead is the wall time this CPU spends in the prefill instances' bucket policy (Alg. 1's
bucketing and the Eq. 6 cap: ``plan_step``, ``order_waiting``, ``admit``, ``observe``,
``on_finished``), the same pure code the engine runs, timed around each call during a simulated
run; the step it belongs to is counted with the number of buckets Alg. 1 kept for it. It is
compared with the simulated GPU time of the run (its execution time) and of a prefill step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.metrics import summarize
from tidal.workload import RequestSpec

TIMED = ("plan_step", "order_waiting", "admit", "observe", "on_finished")


class PolicyTimer:
    """Times every call of ``TIMED`` on a policy object, per scheduling step (a step opens at
    ``plan_step``), with the number of buckets the step had."""

    def __init__(self, policy: Any):
        self.policy = policy
        self.steps: list[tuple[int, float]] = []  # (buckets, seconds) per step
        self._open: list[float] | None = None
        for name in TIMED:
            setattr(policy, name, self._wrap(name, getattr(policy, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            dt = time.perf_counter() - t0
            if name == "plan_step":
                self._close()
                self._open = [float(len(self.policy.index.buckets)), dt]
            elif self._open is not None:
                self._open[1] += dt
            return out
        return timed

    def _close(self) -> None:
        if self._open is not None:
            self.steps.append((int(self._open[0]), self._open[1]))
            self._open = None

    def finish(self) -> list[tuple[int, float]]:
        self._close()
        return self.steps


def breakdown_run(kw: dict[str, Any], specs: list[RequestSpec]) -> dict[str, Any]:
    """One BucketServe run with its prefill instances' bucket policy timed: the mean prefill (TTFT,
    queueing included) and decode (end to end less TTFT) per request, the bucketing overhead per
    request and per step, against the run's simulated time, and the overhead by bucket count."""
    from tidal.sim.build import ClusterSpec, build_simulator

    sim = build_simulator(ClusterSpec(**kw), list(specs))
    timers = [PolicyTimer(inst.policy) for inst in sim.instances if inst.role == "prefill"]
    res = sim.run()
    steps = [s for t in timers for s in t.finish()]
    recs = [r for r in res.records if r.success and r.ttft_s is not None and r.e2e_s is not None]
    s = summarize(res.records)
    prefill = float(np.mean([r.ttft_s for r in recs])) if recs else 0.0
    decode = float(np.mean([r.e2e_s - r.ttft_s for r in recs])) if recs else 0.0
    overhead = sum(t for _, t in steps)
    busy = [i for i in res.instances if i["role"] == "prefill"]
    prefill_steps = sum(i["steps"] for i in busy)
    prefill_step_s = sum(i["busy_time_s"] for i in busy) / prefill_steps if prefill_steps else 0.0
    by_k: dict[int, list[float]] = {}
    for k, t in steps:
        by_k.setdefault(k, []).append(t)
    return {"num_requests": len(specs), "completed": s["completed"], "prefill_s": prefill, "decode_s": decode,
            "overhead_s_per_request": overhead / max(len(recs), 1), "overhead_s_total": overhead,
            "simulated_s": res.simulated_time_s, "prefill_step_s": prefill_step_s, "policy_steps": len(steps),
            "by_buckets": {str(k): {"steps": len(v), "mean_s": float(np.mean(v)), "median_s": float(np.median(v)),
                                    "p99_s": float(np.percentile(v, 99))}
                           for k, v in sorted(by_k.items())}}


def plot_fig6(fig6: dict[str, Any], out_path: str) -> None:
    from tidal.common.plots import pyplot

    plt = pyplot()
    sets = list(fig6)
    fig, axes = plt.subplots(1, 2 * len(sets), figsize=(5 * len(sets) * 2, 3.6), squeeze=False)
    for j, ds in enumerate(sets):
        runs = fig6[ds]["seeds"][0]["runs"]  # seed 0
        rates = [r["client_rps"] for r in runs]
        ax = axes[0][2 * j]
        x = np.arange(len(rates))
        pre = [r["prefill_s"] for r in runs]
        dec = [r["decode_s"] for r in runs]
        ovh = [r["overhead_s_per_request"] for r in runs]
        ax.bar(x, pre, label="prefill (queueing included)")
        ax.bar(x, dec, bottom=pre, label="decode")
        ax.bar(x, ovh, bottom=[a + b for a, b in zip(pre, dec, strict=True)], color="red", label="bucketing")
        ax.set_xticks(x, [f"{r:g}" for r in rates])
        ax.set_xlabel("client RPS")
        ax.set_ylabel("seconds per request")
        ax.set_title(f"Fig. 6a: {ds}, BucketServe (seed 0)", fontsize=9)
        ax.legend(fontsize=7)
        ax = axes[0][2 * j + 1]
        for r in runs:
            ks = sorted(int(k) for k in r["by_buckets"])
            ax.plot(ks, [1e6 * r["by_buckets"][str(k)]["median_s"] for k in ks], "o-", label=f"{r['client_rps']:g} req/s")
        ax.set_xlabel("buckets")
        ax.set_ylabel("bucketing time per step (us, median, this CPU)")
        ax.set_title(f"Fig. 6b: {ds}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


__all__ = ["PolicyTimer", "breakdown_run", "plot_fig6"]
