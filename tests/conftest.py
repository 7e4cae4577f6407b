"""Shared fixtures: the default checkpoint and tokenizer are loaded once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP's worker threads (torch's intra-op pool) spin while they wait for work by default. The
# suite runs beside its own server subprocesses (and, on a shared 2-core machine, beside whatever
# else runs), so spinning threads steal the cores the others need: a generate that takes 6 s took
# 30-60 s under load. Passive waiting changes no result, only who gets the CPU. It must be set
# before torch (libgomp) is loaded; the server subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every engine the tests build in this process reuses the parsed and dequantized default GGUF
# (tidal.engine.loader's opt-in cache; each engine still gets its own copy of the weights).
os.environ.setdefault("TIDAL_WEIGHT_CACHE_MB", "1024")
# The suite keeps its own disk cache (engine/disk_cache.py): it times the 4-bit/float crossovers on a
# loaded machine (two workers, their servers beside them), and the user's ~/.cache/tidal, which every
# later start trusts, must never hold a timing taken under that load. CI names its own, empty, cache.
os.environ.setdefault("TIDAL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tidal-tests"))
# Under xdist each worker (and the servers and cluster workers it starts) gets its share of the
# cores as torch threads: two workers each running two threads on two cores spent more time
# switching (and ~8 % more wall time on the engine modules) than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    from tidal.config import affinity_cores

    os.environ.setdefault("TIDAL_CPU_THREADS",
                          str(max(1, affinity_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # absent with -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: whole units of tests per worker, heaviest first (tests/scheduling.py)."""
    if config.getvalue("dist") == "loadgroup":
        from tests.scheduling import UnitScheduling

        return UnitScheduling(config, log)
    return None


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        from tests.scheduling import heaviest_first

        heaviest_first(items)


@pytest.fixture(scope="session")
def smol_ckpt():
    from tidal.engine.loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_ckpt):
    from tidal.engine.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(smol_ckpt)


@pytest.fixture
def reuse_smol_tokenizer(monkeypatch, smol_ckpt, smol_tokenizer):
    """``Tokenizer.from_checkpoint`` of the default GGUF returns the session's tokenizer (the same
    construction, ~3-5 s each) for a test that runs a command which builds its own; any other
    checkpoint's tokenizer is built as usual."""
    from tidal.engine.tokenizer import Tokenizer

    build = Tokenizer.from_checkpoint.__func__

    def from_checkpoint(cls, ckpt):
        if ckpt.format == "gguf" and os.path.samefile(ckpt.path, smol_ckpt.path):
            return smol_tokenizer
        return build(cls, ckpt)

    monkeypatch.setattr(Tokenizer, "from_checkpoint", classmethod(from_checkpoint))


@pytest.fixture(scope="session")
def make_engine(smol_ckpt, smol_tokenizer):
    """Build an LLMEngine on the shared SmolLM2 checkpoint with the given engine arguments."""
    from tidal.config import DEFAULT_CPU_KV_MEMORY, EngineConfig
    from tidal.engine.llm_engine import LLMEngine

    def build(ckpt=None, tokenizer=None, **kwargs):
        kwargs.setdefault("dtype", "float32")
        # the same KV budget on every device: on CUDA the default pool is 90 % of the GPU, so the
        # many engines one test session holds would each find the GPU already taken
        kwargs.setdefault("kv_cache_memory", DEFAULT_CPU_KV_MEMORY)
        ck = ckpt or smol_ckpt
        return LLMEngine(EngineConfig.from_kwargs(model=ck.path, **kwargs), checkpoint=ck,
                         tokenizer=tokenizer or (smol_tokenizer if ckpt is None else None))

    return build


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smol_ckpt):
    """A random-weight 4-layer Llama (safetensors) with the default model's vocabulary, for tests of
    the engine's mechanics (plans, preemption, KV moves), whose outcome does not depend on the
    weights: ~100x less compute per token than SmolLM2. Weights drawn with std 0.5 (not HF's 0.02)
    so that greedy picks are far apart (a flat random model's near-ties could flip on float32
    rounding between batch shapes)."""
    import torch
    import transformers

    from tidal.engine.loader import load_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=smol_ckpt.arch.vocab_size,
                                   max_position_embeddings=2048, initializer_range=0.5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return load_checkpoint(str(path))


@pytest.fixture(scope="session")
def make_tiny_engine(make_engine, tiny_llama, smol_tokenizer):
    """``make_engine`` on :func:`tiny_llama` (with the default model's tokenizer)."""
    def build(**kwargs):
        return make_engine(ckpt=tiny_llama, tokenizer=smol_tokenizer, **kwargs)

    return build


@pytest.fixture(scope="session")
def hf_smol(smol_ckpt):
    """transformers' own model on the same GGUF weights (the reference implementation)."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    # transformers parses the GGUF twice (the config, then the weights) and builds gguf's tensor-name
    # map once per module (~400 times, the same map): ~12 s of CPU. Both are pure functions of their
    # arguments; answered once each, the load takes ~5 s and gives the same model, tensor for tensor.
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    real_reader = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smol_ckpt.path), gguf_file=os.path.basename(smol_ckpt.path), dtype=torch.float32)
    readers.clear()
    return model.eval()


@pytest.fixture
def reuse_hf_smol(monkeypatch, smol_ckpt, hf_smol):
    """``AutoModelForCausalLM.from_pretrained`` of the default GGUF in float32 (as ``hf_smol`` is
    built) returns a shallow copy of the session's model: the same construction, which takes
    transformers ~10 s each (it parses and dequantizes the GGUF again). The copy shares the
    weights and modules but has its own attributes and generation config, so what the caller
    sets on it (``eval()``, the generation config's EOS) stays off ``hf_smol``. Any other model,
    dtype or argument is loaded as usual."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        gguf = kwargs.get("gguf_file")
        if (not args and set(kwargs) == {"gguf_file", "dtype"} and kwargs["dtype"] is torch.float32 and gguf
                and os.path.samefile(os.path.join(path, gguf), smol_ckpt.path)):
            model = copy.copy(hf_smol)
            model.generation_config = copy.deepcopy(hf_smol.generation_config)
            return model
        return load(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(from_pretrained))


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
