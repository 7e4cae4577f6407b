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
