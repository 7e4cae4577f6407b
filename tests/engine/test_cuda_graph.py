"""The decode step a CUDA graph captures (engine/cuda_graph.py), run eagerly on the CPU: padded static
buffers give the dynamic step's tokens, padded rows touch only the scratch block, the sizes and the
KV options (--kv-cache-dtype, --enforce-eager) behave."""

from __future__ import annotations

import pytest
import torch

from tidal import SamplingParams
from tidal.config import CacheConfig, ConfigError, ModelConfig
from tidal.engine.cuda_graph import GraphedDecode, pad_to, padded_sizes
from tidal.engine.kv_cache import PagedKVCache
from tidal.engine.llm_engine import LLMEngine

PROMPTS = [[(53 * i + 7 * j) % 5000 + 50 for j in range(n)] for i, n in enumerate((9, 33, 17, 60, 4))]


def test_padded_sizes():
    assert padded_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert padded_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert padded_sizes(1) == [1]
    assert padded_sizes(300)[-3:] == [224, 256, 320]
    sizes = padded_sizes(6)
    assert [pad_to(n, sizes) for n in (1, 2, 3, 5, 6, 8)] == [1, 2, 4, 8, 8, 8] and pad_to(9, sizes) is None


def _static_engine(make_tiny_engine, monkeypatch, **kw):
    monkeypatch.setattr(LLMEngine, "static_decode_on_cpu", True)
    return make_tiny_engine(max_model_len=256, **kw)  # tables of 16 blocks: torch's path gathers them all


def _run(engine, prompts, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=p)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


@pytest.mark.parametrize("backend", ["auto", "torch"])  # tidal's C++ layers, and torch's masked SDPA
def test_static_padded_step_gives_the_dynamic_tokens(make_tiny_engine, monkeypatch, backend):
    want = _run(make_tiny_engine(attention_backend=backend, max_num_seqs=6, max_num_batched_tokens=32,
                                 max_model_len=256), PROMPTS)
    e = _static_engine(make_tiny_engine, monkeypatch, attention_backend=backend, max_num_seqs=6,
                       max_num_batched_tokens=32)
    g = e.runner.graphs
    assert g is not None and not g.capture and g.sizes == [1, 2, 4, 8]
    assert e.kv_cache.layers[0].k.shape[0] == e.kv_manager.num_blocks + 1  # the scratch block
    assert _run(e, PROMPTS) == want
    assert g.replays > 0


def _record_on_cpu(self, n):
    """GraphedDecode._record's stand-in on the CPU: a "graph" whose replay runs the static step again on
    the buffers as they are then and writes its logits into the tensor captured."""
    out = self._forward(n).clone()

    def replay():
        out.copy_(self._forward(n))

    return replay, out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_graph_captured_mid_run_replays_that_steps_inputs(make_tiny_engine, monkeypatch, async_scheduling):
    """A size is captured when a step first needs it, and again after the layers or the KV tensors change
    (KunServe's restore, a pool resize). Capture runs on padding rows: it must come before the step's
    inputs are written, or that step computes the padding's logits."""
    kw = dict(max_num_seqs=6, max_num_batched_tokens=32)
    want = _run(make_tiny_engine(max_model_len=256, **kw), PROMPTS, max_tokens=12)
    e = _static_engine(make_tiny_engine, monkeypatch, async_scheduling=async_scheduling, **kw)
    monkeypatch.setattr(GraphedDecode, "_record", _record_on_cpu)
    g = e.runner.graphs
    g.capture = True  # on demand only: the engine captures every size at start-up on CUDA alone
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", None, params, prompt_token_ids=p)
    got, steps = {}, 0
    while e.has_unfinished_requests():
        if steps == 6:
            g.state = ()  # as after a restore: every graph is dropped and the next step captures again
        for o in e.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
    assert got == want and g.captures > len(g.graphs) > 0  # (sizes were captured again after the reset)


def test_padded_rows_write_only_the_scratch_block(make_tiny_engine, monkeypatch):
    e = _static_engine(make_tiny_engine, monkeypatch, max_num_seqs=6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):  # three decodes: a step padded to four rows
        e.add_request(f"r{i}", None, params, prompt_token_ids=p)
    while e.last_result is None or e.last_result.composition.num_prefill_tokens or \
            e.last_result.composition.num_decode_seqs != 3:
        e.step()
    scratch = e.kv_cache.scratch_block
    for kv in e.kv_cache.layers.values():  # what a padded row writes is the same every step: wipe it first
        kv.k[scratch] = float("nan")
    before = {i: kv.k.clone() for i, kv in e.kv_cache.layers.items()}
    replays = e.runner.graphs.replays
    e.step()
    assert e.runner.graphs.replays == replays + 1 and e.last_result.composition.num_decode_seqs == 3
    bs = e.kv_cache.block_size
    for i, kv in e.kv_cache.layers.items():
        changed = (kv.k.nan_to_num(7.0) != before[i].nan_to_num(7.0)).flatten(2).any(-1).nonzero().tolist()
        slots = {b * bs + o for b, o in changed}
        assert scratch * bs in slots  # the padded row wrote there
        assert len(slots - {scratch * bs}) == 3  # and each real decode its one new slot


def test_graphs_step_aside_when_the_layers_change(make_tiny_engine, monkeypatch):
    e = _static_engine(make_tiny_engine, monkeypatch)
    chunks_ok = e.runner.graphs.takes
    e.model.drop_layers([1])
    e.kv_cache.drop_layers([1])

    class C:  # a sampled decode chunk
        is_decode, sample = True, True

    assert not chunks_ok([C()])


def test_a_pipeline_stage_runs_eager(make_tiny_engine, monkeypatch):
    monkeypatch.setattr(LLMEngine, "static_decode_on_cpu", True)
    assert make_tiny_engine(layer_range=(0, 2)).runner.graphs is None  # no head: its steps give hidden states
    assert make_tiny_engine(enforce_eager=True).runner.graphs is None


def test_scratch_block_survives_grow_and_shrink(tiny_llama):
    kv = PagedKVCache(tiny_llama.arch, [0, 1], 6, 16, torch.float32, torch.device("cpu"), scratch_block=True)
    assert kv.layers[0].k.shape[0] == 7 and kv.scratch_block == 6
    kv.layers[0].k[2] = 1.0
    kv.grow(3)
    assert kv.layers[0].k.shape[0] == 10 and kv.scratch_block == 9 and kv.layers[0].k[2].eq(1).all()
    kv.shrink(5, [])
    assert kv.layers[0].k.shape[0] == 5 and kv.scratch_block == 4
    with pytest.raises(ValueError, match="no scratch block"):
        _ = PagedKVCache(tiny_llama.arch, [0], 4, 16, torch.float32, torch.device("cpu")).scratch_block


def test_kv_cache_dtype_bfloat16_halves_the_block_bytes(make_tiny_engine):
    f32 = make_tiny_engine(kv_cache_memory="4MiB")
    b16 = make_tiny_engine(kv_cache_memory="4MiB", kv_cache_dtype="bfloat16")
    assert b16.kv_cache.layers[0].k.dtype == torch.bfloat16 and b16.dtype == torch.float32
    assert b16.kv_manager.num_blocks == 2 * f32.kv_manager.num_blocks
    assert b16.model.attention_backend == "torch"  # tidal's C++ kernels read a float32 cache only
    assert "KV cache bfloat16" in b16.describe_weights()
    out = _run(b16, PROMPTS[:2], max_tokens=4)
    assert all(len(t) == 4 for t in out.values())


def test_config_checks():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="enforce_eager must be true or false"):
        ModelConfig(enforce_eager="yes")
