"""The cluster front end's queue bound, on a ClusterLLM whose workers are never started: the
instances are marked alive by hand, so what ``generate`` accepts is decided by the bound alone."""

from __future__ import annotations

import asyncio
import dataclasses

from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams
from tidal.engine.async_engine import QueueFullError


def test_burst_is_bounded_by_the_backlog_not_the_batch(reuse_smol_tokenizer):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    cfg = EngineConfig.from_kwargs(dtype="float32", max_num_seqs=64, max_queued_requests=8)
    llm = ClusterLLM(ServingConfig(
        cfg,
        ClusterConfig(layout=ClusterLayout(instances=2))))
    for rec in llm.monitor.instances:  # idle, as their "ready" report would say
        rec.alive = True
    params = SamplingParams(max_tokens=4)

    async def burst(n: int, base: int) -> list[str]:
        gens = [llm.generate(None, params, f"r{base + i}", prompt_token_ids=[1, 2, 3]) for i in range(n)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0.05)  # every admission decision is taken before the first await
        out = ["full" if t.done() and isinstance(t.exception(), QueueFullError) else "accepted" for t in tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # cancelled: aborted, off the monitor
        return out

    try:
        # 16 short requests on an idle cluster with 2 x 64 slots: all start, none is a backlog
        assert asyncio.run(burst(16, 0)) == ["accepted"] * 16
        assert all(not r.outstanding for r in llm.monitor.instances)
        # 200: 2 x 64 start, 8 may wait, the rest are refused at once
        assert asyncio.run(burst(200, 100)).count("accepted") == 2 * 64 + 8
        # both full, and a step on instance 0 left 5 waiting: they are the backlog, 3 more may wait
        for rec, waiting in zip(llm.monitor.instances, (5, 0), strict=True):
            rec.status = dataclasses.replace(rec.status, num_running=64, num_waiting=waiting)
            rec.outstanding = {f"old{rec.index}-{i}" for i in range(64 + waiting)}
        assert asyncio.run(burst(20, 400)).count("accepted") == 3
    finally:
        llm.shutdown()
