"""A bounded waiting queue: a burst beyond it gets 503 at once, the accepted requests all finish."""

from __future__ import annotations

import asyncio
import json

import httpx

MAX_TOKENS = 16


async def _one(c: httpx.AsyncClient, i: int) -> tuple[int, dict, int]:
    body = {"prompt": f"Burst request {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if i % 2:
        r = await c.post("/v1/completions", json=body)
        return r.status_code, r.json(), r.json().get("usage", {}).get("completion_tokens", 0) if r.is_success else 0
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:  # refused before the stream started: a plain JSON error
            return r.status_code, json.loads(await r.aread()), 0
        pieces, usage = 0, {}
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                pieces += len(chunk["choices"])
                usage = chunk.get("usage") or usage
        assert usage["completion_tokens"] == pieces
        return r.status_code, usage, pieces


def test_burst_beyond_queue_gets_503(small_server):
    async def main():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(_one(c, i) for i in range(20)))

    results = asyncio.run(main())
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 503}, codes
    refused = [body for code, body, _ in results if code == 503]
    accepted = [n for code, _, n in results if code == 200]
    assert refused, "the queue bound (2) never refused anything"
    assert 1 <= len(accepted) < 20
    assert all(n == MAX_TOKENS for n in accepted), accepted
    for body in refused:
        err = body["error"]
        assert err["code"] == "queue_full" and err["type"] == "server_error" and "queue" in err["message"]
    m = httpx.get(f"{small_server.url}/metrics").text
    assert 'tidal:request_rejected_total{model_name="SmolLM2-135M-Instruct.Q4_1",status="503"}' in m
    assert httpx.get(f"{small_server.url}/health").status_code == 200
    # once the burst is over the server accepts work again
    ok = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_burst_within_the_batch_is_not_a_backlog(make_engine):
    """A cap of 64 running and a bound of 8 queued: a burst of 16 short requests on an idle engine
    all start at the next step, so all are answered (requests on their way to admission are not
    waiting); a burst far beyond the batch is still bounded."""
    from tidal import SamplingParams
    from tidal.engine.async_engine import AsyncLLM, QueueFullError

    llm = AsyncLLM(make_engine(max_num_seqs=64, max_queued_requests=8, kv_cache_memory="64MiB"))
    # 8 tokens: no request can finish (and free its slot) while a burst is being submitted
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def one(i: int) -> str:
        try:
            async for out in llm.generate(f"Burst {i}:", params):
                if out.finished:
                    return "ok"
        except QueueFullError:
            return "full"
        return "cut"

    async def burst(n: int) -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    llm.start()
    try:
        assert asyncio.run(burst(16)) == ["ok"] * 16
        for _ in range(2):  # the second burst comes right after the first one's last answer
            big = asyncio.run(burst(100))
            assert set(big) <= {"ok", "full"}
            # 64 start at once, at most 8 more wait; the rest are refused at once
            assert 64 <= big.count("ok") <= 64 + 8 and big.count("full") == 100 - big.count("ok")
    finally:
        llm.shutdown()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
