"""The OpenAI-compatible server end to end, driven with the official ``openai`` client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import CHAT_MESSAGES, COMPLETION_PROMPT, REF_MAX_TOKENS


@pytest.fixture(scope="module")
def client(reference, server):  # reference first: it is computed while the server loads
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server):
    return server.model


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics keyed by (name, labels without model_name)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def n_tokens(url: str, **body) -> int:
    return httpx.post(f"{url}/tokenize", json=body, timeout=10).json()["count"]


# ------------------------------------------------------------------------------ parity with LLM
def test_start_up_says_which_weights_run(server):
    # --quantization auto's choice (timed at start-up): float, or the int4/int8 copies and their step sizes
    line = next(x for x in server.output().splitlines() if x.startswith("engine: float32, "))
    assert line.startswith("engine: float32, weights: ") and ("float" in line or "int4 for" in line)


def test_completion_greedy_matches_offline(client, model, server, reference):
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference["completion"]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens == len(reference["completion_prompt_ids"]) == n_tokens(server.url,
                                                                                     prompt=COMPLETION_PROMPT)
    assert r.usage.completion_tokens == len(reference["completion_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same prompt as token ids, and streamed
    r2 = client.completions.create(model=model, prompt=reference["completion_prompt_ids"],
                                   max_tokens=REF_MAX_TOKENS, temperature=0)
    assert r2.choices[0].text == reference["completion"]
    chunks = list(client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reference["completion"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_greedy_matches_offline(client, model, server, reference):
    r = client.chat.completions.create(model=model, messages=CHAT_MESSAGES, max_tokens=REF_MAX_TOKENS,
                                       temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == reference["chat"]
    assert r.choices[0].finish_reason == reference["chat_finish"]
    assert r.usage.prompt_tokens == len(reference["chat_prompt_ids"]) == n_tokens(server.url,
                                                                               messages=CHAT_MESSAGES)
    stream = client.chat.completions.create(model=model, messages=CHAT_MESSAGES, max_completion_tokens=REF_MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference["chat_finish"]
    # content as a list of text parts renders the same prompt
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colors."}]}]
    r3 = client.chat.completions.create(model=model, messages=parts, max_tokens=REF_MAX_TOKENS, temperature=0)
    assert r3.choices[0].message.content == reference["chat"]


# ------------------------------------------------------------------------------ load
def test_32_concurrent_streams(server, model):
    max_tokens = 12
    prompts = [f"Request number {i} tells a story about" for i in range(32)]

    async def one(c: openai.AsyncOpenAI, i: int):
        stream = await c.completions.create(
            model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "priority": i % 3})
        pieces, usage, finish = 0, None, None
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage
            if ch.choices:
                pieces += 1
                finish = ch.choices[0].finish_reason or finish
        return pieces, usage, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(main())
    for i, (pieces, usage, finish) in enumerate(results):
        assert finish == "length"
        assert pieces == max_tokens == usage.completion_tokens  # one chunk per token
        assert usage.prompt_tokens == n_tokens(server.url, prompt=prompts[i])


def _wait_kv_freed(url: str, what: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        m = scrape(url)
        if m[("tidal:num_kv_blocks_used", ())] == 0 and m[("tidal:num_requests_running", ())] == 0:
            return m
        assert time.monotonic() < deadline, f"KV blocks not freed after {what}: {m}"
        time.sleep(0.05)


def _read_two_chunks_and_close(url: str, body: dict) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break


def test_client_disconnect_frees_kv(server):
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    aborts = scrape(server.url)[("tidal:request_success_total", (("finished_reason", "abort"),))]
    _read_two_chunks_and_close(server.url, body)
    m = _wait_kv_freed(server.url, "a streaming client disconnected")
    assert m[("tidal:request_success_total", (("finished_reason", "abort"),))] == aborts + 1
    # several engine requests behind one HTTP request (2 prompts x n=2)
    _read_two_chunks_and_close(server.url, {**body, "prompt": ["Once upon a time", "In a galaxy"], "n": 2})
    _wait_kv_freed(server.url, "a batched streaming client disconnected")
    # a non-streaming request whose client times out is aborted as well
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    _wait_kv_freed(server.url, "a non-streaming client went away")
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------------------ features
def test_n_and_batched_prompts(client, model):
    r = client.completions.create(model=model, prompt="Hello", n=2, max_tokens=6, seed=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model=model, prompt=["Hello", "The sky is"], n=2, max_tokens=4, seed=5,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=model, messages=CHAT_MESSAGES, n=2, max_tokens=5, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    stream = client.completions.create(model=model, prompt=["A", "B"], n=2, max_tokens=3, stream=True,
                                       extra_body={"ignore_eos": True})
    per_index: dict[int, int] = {}
    for ch in stream:
        for c in ch.choices:
            per_index[c.index] = per_index.get(c.index, 0) + 1
    assert per_index == {0: 3, 1: 3, 2: 3, 3: 3}


def test_logprobs_shapes(client, model):
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and val <= 0 and top[tok] == pytest.approx(val)
        assert val == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chunks = list(client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=5, logprobs=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 5

    chat = client.chat.completions.create(model=model, messages=CHAT_MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 == chat.usage.completion_tokens
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=model, messages=CHAT_MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_strings_and_tokens(client, model, reference):
    text = reference["completion"]
    words = text.split()
    stop = words[len(words) // 2]
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0,
                                  stop=[stop, "zzzz-never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0, stop=stop, stream=True))
    assert streamed == text[:text.index(stop)]
    ids = reference["completion_ids"]
    r = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0,
                                  extra_body={"stop_token_ids": [ids[2]]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == ids[2]
    assert r.usage.completion_tokens == ids.index(ids[2]) + 1


def test_seed_reproducible(client, model):
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=16, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    texts = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(texts) > 1


def test_priority_and_request_class(client, model):
    r = client.completions.create(model=model, prompt="Hi", max_tokens=3,
                                  extra_body={"priority": -5, "request_class": "offline"})
    assert r.choices[0].finish_reason in ("length", "stop")


# ------------------------------------------------------------------------------ other endpoints
def test_models_tokenize_detokenize_version(server, client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] == ["SmolLM2-135M-Instruct.Q4_1"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 8192
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok == {"prompt": "Hello, world!"}
    chat_tok = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT_MESSAGES}).json()
    assert chat_tok["count"] > tok["count"]
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    state = httpx.get(f"{server.url}/admin/state").json()
    assert state["scheduler"]["max_num_seqs"] == 32 and state["batch_size_cap"] == 32
    assert state["policy"]["policy"] and "num_kv_blocks" in state["stats"]
    # float32 on CPU: tidal's C++ kernels attend where they are built (else torch's SDPA); no CUDA graphs
    assert state["attention"] in ("tidal-cpu", "torch") and state["cuda_graphs"] is False


def test_metrics_counts(server, client, model):
    before = scrape(server.url)
    prompt_tokens = 0
    for p in ("One", "Two three"):
        r = client.completions.create(model=model, prompt=p, max_tokens=5, extra_body={"ignore_eos": True})
        prompt_tokens += r.usage.prompt_tokens
    after = scrape(server.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("tidal:prompt_tokens_total") == prompt_tokens
    assert delta("tidal:generation_tokens_total") == 10
    assert delta("tidal:request_success_total", finished_reason="length") == 2
    assert delta("tidal:time_to_first_token_seconds_count") == 2
    assert delta("tidal:inter_token_latency_seconds_count") == 8
    assert delta("tidal:e2e_request_latency_seconds_count") == 2
    assert delta("tidal:request_queue_time_seconds_count") == 2
    assert 0 < delta("tidal:e2e_request_latency_seconds_sum") < 120
    assert delta("tidal:time_to_first_token_seconds_sum") <= delta("tidal:e2e_request_latency_seconds_sum")
    assert after[("tidal:num_requests_running", ())] == 0 and after[("tidal:num_requests_waiting", ())] == 0
    assert after[("tidal:num_kv_blocks_total", ())] > 0 and after[("tidal:num_kv_blocks_used", ())] == 0
    assert after[("tidal:kv_cache_usage_perc", ())] == 0
    assert after[("tidal:batch_size_cap", ())] == 32
    # the counter is the engine's own (a missing stat would read 0), and two short requests on
    # an idle pool preempt nobody
    state = httpx.get(f"{server.url}/admin/state").json()
    assert after[("tidal:num_preemptions_total", ())] == state["stats"]["num_preemptions"]
    assert delta("tidal:num_preemptions_total") == 0
