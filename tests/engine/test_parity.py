"""Greedy outputs and logits equal transformers' on the same weights (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import hf_greedy
from tidal import LLM, SamplingParams

BASE = [
    "The capital of France is",
    "Write a short poem about the ocean and the moon.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three reasons why exercise is good for you:",
    "Translate to French: The weather is nice today.",
    "Once upon a time, in a small village at the edge of a great forest,",
    "Question: What is 17 times 3? Answer:",
    "Photosynthesis is the process by which",
]


def mixed_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 6 to ~300 tokens: padded with text so lengths vary widely."""
    filler = ("In the history of science, many discoveries were made by accident. " * 30)
    out = []
    for i, text in enumerate(BASE):
        ids = tokenizer.encode(text)
        extra = [0, 0, 20, 60, 120, 200, 290, 5][i]
        if extra:
            ids = tokenizer.encode(filler)[:extra] + ids
        out.append(ids)
    return out


@pytest.mark.parametrize("preemption", ["recompute"])
def test_greedy_continuous_batch_matches_transformers(make_engine, smol_tokenizer, hf_smol, preemption):
    prompts = mixed_prompts(smol_tokenizer)
    assert len({len(p) for p in prompts}) == 8 and max(len(p) for p in prompts) > 250
    engine = make_engine(max_num_batched_tokens=32, max_num_seqs=8, preemption_mode=preemption)
    llm = LLM.from_engine(engine)
    # watch the steps: chunks of prefill must share steps with decodes
    mixed_steps = 0
    params = SamplingParams(temperature=0, max_tokens=24)
    ids = []
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", None, params, prompt_token_ids=p)
        ids.append(f"p{i}")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        comp = engine.last_result.composition
        assert comp.num_tokens <= 32
        if comp.num_prefill_tokens and comp.num_decode_seqs:
            mixed_steps += 1
    assert mixed_steps > 0, "prefill chunks never shared a step with decodes"
    for i, p in enumerate(prompts):
        ours = outs[f"p{i}"].outputs[0].token_ids
        ref = hf_greedy(hf_smol, p, 24)
        assert ours == ref, f"prompt {i} (len {len(p)}): {ours} != {ref}"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    del llm


def test_first_step_logits_match_transformers(make_engine, smol_tokenizer, hf_smol):
    prompts = mixed_prompts(smol_tokenizer)[:4]
    engine = make_engine(max_num_batched_tokens=64)
    engine.runner.keep_logits = True
    for i, p in enumerate(prompts):
        engine.add_request(f"l{i}", None, SamplingParams(temperature=0, max_tokens=1), prompt_token_ids=p)
    logits = {}
    while engine.has_unfinished_requests():
        engine.step()
        logits.update(engine.runner.last_logits)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf_smol(torch.tensor([p])).logits[0, -1].float()
        diff = (logits[f"l{i}"] - ref).abs().max().item()
        assert diff < 1e-3, f"prompt {i}: max |logit diff| {diff}"


def _random_hf_model(tmp_path, kind: str, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger weights so the random model's greedy path is not all ties
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.hf.save_pretrained(path)
    return path, model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_random_weight_models_match_transformers(tmp_path, make_engine, smol_tokenizer, kind):
    from tidal.engine.loader import load_checkpoint

    path, ref_model = _random_hf_model(tmp_path, kind, smol_tokenizer)
    ckpt = load_checkpoint(str(path))
    assert ckpt.arch.architecture == kind
    assert ckpt.arch.attention_bias == (kind == "qwen2")
    engine = make_engine(ckpt=ckpt, tokenizer=smol_tokenizer, max_num_batched_tokens=16, block_size=8)
    engine.runner.keep_logits = True
    rng = random.Random(1)
    prompts = [[rng.randrange(3, len(smol_tokenizer)) for _ in range(n)] for n in (3, 40, 90, 150)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            g = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
        ref = g[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
    # first-step logits of the last prompt
    engine.add_request("x", None, SamplingParams(temperature=0, max_tokens=1), prompt_token_ids=prompts[2])
    while engine.has_unfinished_requests():
        engine.step()
    with torch.no_grad():
        ref_logits = ref_model(torch.tensor([prompts[2]])).logits[0, -1]
    assert (engine.runner.last_logits["x"] - ref_logits).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers_bit_for_bit(dtype):
    """The fused RMSNorm against transformers' LlamaRMSNorm formula (float32 math, rounded to the
    input dtype, then times the weight), on rows of many scales."""
    from tidal.engine.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 576, generator=g) * torch.logspace(-3, 3, 33).unsqueeze(1)).to(dtype)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    norm = norm.to(dtype)
    h = x.float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(x), want)
