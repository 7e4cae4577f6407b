"""``--scheduling prefill-first`` on the real engine (conftest's random-weight ``tiny_llama``): the
greedy outputs equal the default (chunked) scheduler's, with and without recomputes, and no step
the engine ran mixed prefill and decode."""

from __future__ import annotations

import pytest

from tests.engine.test_engine import run_all
from tests.engine.test_parity import mixed_prompts
from tidal import SamplingParams

# 60 tokens each: requests admitted together outgrow a tight pool while they decode
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smol_tokenizer):
    return mixed_prompts(smol_tokenizer)


@pytest.fixture(scope="module")
def chunked(make_tiny_engine, prompts):
    """The default scheduler's greedy outputs (chunks of 64 tokens beside the decodes)."""
    engine = make_tiny_engine(max_num_batched_tokens=64)
    outs = run_all(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions == 0
    return outs


def watch_plans(engine) -> list:
    plans = []
    schedule = engine.scheduler.schedule

    def recording(now):
        plans.append(schedule(now))
        return plans[-1]

    engine.scheduler.schedule = recording
    return plans


@pytest.mark.parametrize("num_blocks", [None, 24])
def test_prefill_first_matches_chunked_greedy(make_tiny_engine, prompts, chunked, num_blocks):
    # 24 blocks of 16 tokens = 384 tokens for 8 requests that need ~1,260 together: recomputes
    # the shapes without prefix caching: with it, a prompt cached but for its last token is one token
    # whose KV follows a long context, a decode by shape, in a prefill step (checked for its tokens below)
    engine = make_tiny_engine(max_num_batched_tokens=512, scheduling="prefill-first", num_blocks_override=num_blocks,
                              enable_prefix_caching=False)
    plans = watch_plans(engine)
    assert run_all(engine, prompts, GREEDY) == chunked
    cached = make_tiny_engine(max_num_batched_tokens=512, scheduling="prefill-first", num_blocks_override=num_blocks)
    assert run_all(cached, prompts, GREEDY) == chunked
    if num_blocks:
        assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    recomputed = 0
    for plan in plans:
        decodes = [c.is_decode for c in plan.chunks]
        assert all(decodes) or not any(decodes), f"step {plan.step_id} mixes prefill and decode"
        recomputed += sum(1 for c in plan.chunks if not c.is_decode and c.output_index > 0)
    assert any(not any(c.is_decode for c in p.chunks) and len(p.chunks) > 1 for p in plans)  # batched prefills
    assert (recomputed > 0) == bool(num_blocks)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_padded_prefill_computes_its_rectangle_and_changes_no_output(make_tiny_engine, prompts, chunked):
    """``--pad-prefill`` (an engine without variable-length attention, BucketServe's padding): every
    prefill step is a rectangle of its longest prompt, the padding is really run through the model
    and thrown away, so the greedy outputs are the unpadded ones."""
    engine = make_tiny_engine(max_num_batched_tokens=512, scheduling="prefill-first", pad_prefill=True)
    plans = watch_plans(engine)
    assert run_all(engine, prompts, GREEDY) == chunked
    expected = 0
    for plan in plans:
        prompts_ = [c for c in plan.chunks if not c.is_decode]
        longest = max((c.num_tokens for c in prompts_), default=0)
        assert plan.composition.num_padded_tokens == sum(longest - c.num_tokens for c in prompts_)
        expected += plan.composition.num_padded_tokens
    assert expected > 0 and engine.runner.padded_tokens_computed == expected
