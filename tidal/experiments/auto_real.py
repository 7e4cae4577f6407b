"""``tidal bench sim-auto --real``: ``--kv-pressure auto`` on the real engine -- 2 CPU workers with
small KV pools under a burst -- its answers against one engine's, token for token, and its choices as
recorded (each replayed from its record). The workload is the same-decision test's
(``tests/runtime/test_same_auto_decisions.py``): instance 0 gets four long prompts (about 7 of its 10
blocks each), instance 1 four short ones."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

ENGINE = dict(dtype="float32", num_blocks_override=10, max_num_batched_tokens=64, swap_space="4MiB")
N = 8


def workload(n: int = N) -> list[tuple[list[int], int]]:
    """Alternating long (100-112 tokens, 10-12 out) and short (4-7, 4-7) random-token prompts."""
    def draw(seed: int, k: int, plen: tuple[int, int], out: tuple[int, int]) -> list[tuple[list[int], int]]:
        rng = np.random.default_rng(seed)
        return [(rng.integers(100, 40000, size=int(rng.integers(*plen))).tolist(), int(rng.integers(*out)))
                for _ in range(k)]
    long, short = draw(5, n // 2, (100, 113), (10, 13)), draw(6, n // 2, (4, 8), (4, 8))
    return [r for pair in zip(long, short, strict=True) for r in pair]


def _burst(llm: Any, work: list[tuple[list[int], int]], params: Any) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        ids, m = work[i]
        out: list[int] = []
        async for o in llm.generate(None, params(m), f"r{i}", prompt_token_ids=ids):
            out += o.outputs[0].delta_token_ids
        return out

    async def burst() -> list[list[int]]:
        return await asyncio.gather(*[one(i) for i in range(len(work))])

    return asyncio.run(burst())


def real_run() -> dict[str, Any]:
    from tidal import LLM
    from tidal.cluster.dispatch import ClusterLayout
    from tidal.cluster.pressure.choose import replay
    from tidal.config import EngineConfig
    from tidal.core.sampling import SamplingParams
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    def params(m: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)

    work = workload()
    llm = ClusterLLM(ServingConfig(EngineConfig.from_kwargs(**ENGINE), ClusterConfig(
        layout=ClusterLayout(2, "colocate", 0), threads_per_instance=1, layers_per_chunk=4, kv_pressure="auto")))
    choices: list[Any] = []
    llm.pressure.choices = choices
    llm.start()
    try:
        tokens = _burst(llm, work, params)
        deadline = time.monotonic() + 30  # a drop's restore, then the tail's reload
        while time.monotonic() < deadline and llm.pressure.drop.dropped:
            time.sleep(0.1)
        state = llm.stats["cluster"]["kv_pressure"]
    finally:
        llm.shutdown()
    ref = LLM(**{k: v for k, v in ENGINE.items() if k != "num_blocks_override"}).generate(
        [{"prompt_token_ids": ids} for ids, _ in work], [params(m) for _, m in work])
    same = [t == o.outputs[0].token_ids for t, o in zip(tokens, ref, strict=True)]
    return {"setup": f"2 CPU worker processes of the default model (SmolLM2-135M, float32), {ENGINE['num_blocks_override']} "
                     f"KV blocks of 16 tokens each, {ENGINE['swap_space']} of host pool, {N} requests at once "
                     "(greedy); the reference is one engine with the default pool",
            "requests": N, "tokens_equal_one_engine": all(same), "mismatches": same.count(False),
            "replayed": all(replay(c).choice == c.choice for c in choices),
            "choices": [{"time": c.time, "index": c.index, **c.summary()} for c in choices],
            "events_total": state["events_total"], "events": [e["kind"] for e in state["events"]]}


__all__ = ["real_run", "workload"]
