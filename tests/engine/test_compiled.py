"""``--compile``: steps of decodes (one, or a batch) run as torch.compile graphs and give eager's
tokens (float32, on conftest's random-weight ``tiny_llama``); a step with a prefill, and a model
whose layers were dropped, run eager."""

from __future__ import annotations

import shutil

import pytest

from tidal import LLM, SamplingParams
from tidal.config import ConfigError, EngineConfig

# Inductor's CPU backend builds C++: without a compiler --compile says so at start-up
needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler")

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def compiled_engine(make_tiny_engine):
    return make_tiny_engine(compile=True, max_num_batched_tokens=64)


@needs_cxx
def test_one_decode_compiled_gives_eager_tokens(compiled_engine, make_tiny_engine, smol_tokenizer):
    eager = LLM.from_engine(make_tiny_engine(max_num_batched_tokens=64))
    llm = LLM.from_engine(compiled_engine)
    compiled = compiled_engine.runner.compiled
    # 5 tokens (one block: the width is padded to two), 30 (crosses a block while decoding), 100
    prompts = [smol_tokenizer.encode("The tide")[:5], list(range(300, 330)), list(range(500, 600))]
    for p in prompts:
        before = compiled.calls
        ours = llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids
        assert ours == eager.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids
        assert compiled.calls - before == GREEDY.max_tokens - 1  # every decode step of the lone request
    # three requests together: their decode steps are batches (of three, then two after one finishes),
    # the compiled batch graph; steps with a prefill run eager
    short = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    reqs = [({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, (GREEDY, short, GREEDY), strict=True)]
    before, batched = compiled.calls, compiled.batches
    both = llm.generate([r for r, _ in reqs], [sp for _, sp in reqs])
    ref = eager.generate([r for r, _ in reqs], [sp for _, sp in reqs])
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in ref]
    assert compiled.calls - before == GREEDY.max_tokens - 1  # every step after the prefills
    assert compiled.batches - batched >= short.max_tokens - 1  # of which batches while all three ran, and more
    assert compiled_engine.kv_manager.num_free_blocks == compiled_engine.kv_manager.num_blocks
    assert "decode steps compiled" in compiled_engine.describe_weights()


@needs_cxx
def test_a_model_with_dropped_layers_runs_eager(compiled_engine, tiny_llama):
    e = compiled_engine
    before = e.runner.compiled.calls
    e.model.drop_layers([3])
    e.kv_cache.drop_layers([3])
    try:
        e.add_request("d", None, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                      prompt_token_ids=list(range(100, 120)))
        while e.has_unfinished_requests():
            e.step()
        assert e.runner.compiled.calls == before  # its decode steps ran eager on layers 0-2
    finally:
        e.model.restore_layers([3], tiny_llama.weights())
        e.kv_cache.add_layers([3])
    assert e.kv_manager.num_free_blocks == e.kv_manager.num_blocks


def test_compile_is_a_boolean_flag():
    from tidal.cli import build_parser
    from tidal.common import flags as F

    args = build_parser().parse_args(["serve", "--compile"])
    assert F.engine_kwargs(args)["compile"] is True
    assert "compile" not in F.engine_kwargs(build_parser().parse_args(["serve"]))
    assert EngineConfig.from_kwargs(compile=True).model.compile is True
    with pytest.raises(ConfigError):
        EngineConfig.from_kwargs(compile="yes")


@needs_cxx
def test_guards_are_skipped_only_in_a_state_already_checked(compiled_engine, make_tiny_engine):
    """Steps of a context width already run in the same state skip Dynamo's guard evaluation; a pool
    resize (new KV tensors) sends the first step of each width through the guards again; the tokens
    stay eager's throughout."""
    e, eager = compiled_engine, LLM.from_engine(make_tiny_engine(max_num_batched_tokens=64))
    compiled, llm = e.runner.compiled, LLM.from_engine(e)
    prompt = {"prompt_token_ids": list(range(700, 740))}  # decodes at positions 40-78: three widths
    want = eager.generate([prompt], GREEDY)[0].outputs[0].token_ids

    def run() -> tuple[int, int]:
        before, skipped = compiled.calls, compiled.unguarded
        assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
        return compiled.calls - before, compiled.unguarded - skipped

    ran, fast = run()
    assert ran == GREEDY.max_tokens - 1 and 0 < fast < ran
    assert run() == (ran, ran)  # every width seen: no guards at all
    blocks = e.kv_manager.num_blocks
    e.resize_pool(blocks - 8)  # new K/V tensors
    try:
        ran, fast = run()
        assert len(compiled.checked) >= 3 and ran - fast == len(compiled.checked)
    finally:
        e.resize_pool(blocks)
