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


# ``make test`` runs two xdist workers with ``--dist loadgroup --no-loadscope-reorder``. Under it
# every test module is one unit of work (its module-scoped clusters, servers and Ray are built once,
# not once on each worker), the modules that use the session's servers are one unit (the servers
# load on one worker only), and so are the three that load transformers' model (``hf_smol``).
# Units go out longest first, so that the last ones to start are short and the two workers end
# together; the order is a rough ranking of CPU cost measured on the 2-core CI machine, and a module
# not named keeps its place after them.
HEAVY_FIRST = (
    "@servers",
    "tests/runtime/test_kunserve_runtime.py",
    "tests/server/test_dashboard.py",
    "@hf_smol",
    "tests/runtime/test_migrate_runtime.py",
    "tests/runtime/test_same_decisions.py",
    "tests/runtime/test_cluster.py",
    "tests/bench/test_kv_transfer_bench.py",
    "tests/bench/test_reproduce.py",
    "tests/engine/test_disk_cache.py",
    "tests/server/test_soak.py",
    "tests/runtime/test_same_split_decisions.py",
    "tests/runtime/test_split_runtime.py",
    "tests/engine/test_profiler.py",
    "tests/common/test_progress_and_flags.py",
    "tests/test_cli.py",
    "tests/sim/test_same_plans.py",
    "tests/engine/test_engine.py",
    "tests/sim/test_sim_cli.py",
    "tests/server/test_shutdown.py",
    "tests/runtime/test_kv_transfer.py",
    "tests/workload/test_workloads.py",
)
HF_SMOL_MODULES = ("tests/bench/test_offline_bench.py", "tests/engine/test_loader.py", "tests/engine/test_parity.py")


def _group(item, server_modules: set[str]) -> str:
    module = item.nodeid.split("::")[0]
    if module in server_modules:
        return "servers"
    return "hf_smol" if module in HF_SMOL_MODULES else module


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under --dist loadgroup
        return
    server_modules = {i.nodeid.split("::")[0] for i in items if "server_procs" in getattr(i, "fixturenames", ())}
    rank = {name.lstrip("@"): n for n, name in enumerate(HEAVY_FIRST)}
    groups = {id(i): _group(i, server_modules) for i in items}
    for i in items:
        i.add_marker(pytest.mark.xdist_group(groups[id(i)]))
    # a stable sort: each group keeps its tests in collection order, and each worker sorts alike
    items.sort(key=lambda i: rank.get(groups[id(i)], len(rank)))


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
