"""Engine behaviour: preemption, KV moves, layer drop/restore, sampling (on conftest's random-weight
``tiny_llama``: these outcomes do not depend on the weights), and stops, EOS and text (on the real
model, whose text they read)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_parity import mixed_prompts
from tidal import LLM, SamplingParams
from tidal.core.request import FinishReason
from tidal.core.scheduler import RequestRejected

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run_all(engine, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in
            LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def prompts(smol_tokenizer):
    return mixed_prompts(smol_tokenizer)


@pytest.fixture(scope="module")
def reference(make_tiny_engine, prompts):
    """Greedy outputs with a KV pool large enough for everything."""
    return run_all(make_tiny_engine(max_num_batched_tokens=64), prompts)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_kv_pool_preempts_and_matches(make_tiny_engine, prompts, reference, mode):
    # 40 blocks of 16 tokens = 640 tokens for 8 requests that need ~1,100 together
    engine = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=40, preemption_mode=mode,
                         swap_space="64MiB")
    outs = run_all(engine, prompts)
    assert engine.scheduler.num_preemptions > 0, "the pool was not tight enough to preempt"
    assert outs == reference
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert engine.kv_manager.host_pool.num_free == engine.kv_manager.host_pool.num_blocks
    engine.kv_manager.check_invariants()


def test_a_swap_space_too_small_says_so_and_counts_the_fallbacks(make_tiny_engine, prompts, reference, capsys):
    """--preemption-mode swap with room for a few blocks (far less than one max_model_len
    request): a start-up warning says so, and the preemptions that wanted to swap and recomputed are
    counted apart from those that swapped; the outputs stay the reference's."""
    engine = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=40, preemption_mode="swap",
                              swap_space="96KiB")
    err = capsys.readouterr().err
    n = engine.kv_manager.host_pool.num_blocks
    assert 0 < n * 16 < engine.max_model_len
    assert f"warning: --swap-space 96 KiB holds {n} KV blocks ({n * 16} tokens), less than one request of " \
           f"max_model_len {engine.max_model_len} tokens" in err and engine.core.swap_warning
    assert run_all(engine, prompts) == reference
    st = engine.stats()
    assert st["num_swap_fallbacks"] > 0 and st["num_swap_preemptions"] > 0
    assert st["num_preemptions"] >= st["num_swap_fallbacks"] + st["num_swap_preemptions"]
    ok = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=40, preemption_mode="swap", swap_space="64MiB")
    assert "swap-space" not in capsys.readouterr().err and ok.core.swap_warning is None


def test_the_default_swap_space_is_4gib_and_costs_memory_only_as_it_is_used(make_tiny_engine):
    """vLLM's 4 GiB by default; allocated only in swap mode, and never touched until a block is
    swapped out (building the engine does not grow the process by gigabytes)."""
    from tidal.config import CacheConfig

    assert CacheConfig().swap_space == 4 * 2**30

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    assert make_tiny_engine(num_blocks_override=40).kv_manager.host_pool.num_blocks == 0  # recompute: no host pool
    before = rss()
    engine = make_tiny_engine(num_blocks_override=40, preemption_mode="swap")
    host = engine.kv_manager.host_pool.num_blocks
    assert host == 4 * 2**30 // (16 * engine.arch.kv_bytes_per_token(4, engine.arch.num_layers))
    assert rss() - before < 2**30


def test_abort_frees_blocks_at_once(make_tiny_engine, prompts):
    engine = make_tiny_engine(max_num_batched_tokens=64)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    for _ in range(6):
        engine.step()
    assert engine.kv_manager.num_free_blocks < engine.kv_manager.num_blocks
    engine.abort_request([str(i) for i in range(len(prompts))])
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_export_import_moves_request_between_engines(make_tiny_engine, prompts, reference):
    """Run a request on engine A for a while, export it, import it into engine B, finish there."""
    a, b = make_tiny_engine(max_num_batched_tokens=64), make_tiny_engine(max_num_batched_tokens=64, block_size=8)
    p = prompts[5]
    a.add_request("m", None, GREEDY, prompt_token_ids=p)
    while len(a.scheduler.requests["m"].output_token_ids) < 7:
        a.step()
    snap = a.export_request("m")
    assert snap.num_computed_tokens == len(p) + 6
    assert set(snap.kv) == set(range(a.arch.num_layers))
    assert snap.kv[0][0].shape == (len(p) + 6, a.arch.num_kv_heads, a.arch.head_dim)
    a.abort_request("m")
    assert a.kv_manager.num_free_blocks == a.kv_manager.num_blocks
    b.import_request(snap)
    out = None
    while b.has_unfinished_requests():
        for o in b.step():
            out = o
    assert out.outputs[0].token_ids == reference[5]
    assert b.kv_manager.num_free_blocks == b.kv_manager.num_blocks


def test_drop_and_restore_layers_round_trip(make_tiny_engine, prompts, reference, tiny_llama):
    engine = make_tiny_engine(max_num_batched_tokens=64)
    blocks = engine.kv_manager.num_blocks
    freed = engine.model.drop_layers(range(2, 4))
    assert freed > 0 and engine.model.layer_ids == [0, 1]
    kv_freed = engine.kv_cache.drop_layers(range(2, 4))
    assert kv_freed > 0
    engine.model.restore_layers(range(2, 4), tiny_llama.weights())
    engine.kv_cache.add_layers(range(2, 4))
    assert engine.model.layer_ids == [0, 1, 2, 3]
    assert engine.kv_manager.num_blocks == blocks
    assert run_all(engine, prompts) == reference


def test_seeded_sampling_is_reproducible(make_tiny_engine, prompts):
    engine = make_tiny_engine()
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    a = run_all(engine, prompts[:3], sp)
    b = run_all(engine, prompts[:3], sp)
    c = run_all(engine, prompts[:3], sp.clone(seed=99))
    assert a == b
    assert a != c
    g = run_all(engine, prompts[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert a != g  # temperature sampling does not collapse to greedy


def test_top_k_1_equals_greedy(make_tiny_engine, prompts, reference):
    engine = make_tiny_engine()
    sp = SamplingParams(temperature=1.0, top_k=1, max_tokens=20, ignore_eos=True)
    assert run_all(engine, prompts[:4], sp) == reference[:4]


def test_logprobs_match_log_softmax(make_engine, prompts):
    engine = make_engine()
    engine.runner.keep_logits = True
    engine.add_request("lp", None, SamplingParams(temperature=0, max_tokens=1, logprobs=5), prompt_token_ids=prompts[1])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    lp = outs[-1].outputs[0].logprobs[0]
    ref = engine.runner.last_logits["lp"].log_softmax(-1)
    top = ref.topk(5)
    assert lp.token_id == int(ref.argmax())
    # float32 reductions differ by kernel: 1.2e-5 apart on an H100, well below any rounding that matters
    assert lp.logprob == pytest.approx(float(ref.max()), abs=5e-5)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=5e-5)


def test_stop_string_truncates_and_finishes(make_engine, smol_tokenizer):
    engine = make_engine()
    llm = LLM.from_engine(engine)
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert "7" in base.text
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=["7"]))[0].outputs[0]
    assert out.text == base.text[: base.text.index("7")]
    assert out.finish_reason == "stop" and out.stop_reason == "7"
    inc = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=["7"],
                                                        include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == base.text[: base.text.index("7") + 1]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_stop_token_ids_and_length(make_engine):
    llm = LLM.from_engine(make_engine())
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_tok = base.token_ids[3]
    out = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12,
                                                        stop_token_ids=[stop_tok]))[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_eos_stops_unless_ignored(make_engine):
    llm = LLM.from_engine(make_engine())
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert "Paris" in out.text
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5,
                                           ignore_eos=True))[0].outputs[0]
    assert len(forced.token_ids) == len(out.token_ids) + 5
    assert forced.token_ids[: len(out.token_ids)] == out.token_ids


def test_streamed_deltas_concatenate_to_text(make_engine):
    engine = make_engine()
    engine.add_request("s", "Write three emoji and some accented words like café:",
                       SamplingParams(temperature=0.8, seed=3, max_tokens=40, stop=["zzz"]))
    text, toks, last = "", [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            text += o.outputs[0].delta_text
            toks += o.outputs[0].delta_token_ids
            last = o
    assert last.finished
    assert text == last.outputs[0].text
    assert toks == last.outputs[0].token_ids
    assert "\ufffd" not in text or "\ufffd" in engine.tokenizer.decode(toks)


def test_n_greater_than_one(make_engine):
    llm = LLM.from_engine(make_engine())
    out = llm.generate(["Tell me a color:"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.finished


def test_rejections(make_tiny_engine):
    engine = make_tiny_engine(max_model_len=64)
    with pytest.raises(RequestRejected):
        engine.add_request("long", None, SamplingParams(max_tokens=4), prompt_token_ids=[5] * 80)
    with pytest.raises(RequestRejected):
        engine.add_request("mt", None, SamplingParams(max_tokens=60), prompt_token_ids=[5] * 10)
    with pytest.raises(RequestRejected):
        engine.add_request("empty", "", SamplingParams())
    with pytest.raises(RequestRejected):
        engine.add_request("oov", None, SamplingParams(), prompt_token_ids=[10**9])
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    # max_tokens=None fills the context and finishes with "length"
    engine.add_request("fill", None, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       prompt_token_ids=[5] * 10)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 54 and outs[-1].outputs[0].finish_reason == FinishReason.LENGTH.value


def test_kv_pool_grow_and_shrink_at_run_time(make_tiny_engine, prompts, reference):
    engine = make_tiny_engine(num_blocks_override=64, max_num_batched_tokens=64)
    kvm, kvc = engine.kv_manager, engine.kv_cache
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    for _ in range(5):
        engine.step()
    kvm.grow(32)
    kvc.grow(32)
    for _ in range(5):
        engine.step()
    moves = kvm.shrink(40)
    assert moves is not None
    kvc.shrink(40, moves)
    assert kvm.num_blocks == kvc.num_blocks == 56
    assert kvc.layers[0].k.shape[0] == 56
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert [done[str(i)] for i in range(4)] == reference[:4]
    assert torch.is_tensor(kvc.layers[0].k)


def test_padded_static_batch_computes_the_padding_and_keeps_the_real_tokens(make_tiny_engine, prompts):
    """static.pad=true: the padding really runs through the model (prompts padded to the longest,
    dead rows for members that finished early), and the real tokens are those of the unpadded run."""
    def run(**args):
        engine = make_tiny_engine(max_num_batched_tokens=1024, max_num_seqs=4, batching="static", **args)
        for i, p in enumerate(prompts[:4]):  # outputs of 4, 8, 12, 16 tokens: early finishers leave dead rows
            engine.add_request(str(i), None, SamplingParams(temperature=0, max_tokens=4 * (i + 1), ignore_eos=True),
                               prompt_token_ids=p)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        return engine, done

    plain, ref = run()
    padded, outs = run(policy_args={"static.pad": True})
    assert outs == ref and len(outs) == 4
    assert plain.runner.padded_tokens_computed == 0
    lens = [len(p) for p in prompts[:4]]
    # the prefill alone pads every prompt to the longest; then one dead row per finished member per step
    assert padded.runner.padded_tokens_computed >= 4 * max(lens) - sum(lens) + (4 + 2 * 4 + 3 * 4)


def test_a_start_says_it_loads_the_weights(make_engine, smol_ckpt, capsys):
    """Loading (and packing) the weights takes seconds: a line when it begins, one when it ends."""
    import os
    import re

    capsys.readouterr()
    make_engine()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "weights" in ln]
    name = os.path.basename(smol_ckpt.path)
    assert len(lines) == 2 and lines[0].startswith(f"engine: loading the weights of {name}") \
        and lines[0].endswith(" ...") and re.fullmatch(r"engine: weights loaded in \d+\.\d s", lines[1]), lines
