"""Prefix caching across the runtime's moves: requests that hit a cached prefix on one instance and are
handed over (P/D), split (DynaServe) or served colocated give one engine's greedy tokens with the cache
off; the hits are counted; nothing leaks."""

from __future__ import annotations

import asyncio

import pytest

from tests.runtime.test_cluster import no_leak, settle, shm_segments, start, stop
from tidal.core.sampling import SamplingParams

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = "You are a terse assistant for a bakery. Prices are in euros and every answer is one line. " * 3
PROMPTS = [SYSTEM + q for q in ("What does bread cost?", "When do you open?", "Do you sell cakes?",
                                "Is there parking?", "What does bread cost on Sunday?", "Can I order ahead?")]


@pytest.fixture(scope="module")
def reference(make_engine):
    from tidal import LLM

    engine = make_engine(dtype="float32", max_num_batched_tokens=64, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(PROMPTS, PARAMS)]


async def tokens_of(llm, i: int) -> list[int]:
    out: list[int] = []
    async for o in llm.generate(PROMPTS[i], PARAMS, f"p{i}"):
        out += o.outputs[0].delta_token_ids
    return out


def shared_blocks(tokenizer, block_size: int = 16) -> int:
    """Full blocks of the system prompt's tokens that every prompt begins with (the chat template's
    prefix and the system prompt, short of where the questions part)."""
    ids = [tokenizer.encode(p) for p in PROMPTS]
    common = next(k for k in range(min(map(len, ids))) if len({tuple(x[:k + 1]) for x in ids}) > 1)
    return common // block_size


@pytest.mark.parametrize("mode,prefill", [("colocate", 0), ("disaggregate", 1), ("split", 0)])
def test_hits_through_the_cluster_give_one_engines_tokens(reference, smol_tokenizer, mode, prefill):
    before = shm_segments()
    llm = start(mode, prefill, engine=ENGINE)
    try:
        async def run():
            first = await asyncio.gather(*[tokens_of(llm, i) for i in range(2)])  # they fill the caches
            rest = await asyncio.gather(*[tokens_of(llm, i) for i in range(2, len(PROMPTS))])
            return first + rest

        assert asyncio.run(run()) == reference
        settle(llm)
        st = llm.stats
        assert st["prefix_cache_queries"] > st["prefix_cache_hits"] > 0
        if mode == "disaggregate":  # the decode instance held the system prompt: later hand-offs shared it
            # (the last four at least: the first two, sent together, may both find it cold)
            assert st["kv_reused_tokens"] >= 4 * shared_blocks(smol_tokenizer) * 16 > 0
        no_leak(llm)
    finally:
        stop(llm)
    assert shm_segments() <= before
