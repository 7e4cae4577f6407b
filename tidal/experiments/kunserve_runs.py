"""One simulated KunServe run (``tidal bench sim-kunserve``): the paper's clusters, the systems it
compares, the workloads, and what a run records.

Clusters (Sec. 5.1, Tables 1-2): ``a`` is Qwen-2.5-14B on 8 instances of one A800-80GB each, 200
Gbps RDMA between the servers; ``b`` is Qwen-2.5-72B on 4 instances of 4 H800-80GB each (tensor
parallel 4; the 2 servers of 8 GPUs), 400 Gbps RDMA between servers (one link speed for every pair
here: the instances on one server would have NVLink, which the simulator's single link does not
tell apart). Every system dispatches with Llumnix's freeness (``llumnix``; Sec. 3: "our
dispatcher incorporates the load-balancing design from Llumnix").

Systems (Sec. 5.1's baselines, then KunServe and the rows beside it):

- vLLM (default): recompute preemption; vLLM + PP: pairs of instances as 2-stage pipelines from the
  start ("frees half of the parameters on each instance", token-count microbatches, recompute);
  InferCept-like: swap preemption; Llumnix-like: migration (tidal's own policies stand for them);
- KunServe (drop): Fig. 6's drop plan, KV exchange, lookahead microbatches, restore under 50 %;
- ablations: KunServe w/o lookahead (Sec. 5.3's ablation: token-count microbatches); KunServe with
  tidal's group-queue dispatch (``llumnix-group``, not the paper's: labelled as tidal's);
- sensitivity: KunServe with the pipeline's stage gap calibrated to Sec. 5.3's measured bubbles.

Arrivals are BurstGPT-like (:mod:`tidal.experiments.kunserve_regime`: a Gamma process modulated per
20 s window, or the Azure hour's times); lengths BurstGPT-like (642 / 262), ShareGPT (the real
length set, inputs capped at 4K as in the paper) or LongBench-like (5.9K / 499, capped at 16K).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.experiments import kunserve_regime as R
from tidal.experiments import kunserve_timelines as TL

MAX_NUM_SEQS = 1024  # above what the KV holds for these lengths (vLLM's 256 caps BurstGPT-like batches before the
#                     memory does: KunServe's gain is a larger batch in the grown pool, Sec. 5.2)
MAX_NUM_BATCHED_TOKENS = 2048  # chunked prefill's step budget (Sarathi-Serve; vLLM's 512 starves prefills under load)
SWAP_SPACE = 64 * 1024**3  # host memory per GPU for InferCept-like swapping
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, the paper's setting (Sec. 5.1; Table 1's ratios are of 80 GB)


@dataclass(frozen=True)
class Cluster:
    name: str
    model: str
    hardware: str
    instances: int
    tp: int
    link: str
    note: str
    initial_rate: dict[str, float]  # req/s: where the rate searches start, per dataset


CLUSTERS = {
    "a": Cluster("a", "qwen-2.5-14b", "a800-80g", 8, 1, "ib-hdr",
                 "KunServe's cluster A (Table 2): 8 servers of one A800-80GB, 200 Gbps RDMA; Qwen-2.5-14B on one "
                 "GPU an instance (Table 1)", {"burstgpt": 40.0, "sharegpt": 12.0, "longbench": 4.0}),
    "b": Cluster("b", "qwen-2.5-72b", "h800-80g", 4, 4, "ib-ndr",
                 "KunServe's cluster B (Table 2): 2 servers of 8 H800-80GB, 400 Gbps RDMA; Qwen-2.5-72B on 4 GPUs "
                 "an instance, tensor parallel (Table 1, Sec. 5.1)", {"burstgpt": 10.0, "sharegpt": 3.0,
                                                                       "longbench": 1.0}),
}

VLLM, VLLM_PP = "vLLM (preempt: recompute)", "vLLM + PP (2-stage pipelines)"
SWAP, MIGRATE = "InferCept-like (preempt: swap)", "Llumnix-like (migrate)"
DROP, LOOKAHEAD_OFF = "KunServe (drop)", "KunServe w/o lookahead"
GROUP_RULE = "KunServe + group-queue dispatch (tidal's ablation)"
CALIBRATED = "KunServe, pipeline cost calibrated (sensitivity)"
BASELINES = (VLLM, VLLM_PP, SWAP, MIGRATE)
SYSTEMS: dict[str, dict[str, Any]] = {
    VLLM: {"kv_pressure": "preempt", "preemption_mode": "recompute", "role": "baseline"},
    VLLM_PP: {"kv_pressure": "preempt", "preemption_mode": "recompute", "pipeline_parallel": 2, "lookahead": False,
              "role": "baseline"},
    SWAP: {"kv_pressure": "preempt", "preemption_mode": "swap", "role": "baseline"},
    MIGRATE: {"kv_pressure": "migrate", "preemption_mode": "recompute", "role": "baseline"},
    DROP: {"kv_pressure": "drop", "preemption_mode": "recompute", "role": "technique"},
    LOOKAHEAD_OFF: {"kv_pressure": "drop", "preemption_mode": "recompute", "lookahead": False,
                    "role": "ablation (the paper's, Sec. 5.3)"},
    GROUP_RULE: {"kv_pressure": "drop", "preemption_mode": "recompute", "router": "llumnix-group",
                 "role": "ablation (tidal's: a group takes a request only while its prefill queue per member is the "
                         "shortest; added after seeing results, not the paper's)"},
    CALIBRATED: {"kv_pressure": "drop", "preemption_mode": "recompute", "stage_gap": "fitted",
                 "role": "sensitivity (the pipeline's stage gap calibrated to Sec. 5.3's measured bubbles)"},
}
DATASETS = {  # name -> (tidal.workload name, input cap)
    "burstgpt": ("burstgpt", 16384),
    "sharegpt": ("sharegpt-lengths", 4096),
    "longbench": ("longbench", 16384),
}


def workload(dataset: str, duration_s: float, rate: float, seed: int, arrivals: str = "gamma",
             trace: str | None = None, times: np.ndarray | None = None) -> list[Any]:
    """The dataset's lengths on ``arrivals`` (:func:`tidal.experiments.kunserve_regime.arrivals`:
    ``gamma`` bursts or the Azure hour's times) at mean ``rate``; ``steady``: Poisson arrivals;
    ``times``: these arrival times instead."""
    from tidal import workload as W

    name, max_in = DATASETS[dataset]
    rng = np.random.default_rng(seed)
    if times is None:
        times = (W.arrivals_within(rng, duration_s, rate, 1.0) if arrivals == "steady"
                 else R.arrivals(arrivals, rng, duration_s, rate, trace))
    base = W.make_requests(W.WorkloadOptions(workload=name, num_requests=len(times), seed=seed,
                                             max_input_len=max_in))
    return [W.RequestSpec(float(t), s.prompt_len, s.output_len) for t, s in zip(times, base, strict=True)]


def cluster_spec(cluster: str, system: dict[str, Any], timeline_interval: float, router: str = "llumnix",
                 gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, num_blocks: int | None = None,
                 stage_gap_s: float = 0.0) -> Any:
    from tidal.config import SchedulerConfig
    from tidal.sim.build import ClusterSpec

    c = CLUSTERS[cluster]
    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                            preemption_mode=system["preemption_mode"])
    pp = system.get("pipeline_parallel", 1)
    return ClusterSpec(model=c.model, hardware=c.hardware, instances=c.instances, tp=c.tp,
                       router=system.get("router", router), scheduler=sched,
                       gpu_memory_utilization=gpu_memory_utilization, num_blocks=num_blocks,
                       swap_space=SWAP_SPACE * c.tp if system["preemption_mode"] == "swap" else 0,
                       kv_pressure=system["kv_pressure"], link=c.link, timeline_interval_s=timeline_interval,
                       lookahead=system.get("lookahead", True), pipeline_parallel=pp,
                       pipeline_stage_gap_s=stage_gap_s if (pp > 1 or system["kv_pressure"] == "drop") else 0.0)


def simulate(cluster: str, system: dict[str, Any], specs: list[Any], timeline_interval: float,
             router: str = "llumnix", gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
             num_blocks: int | None = None, stage_gap_s: float = 0.0, until: float | None = None,
             demand_until: float | None = None) -> dict[str, Any]:
    """One run: the summary (TTFT, TPOT, ...), preemptions, the time-mean KV demand over
    ``[0, demand_until]``, the pressure events, participation, pipeline bubbles, the timelines and
    per-request latencies (for the SLO curves; the JSON leaves them out)."""
    from tidal.metrics import summarize
    from tidal.sim.build import build_simulator

    spec = cluster_spec(cluster, system, timeline_interval, router, gpu_memory_utilization, num_blocks, stage_gap_s)
    t0 = time.perf_counter()
    res = build_simulator(spec, specs).run(until=until)
    out = summarize(res.records)
    out["wall_s"] = time.perf_counter() - t0
    out["simulated_time_s"] = res.simulated_time_s
    p = res.pressure or {}
    groups = p.get("groups") or []
    out["num_preemptions"] = (sum(i["num_preemptions"] for i in res.instances)
                              + sum(g["num_preemptions"] for g in groups))
    out["num_blocks"] = res.instances[0]["num_blocks"] if res.instances and "num_blocks" in res.instances[0] else None
    out["mean_kv_demand"] = mean_demand(res.timelines, demand_until)
    out["mean_kv_use"] = mean_usage(res.timelines, demand_until)
    out["pressure"] = {k: v for k, v in p.items() if k not in ("events", "groups")}
    events = p.get("events", [])
    out["participation"] = TL.participation(events, len(res.timelines))
    out["lost"] = len(specs) - out["completed"]
    out["events"] = [e for e in events if e["kind"] != "migrate"][:2000]
    busy = sum(g["busy_time_s"] for g in groups)
    out["bubble_ratio"] = sum(g["bubble_ratio"] * g["busy_time_s"] for g in groups) / busy if busy else None
    out["timelines"] = res.timelines
    out["ttft_series"] = sorted((r.send_s, r.ttft_s) for r in res.records if r.ttft_s is not None)
    out["requests"] = {"arrival": [r.arrival_s for r in res.records],
                       "ttft": [r.ttft_s if r.success else None for r in res.records],
                       "tpot": [r.tpot_s for r in res.records]}
    return out


def _time_mean(t: np.ndarray, v: np.ndarray, end: float | None) -> float | None:
    """Time mean of samples ``v`` at ``t``, each held until the next, over ``[t[0], end]``."""
    if end is not None:
        keep = t <= end
        t, v = np.append(t[keep], end), np.append(v[keep], v[keep][-1] if keep.any() else 0.0)
    if len(t) < 2 or t[-1] <= t[0]:
        return None
    return float(np.sum(v[:-1] * np.diff(t)) / (t[-1] - t[0]))


def mean_demand(timelines: list[dict[str, Any]], end: float | None = None) -> float:
    """Time-weighted mean over the instances of (KV in use + the queue's need) / pool (the count
    Sec. 2.2 takes from Llumnix: in-process and queued requests), each sample held until the next,
    up to ``end`` (None: the last sample)."""
    vals = [m for tl in timelines
            if (m := _time_mean(np.asarray(tl["t"], dtype=float), np.asarray(tl["kv_demand"], dtype=float), end))
            is not None]
    return float(np.mean(vals)) if vals else 0.0


def mean_usage(timelines: list[dict[str, Any]], end: float | None = None) -> float:
    """Time-weighted mean over the instances of KV in use / pool."""
    return mean_demand([{"t": tl["t"], "kv_demand": tl["kv_usage"]} for tl in timelines], end)


def probe_timelines(cluster: str, dataset: str, seed: int, router: str, rate: float,
                    duration_s: float) -> list[dict[str, Any]]:
    """One compute-capacity probe run: vLLM, steady Poisson arrivals at ``rate``, an unlimited KV
    pool, cut at ``duration_s``; the per-instance timelines."""
    from tidal.sim.build import build_simulator

    specs = workload(dataset, duration_s, rate, seed, "steady")
    spec = cluster_spec(cluster, SYSTEMS[VLLM], duration_s / 300, router, num_blocks=R.UNLIMITED_BLOCKS)
    return build_simulator(spec, specs).run(until=duration_s).timelines


def pool_memory(cluster: str, blocks: int) -> dict[str, float]:
    """A pool of ``blocks`` per instance in GiB, weights + pool as a share of the instance's GPUs,
    and what a drop frees over that pool: a member of a pair frees half of the decoder layers'
    weights (Fig. 3d), of a group of 4 three quarters."""
    from tidal.sim.analytic import weight_bytes
    from tidal.sim.hardware import get_hardware
    from tidal.sim.models import get_model

    c = CLUSTERS[cluster]
    arch, hw = get_model(c.model), get_hardware(c.hardware)
    pool = blocks * 16 * arch.kv_bytes_per_token(2)
    layers = arch.num_layers * arch.params_per_layer() * 2  # decoder weights, all TP shards
    return {"pool_gib": pool / 1024**3, "gpu_memory_share": (pool + weight_bytes(arch, 2)) / (hw.memory_bytes * c.tp),
            "freed_over_pool": {str(k): (1 - 1 / k) * layers / pool for k in (2, 4)}}


def default_blocks(cluster: str) -> int:
    """The KV pool per instance at the default utilization (the engine's formula)."""
    from tidal.sim.build import resolve

    return resolve(cluster_spec(cluster, SYSTEMS[VLLM], 0.0))[2]


__all__ = ["BASELINES", "CALIBRATED", "CLUSTERS", "DATASETS", "DROP", "GROUP_RULE", "LOOKAHEAD_OFF", "MIGRATE",
           "SWAP", "SYSTEMS", "VLLM", "VLLM_PP", "Cluster", "cluster_spec", "default_blocks", "mean_demand",
           "mean_usage", "pool_memory", "probe_timelines", "simulate", "workload"]
