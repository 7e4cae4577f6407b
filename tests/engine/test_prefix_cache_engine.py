"""Prefix caching on the real engine: greedy tokens equal with the cache on and off (float32), for
requests that hit, are preempted and re-admitted, swapped, served from the host tier, and moved
with their KV; cached tokens reported per request; a reset forgets."""

from __future__ import annotations

import pytest

from tidal import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def shared_prompts(tokenizer, n: int = 6) -> list[list[int]]:
    """A ~200-token system prefix, then each request's own question (some share more than the prefix)."""
    system = tokenizer.encode("You are a careful assistant for a shipping company. " * 12)
    tails = ["Where is my parcel?", "How do I return a damaged item?", "Where is my parcel? It is late.",
             "Can I change the delivery address?", "How do I return a damaged item? It broke.", "Hello"]
    return [system + tokenizer.encode(t) for t in tails[:n]]


def generate(engine, prompts, params=GREEDY):
    return LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in prompts], params)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(make_tiny_engine, smol_tokenizer):
    """Every prompt alone (one at a time), caching off: the tokens each must get."""
    engine = make_tiny_engine(max_num_batched_tokens=64, enable_prefix_caching=False)
    return [tokens(generate(engine, [p]))[0] for p in shared_prompts(smol_tokenizer)]


def test_hits_give_the_tokens_of_a_cold_run_and_report_cached_tokens(make_tiny_engine, smol_tokenizer, reference):
    engine = make_tiny_engine(max_num_batched_tokens=64)
    prompts = shared_prompts(smol_tokenizer)
    first = generate(engine, prompts[:1])
    assert first[0].num_cached_tokens == 0
    outs = generate(engine, prompts[1:])
    assert tokens(first + outs) == reference
    bs = engine.config.cache.block_size
    for o, p in zip(outs, prompts[1:], strict=True):
        assert o.num_cached_tokens >= (len(prompts[0]) - 8) // bs * bs - bs, (o.num_cached_tokens, len(p))
    stats = engine.core.stats()
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in first + outs) > 0
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    engine.kv_manager.check_invariants()


def test_caching_off_computes_every_prompt(make_tiny_engine, smol_tokenizer, reference):
    engine = make_tiny_engine(max_num_batched_tokens=64, enable_prefix_caching=False)
    outs = generate(engine, shared_prompts(smol_tokenizer))
    assert tokens(outs) == reference
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert engine.core.stats()["prefix_cache_queries"] == 0 and engine.kv_manager.num_cached_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tight_pool_preempts_with_shared_blocks_and_keeps_every_token(make_tiny_engine, smol_tokenizer, mode):
    # 16 blocks of 16 tokens for five ~170-token requests (~130 of prompt, 40 out) that share 7 blocks:
    # they start only by sharing, and their outputs outgrow the pool
    prompts = shared_prompts(smol_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cold = make_tiny_engine(max_num_batched_tokens=64, enable_prefix_caching=False)
    want = [tokens(generate(cold, [p], params))[0] for p in prompts[1:]]
    engine = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=16, preemption_mode=mode,
                              swap_space="64MiB", max_num_seqs=6)
    generate(engine, prompts[:1])
    assert tokens(generate(engine, prompts[1:], params)) == want
    assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert engine.scheduler.prefix_hits > 0
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.host_pool.num_used == 0
    kv.check_invariants()


def test_the_host_tier_stores_what_the_pool_evicts_and_loads_it_back_exactly(make_tiny_engine, smol_tokenizer,
                                                                             reference):
    # a pool of 14 blocks holds one request; a second, unrelated one evicts the first's prefix to the host
    engine = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=14, kv_offloading_size="32MiB")
    prompts = shared_prompts(smol_tokenizer)
    other = smol_tokenizer.encode("A long unrelated story about the sea and its ships. " * 14)
    generate(engine, prompts[:1])
    generate(engine, [other])
    assert engine.kv_manager.host_pool.num_cached > 0
    outs = generate(engine, prompts[1:3])
    assert tokens(outs) == reference[1:3]
    assert engine.scheduler.prefix_host_hits > 0
    assert engine.core.stats()["prefix_cache_host_hits"] == engine.scheduler.prefix_host_hits
    engine.kv_manager.check_invariants()


def test_reset_forgets_and_the_next_request_computes_everything(make_tiny_engine, smol_tokenizer, reference):
    engine = make_tiny_engine(max_num_batched_tokens=64)
    prompts = shared_prompts(smol_tokenizer)
    generate(engine, prompts[:1])
    assert engine.reset_prefix_cache() > 0
    (out,) = generate(engine, prompts[1:2])
    assert out.num_cached_tokens == 0 and tokens([out]) == reference[1:2]


def test_a_salt_isolates_tenants(make_tiny_engine, smol_tokenizer):
    engine = make_tiny_engine(max_num_batched_tokens=64)
    p = shared_prompts(smol_tokenizer)[0]
    salted = SamplingParams(temperature=0, max_tokens=4, cache_salt="tenant-a")
    generate(engine, [p], salted)
    (other,) = generate(engine, [p], SamplingParams(temperature=0, max_tokens=4, cache_salt="tenant-b"))
    (plain,) = generate(engine, [p], SamplingParams(temperature=0, max_tokens=4))
    (same,) = generate(engine, [p], salted)
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0 and same.num_cached_tokens > 0
