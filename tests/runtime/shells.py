"""What the "same decisions in both shells" tests share: a burst of token-id requests served by a
real cluster, the real workers' pools, and simulated instances built on those pools with the
real scheduler configuration (SmolLM2-135M's shape on this CPU's cost model, float32)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from tidal.core.sampling import SamplingParams

SIM_MODEL = "smollm2-135m"  # the default checkpoint's shape in tidal.sim.models

Work = list[tuple[list[int], int]]  # (prompt token ids, max_tokens) per request


def random_work(seed: int, n: int, prompt_len: tuple[int, int] = (12, 90), max_tokens: tuple[int, int] = (3, 10)
                ) -> Work:
    rng = np.random.default_rng(seed)
    return [(rng.integers(100, 40000, size=int(rng.integers(*prompt_len))).tolist(), int(rng.integers(*max_tokens)))
            for _ in range(n)]


def serve_burst(llm: Any, work: Work) -> list[int]:
    """Send every request at once (ids ``r0``, ``r1``...; greedy, no EOS); the tokens each got."""

    async def one(i: int) -> int:
        ids, max_tokens = work[i]
        n = 0
        async for o in llm.generate(None, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    f"r{i}", prompt_token_ids=ids):
            n += len(o.outputs[0].delta_token_ids)
        return n

    async def burst() -> list[int]:
        return await asyncio.gather(*[one(i) for i in range(len(work))])

    return asyncio.run(burst())


def pools_of(llm: Any) -> dict[int, tuple[int, int]]:
    """Each instance's (KV blocks, block size), as the monitor heard them."""
    return {r.index: (r.num_blocks, r.block_size) for r in llm.monitor.instances}


def sim_instances(pools: dict[int, tuple[int, int]], scheduler: Any) -> tuple[list[Any], Any, Any]:
    """(simulated instances on ``pools`` with ``scheduler``, the model's shape, the hardware)."""
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware
    from tidal.sim.instance import SimInstance
    from tidal.sim.models import get_model

    arch, hw = get_model(SIM_MODEL), get_hardware("cpu")
    cost = AnalyticCostModel(arch, hw, dtype_bytes=4)
    return ([SimInstance(i, scheduler, pools[i][0], pools[i][1], cost, arch.max_position_embeddings)
             for i in range(len(pools))], arch, hw)


def request_specs(work: Work) -> tuple[list[Any], list[str]]:
    """The simulator's burst at t=0 of the same requests, and their ids."""
    from tidal.workload import RequestSpec

    return [RequestSpec(0.0, len(ids), m) for ids, m in work], [f"r{i}" for i in range(len(work))]


def leaked_segments(before: set[str]) -> set[str]:
    """``tidal-kv`` shared-memory segments made since ``before`` that no live process maps or
    holds open: ours, left behind (other tests on the machine may be making their own meanwhile)."""
    import os

    from tests.runtime.test_cluster import shm_segments

    new = shm_segments() - before
    if not new:
        return new
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                held |= {n for line in f for n in new if f"/dev/shm/{n}" in line}
            held |= {n for fd in os.listdir(f"/proc/{pid}/fd") for n in new
                     if os.readlink(f"/proc/{pid}/fd/{fd}") == f"/dev/shm/{n}"}
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {n for n in new if n in shm_segments() and n not in held}
