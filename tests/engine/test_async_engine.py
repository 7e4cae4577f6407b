"""AsyncLLM's engine thread survives callers that give up: a request whose caller cancelled it
before the engine thread took it is skipped (it used to kill the thread: ``set_result`` on a
cancelled future raised, and so did the fallback)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from tidal.core.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_an_add_cancelled_before_the_engine_took_it_is_skipped(make_engine):
    from tidal.engine.async_engine import AsyncLLM

    llm = AsyncLLM(make_engine())
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.cancel()
    llm._pending_adds = 1
    llm._handle(("add", ("gone", None, PARAMS, [1, 2, 3], 0, "online"), fut))  # raised InvalidStateError
    assert not llm.engine.has_unfinished_requests() and llm._pending_adds == 0
    call: concurrent.futures.Future = concurrent.futures.Future()
    call.cancel()
    llm._handle(("call", lambda e: 1, call))


def test_the_engine_thread_outlives_a_storm_of_cancelled_requests(make_engine):
    from tidal.engine.async_engine import AsyncLLM

    llm = AsyncLLM(make_engine())
    llm.start()
    try:
        async def one(i: int) -> list[int]:
            toks = []
            async for o in llm.generate(None, PARAMS, f"r{i}", prompt_token_ids=[10 + i, 20, 30]):
                toks += o.outputs[0].delta_token_ids
            return toks

        async def run():
            tasks = [asyncio.create_task(one(i)) for i in range(24)]
            await asyncio.sleep(0)  # every add is queued; none has been taken yet
            for t in tasks[::2]:
                t.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            return done, await one(99)

        done, after = asyncio.run(run())
        assert all(isinstance(d, asyncio.CancelledError) for d in done[::2])
        assert all(len(d) == 4 for d in done[1::2]) and len(after) == 4
        assert llm.is_running
    finally:
        llm.shutdown()
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and llm._pending_adds == 0
