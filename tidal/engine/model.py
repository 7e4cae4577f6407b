"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache.

The model can be built for a layer range (a pipeline stage: hidden states in and out; the first
stage embeds, the last one norms and projects) and can drop and restore decoder layers in place.
Attention reads and writes the paged KV tensors through the per-step :class:`AttentionBatch`,
which the runner builds; there is no global attention context.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tidal.common.progress import startup_phase
from tidal.config import ConfigError, ModelArch
from tidal.engine import native
from tidal.engine.attention import AttentionBatch, KVLayer, _triton_unavailable, attend, paged_attention
from tidal.engine.quant import (
    GROUP,
    GroupedInt8Weight,
    Int4Weight,
    int4_grid,
    int4_shape_ok,
    int4_supported,
    int8_grid,
    measure_crossover,
    measure_int8_crossover,
    pack_int4,
)


# ------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies, with the Llama-3 / linear scaling rules when configured."""
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = arch.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind in ("default", None):
        return inv.float()
    if kind == "linear":
        return (inv / float(sc["factor"])).float()
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`, short ones
        # kept, a smooth blend between the two thresholds.
        factor = float(sc["factor"])
        lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        orig = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = orig / lo, orig / hi
        smooth = (orig / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > lo_wl, inv / factor, inv)
        mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
        return torch.where(mid, blended, out).float()
    raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class Rotary(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int, device: torch.device):
        super().__init__()
        inv = rope_inv_freq(arch).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, D/2], computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; rotate-half convention (as the HF checkpoints expect)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's LlamaRMSNorm normalizes in float32 and rounds to x's dtype: so does the fused op, which
        # accumulates in float32 (the same bf16 values bit for bit; float32: tests/engine/test_parity.py)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


# ------------------------------------------------------------------------------------ layers
class Linear(nn.Linear):
    """nn.Linear that runs a 4-bit copy of its weight for steps of few tokens (see engine/quant.py)."""

    int4: Int4Weight | native.Q4_1Weight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.int4
        if q is None or x.shape[0] > q.max_tokens:
            return F.linear(x, self.weight, self.bias)
        y = q.matmul(x)
        return y if self.bias is None else y + self.bias


LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a decoder layer's matrices
_NONE = torch.empty(0)  # decode_layer's "no 4-bit copy"


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        self.q_size, self.kv_size = q, kv
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.qkv_proj = Linear(arch.hidden_size, q + 2 * kv, bias=arch.attention_bias)
        self.o_proj = Linear(q, arch.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.scale = arch.head_dim ** -0.5
        self._native: tuple | bool | None = None  # decode_layer's weight arguments (None: not built yet)

    def native_args(self) -> tuple | None:
        """The weight arguments of ``torch.ops.tidal.decode_layer`` for this layer, built once; None when
        a matrix's 4-bit copy is torch's (the op runs tidal's Q4_1 kernel or the float matmul only)."""
        if self._native is None:
            ws, qs, dm, shapes = [], [], [], []
            for name in LINEARS:
                lin = getattr(self, name)
                q = lin.int4
                if q is not None and not isinstance(q, native.Q4_1Weight):
                    self._native = False
                    return None
                ws.append(lin.weight)
                qs.append(q.qs if q is not None else _NONE)
                dm.append(q.dm if q is not None else _NONE)
                shapes += [q.n, q.k, q.max_tokens] if q is not None else [*lin.weight.shape, 0]
            bias = self.qkv_proj.bias
            # the norms (and a bias) in float32, the layer's dtype in C++ (a bfloat16 model's: widened copies)
            self._native = (self.input_layernorm.weight.float(), self.post_attention_layernorm.weight.float(), ws,
                            qs, dm, shapes, None if bias is None else bias.float())
        return self._native or None

    def native_forward(self, h: torch.Tensor, kv: KVLayer, batch: AttentionBatch, args: tuple) -> torch.Tensor:
        """forward with the two halves around the attention in C++ (engine/kernels/decode_layer.cpp)."""
        norm1, norm2, ws, qs, dm, shapes, bias = args
        eps = self.input_layernorm.eps
        qkv = torch.ops.tidal.layer_attn_in(h, norm1, ws, qs, dm, shapes, bias, *batch.rope, kv.k, kv.v,
                                            batch.slot_mapping, self.num_heads, self.num_kv_heads, eps)
        T, q, kvs = h.shape[0], self.q_size, self.kv_size
        a = attend(qkv[:, :q].view(T, self.num_heads, self.head_dim),
                   qkv[:, q:q + kvs].view(T, self.num_kv_heads, self.head_dim),
                   qkv[:, q + kvs:].view(T, self.num_kv_heads, self.head_dim), kv, batch, self.scale)
        return torch.ops.tidal.layer_attn_out(a, h, norm2, ws, qs, dm, shapes, eps)

    def fused_forward(self, h: torch.Tensor, kv: KVLayer, batch: AttentionBatch,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with its elementwise work in Triton kernels (engine/triton_fused.py): the norms (each with
        the residual add before it), RoPE with the K/V writes, and SiLU-and-product each one kernel. The
        layer's input is ``h + residual`` (``h`` alone if None); it returns ``(out, residual)`` whose sum is
        the layer's output, so that the next layer's norm does the add (vLLM's fused add-norm)."""
        from tidal.engine import triton_fused as tf

        T, eps = h.shape[0], self.input_layernorm.eps
        x, residual = tf.rms_norm(h, self.input_layernorm.weight, eps, residual=residual)
        qkv = self.qkv_proj(x)
        q = tf.rope_write_kv(qkv, *batch.rope, kv.k, kv.v, batch.slot_mapping, self.num_heads, self.num_kv_heads,
                             self.head_dim)
        k_new = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        a = attend(q, k_new, k_new, kv, batch, self.scale)  # (the Triton kernels read K and V from the cache)
        x, residual = tf.rms_norm(self.o_proj(a.view(T, self.q_size)), self.post_attention_layernorm.weight,
                                  self.post_attention_layernorm.eps, residual=residual)
        return self.down_proj(tf.silu_mul(self.gate_up_proj(x))), residual

    @staticmethod
    def fuses(batch: AttentionBatch) -> bool:
        """Whether a step runs :meth:`fused_forward`: the Triton attention's steps (a CUDA graph's too), not
        under --compile (Inductor fuses those itself)."""
        return batch.triton_attention and (batch.varlen is not None or not batch.prefills) and \
            not torch.compiler.is_compiling()

    def forward(self, h: torch.Tensor, kv: KVLayer, batch: AttentionBatch) -> torch.Tensor:
        if self.fuses(batch):
            out, residual = self.fused_forward(h, kv, batch)
            return out + residual
        T = h.shape[0]
        x = self.input_layernorm(h)
        qkv = self.qkv_proj(x)
        cos, sin = batch.rope
        # q and k rotated in one call: their heads sit side by side in qkv's rows
        qk = Rotary.apply(qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, self.head_dim)
        a = paged_attention(q, k, v, kv, batch, self.scale)
        h = h + self.o_proj(a.view(T, self.q_size))
        x = self.post_attention_layernorm(h)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """A decoder for layers ``[start, end)``; embeds if ``start == 0``, norms/projects if last."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 layer_range: tuple[int, int] | None = None, max_positions: int | None = None):
        super().__init__()
        self.arch = arch
        self.dtype, self.device = dtype, device
        start, end = layer_range or (0, arch.num_layers)
        if not 0 <= start < end <= arch.num_layers:
            raise ConfigError(f"layer range [{start}, {end}) is outside the model's {arch.num_layers} layers")
        self.start, self.end = start, end
        self.is_first, self.is_last = start == 0, end == arch.num_layers
        with torch.device("meta"):  # build without memory; weights are materialised by load_weights
            # _weight: no random init (on meta, nn.init.normal_ imports torch._dynamo: ~2 s per process)
            self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                             _weight=torch.empty(arch.vocab_size, arch.hidden_size)) \
                if self.is_first else None
            self.layers = nn.ModuleDict({str(i): DecoderLayer(arch) for i in range(start, end)})
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last else None
            self.lm_head = (nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
                            if self.is_last and not (arch.tie_word_embeddings and self.is_first) else None)
        self.rotary = Rotary(arch, max_positions or arch.max_position_embeddings, device)
        self._tied = arch.tie_word_embeddings
        self.quantization = "none"  # set by set_quantization(), before load_weights
        self._int4_tokens: dict[tuple[int, int], int] = {}  # matrix shape -> measured crossover
        self._head_tokens = 0  # the same for the LM head's grouped int8
        self.head_int8: GroupedInt8Weight | native.Q8_0Weight | None = None
        # tidal's paged decode attention and fused layers (float32 on CPU)
        self.native_attention = dtype == torch.float32 and native.available(device, dtype)
        # a bfloat16 model's decode-only steps in the fused float32 layer over its bfloat16 KV (set_attention)
        self.native_bf16_decode = False
        self.triton_attention = False  # the Triton kernels (set_attention)
        self.kernels = "torch"  # whose 4/8-bit kernels: torch's, or "tidal" (engine/native.py: float32/bf16 on CPU)

    def set_attention(self, backend: str, kv_dtype: torch.dtype) -> str:
        """Choose what attends (``--attention-backend``), given the KV cache's dtype; returns its name.
        ``auto``: the Triton kernels on CUDA (where Triton imports and the head size suits them), tidal's
        C++ kernels in float32 on CPU (they read and write a float32 cache), else torch's SDPA."""
        self.native_attention = backend == "auto" and kv_dtype == self.dtype == torch.float32 and \
            native.available(self.device, self.dtype)
        self.native_bf16_decode = backend == "auto" and native.bf16_decode(self.device, self.dtype, kv_dtype)
        want_triton = backend == "triton" or (backend == "auto" and self.device.type == "cuda")
        self.triton_attention = False
        if want_triton:
            why = _triton_unavailable(self.arch.head_dim)
            if why is None:
                self.triton_attention = True
            elif backend == "triton":
                raise ConfigError(f"--attention-backend triton: {why}")
        return self.attention_backend

    @property
    def attention_backend(self) -> str:
        return "triton" if self.triton_attention else "tidal-cpu" if self.native_attention else "torch"

    # ----------------------------------------------------------------- int4 weights
    def set_quantization(self, mode: str, max_step_tokens: int = 512, max_head_rows: int = 64) -> str | None:
        """Before :meth:`load_weights`: linear layers whose weights arrive as 4-bit groups (Q4_1) get an
        int4 copy. ``auto``: used up to the step size where timing here found the int4 kernel faster
        on that matrix shape (measured now, on synthetic weights of each shape; if it never was, no
        copies are made); ``int4``: for every step; ``none``: no copy. An LM head stored as Q8_0 gets a
        grouped int8 copy the same way. In float32 on CPU the kernels are tidal's own (engine/native.py,
        built at first use), else torch's. The timing goes up to the largest step the engine will run:
        ``max_step_tokens`` rows for the decoder matrices, ``max_head_rows`` (one per sequence) for the
        LM head. Returns why neither will run, or None."""
        self.kernels, why = "torch", None
        if mode != "none" and native.available(self.device, self.dtype):
            self.kernels = "tidal"  # torch's int4 kernel has no fast float32 path on CPUs without AVX-512
        elif mode != "none":
            why = int4_supported(self.device, self.dtype)
        self.quantization = mode if why is None else "none"
        self._int4_tokens, self._head_tokens = {}, 0
        if self.quantization != "none":
            shapes = list(dict.fromkeys(tuple(getattr(self.layers[str(self.start)], name).weight.shape) for name in LINEARS))
            timings = [] if mode == "int4" else [
                *((measure_crossover, s, max_step_tokens) for s in shapes if int4_shape_ok(*s)),
                *([(measure_int8_crossover, (self.arch.vocab_size, self.arch.hidden_size), max_head_rows)]
                  if self.is_last else [])]  # the LM head, if stored as Q8_0 groups
            new = [t for t in timings if not t[0].known(*t[1], self.dtype, kernels=self.kernels, upto=t[2])]
            with startup_phase(f"timing the {self.kernels} 4/8-bit kernels against {str(self.dtype).removeprefix('torch.')} "
                               f"matmuls ({len(new)} shapes; once per machine)", "timed") \
                    if new else contextlib.nullcontext():
                got = {(fn, s): fn(*s, self.dtype, kernels=self.kernels, upto=upto) for fn, s, upto in timings}
            for s in shapes:
                self._int4_tokens[s] = 0 if not int4_shape_ok(*s) else (1 << 30) if mode == "int4" else \
                    got[(measure_crossover, s)]
            if self.is_last:
                self._head_tokens = (1 << 30) if mode == "int4" else \
                    got[(measure_int8_crossover, (self.arch.vocab_size, self.arch.hidden_size))]
            if not any(self._int4_tokens.values()) and not self._head_tokens:  # skip the grid checks at load
                self.quantization = "none"
                return f"the int4/int8 kernels were not faster than {str(self.dtype).removeprefix('torch.')} " \
                       "matmuls at any step size here"
        return why

    def _set_int4(self, lin: Linear, grid: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        tokens = self._int4_tokens.get(tuple(lin.weight.shape), 0)
        lin.int4 = None
        if grid is not None and tokens > 0:
            lin.int4 = native.Q4_1Weight.pack(*grid) if self.kernels == "tidal" else pack_int4(*grid, self.dtype)
            lin.int4.max_tokens = tokens

    def quantization_report(self) -> dict:
        """Which decoder matrices have an int4 copy, and up to which step size it runs."""
        report = {"int4_matrices": 0, "float_matrices": 0, "int4_max_tokens": {}, "kernels": self.kernels,
                  "kernel_isa": native.build_isa() if self.kernels == "tidal" else None,
                  "head_int8_max_tokens": self.head_int8.max_tokens if self.head_int8 is not None else 0}
        for i in self.layer_ids:
            for name in LINEARS:
                q = getattr(self.layers[str(i)], name).int4
                report["int4_matrices" if q is not None else "float_matrices"] += 1
                if q is not None:
                    report["int4_max_tokens"][name] = q.max_tokens
        return report

    # ----------------------------------------------------------------- weights
    def _target(self, name: str) -> tuple[nn.Module, str, slice | None] | None:
        """Map an HF weight name to (module, param name, rows of a fused matrix) or None."""
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            if self.embed_tokens is not None:
                return self.embed_tokens, "weight", None
            if self.is_last and self._tied and self.lm_head is not None:
                return self.lm_head, "weight", None
            return None
        if name == "model.norm.weight":
            return (self.norm, "weight", None) if self.norm is not None else None
        if name == "lm_head.weight":
            return (self.lm_head, "weight", None) if self.lm_head is not None else None
        if parts[:2] != ["model", "layers"] or parts[2] not in self.layers:
            return None
        layer = self.layers[parts[2]]
        sub = ".".join(parts[3:])
        q, kv, inter = layer.q_size, layer.kv_size, self.arch.intermediate_size
        rows = {
            "self_attn.q_proj": ("qkv_proj", slice(0, q)),
            "self_attn.k_proj": ("qkv_proj", slice(q, q + kv)),
            "self_attn.v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
            "self_attn.o_proj": ("o_proj", None),
            "mlp.gate_proj": ("gate_up_proj", slice(0, inter)),
            "mlp.up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
            "mlp.down_proj": ("down_proj", None),
            "input_layernorm": ("input_layernorm", None),
            "post_attention_layernorm": ("post_attention_layernorm", None),
        }
        mod_name, pname = sub.rsplit(".", 1)
        if mod_name not in rows:
            return None
        target, sl = rows[mod_name]
        return getattr(layer, target), pname, sl

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Materialise parameters from HF-named fp32 tensors (fusing q/k/v and gate/up)."""
        staged: dict[tuple[int, str], torch.Tensor] = {}
        unfilled: dict[tuple[int, str], set[int]] = {}  # rows of a fused matrix no weight has written yet
        grids: dict[int, list] = {}  # id(Linear) -> its 4-bit grid while its parts arrive
        for name, tensor in weights:
            t = self._target(name)
            if t is None:
                continue
            mod, pname, rows = t
            key = (id(mod), pname)
            cur = getattr(mod, pname)
            if self.quantization != "none" and isinstance(mod, Linear) and pname == "weight":
                self._stage_grid(grids, mod, rows, tensor, fresh=cur.is_meta)
            if self._head_tokens and pname == "weight" and self.is_last and \
                    mod is (self.lm_head if self.lm_head is not None else self.embed_tokens):
                w32 = tensor.float()
                grid = int8_grid(w32)
                if self.kernels == "tidal" and w32.shape[0] % 8:
                    grid = None  # tidal's kernel takes whole tiles of eight rows
                self.head_int8 = None if grid is None else native.Q8_0Weight.pack(*grid, weight=w32, argmax=True) \
                    if self.kernels == "tidal" else GroupedInt8Weight.pack(*grid, self.dtype)
                if self.head_int8 is not None:
                    self.head_int8.max_tokens = self._head_tokens
            if key not in staged:
                staged[key] = torch.empty(cur.shape, dtype=self.dtype, device=self.device)
                if not cur.is_meta:
                    staged[key].copy_(cur)
                elif rows is not None:
                    unfilled[key] = set(range(cur.shape[0]))
            dst = staged[key] if rows is None else staged[key][rows]
            if dst.shape != tensor.shape:
                raise ConfigError(f"weight {name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            if rows is not None and key in unfilled:
                unfilled[key].difference_update(range(*rows.indices(cur.shape[0])))
            setattr(mod, pname, nn.Parameter(staged[key], requires_grad=False))
        missing = [n for n, p in self.named_parameters() if p.is_meta]
        if missing:
            raise ConfigError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")
        partial = {staged[k].data_ptr(): rows for k, rows in unfilled.items() if rows}
        if partial:  # name the first fused matrix some of whose rows no weight wrote
            n, p = next((n, p) for n, p in self.named_parameters() if p.data_ptr() in partial)
            raise ConfigError(f"weight {n} was only partly loaded (rows {min(partial[p.data_ptr()])}.. missing)")
        for layer in self.layers.values():  # new Parameters and 4-bit copies: decode_layer's arguments anew
            layer._native = None

    def _stage_grid(self, grids: dict[int, list], mod: Linear, rows: slice | None, tensor: torch.Tensor,
                    fresh: bool) -> None:
        """Keep the 4-bit grid of this (part of a fused) weight, from the checkpoint's float32 values;
        pack it as soon as every row has arrived (weights stream layer by layer, so at most a layer's
        grids are held at once). A part written over a loaded matrix (``not fresh``) leaves the other
        parts' grid unknown: that matrix gets no int4 copy."""
        n, k = mod.weight.shape
        entry = grids.get(id(mod))
        if entry is None:  # [q, d, m, rows still to come]; q None once the matrix is off the grid
            entry = grids[id(mod)] = [torch.zeros(n, k, dtype=torch.uint8), torch.zeros(n, k // GROUP),
                                      torch.zeros(n, k // GROUP), n]
            mod.int4 = None
            if not fresh and rows is not None:
                entry[0] = None
        part = rows if rows is not None else slice(None)
        entry[3] -= len(range(*part.indices(n)))
        w32 = tensor.float() if entry[0] is not None and tensor.dim() == 2 else None
        grid = int4_grid(w32) if w32 is not None else None
        if grid is not None and self.kernels == "tidal" and not native.q4_1_exact(w32, *grid):
            grid = None  # its scales are not float16 as GGUF's: the float16 (d, m) would round the weights
        if grid is None:
            entry[:3] = [None, None, None]
        else:
            for dst, src in zip(entry[:3], grid, strict=True):
                dst[part] = src
        if entry[3] <= 0:
            self._set_int4(mod, None if entry[0] is None else tuple(entry[:3]))
            entry[:3] = [None, None, None]  # packed (or not): the staged grid is freed

    # ----------------------------------------------------------------- drop / restore
    @property
    def layer_ids(self) -> list[int]:
        return sorted(int(k) for k in self.layers)

    def drop_layers(self, layer_ids: Iterable[int]) -> int:
        """Delete the parameters of these layers in place; returns the bytes freed."""
        freed = 0
        for i in layer_ids:
            freed += self.layer_weight_bytes(i)
            del self.layers[str(i)]
        return freed

    def layer_weight_bytes(self, i: int | None = None) -> int:
        """The bytes dropping layer ``i`` (default: the first present) frees: its parameters and its
        4-bit copies."""
        layer = self.layers[str(self.layer_ids[0] if i is None else i)]
        return (sum(p.numel() * p.element_size() for p in layer.parameters())
                + sum(lin.int4.nbytes for lin in (getattr(layer, n) for n in LINEARS) if lin.int4 is not None))

    def restore_layers(self, layer_ids: Iterable[int], weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rebuild dropped layers and load their weights (from the checkpoint or a peer)."""
        ids = sorted(set(layer_ids))
        for i in ids:
            if not self.start <= i < self.end:
                raise ConfigError(f"layer {i} is outside this stage [{self.start}, {self.end})")
            if str(i) in self.layers:
                raise ConfigError(f"layer {i} is present; nothing to restore")
            with torch.device("meta"):
                self.layers[str(i)] = DecoderLayer(self.arch)
        self.layers = nn.ModuleDict(dict(sorted(self.layers.items(), key=lambda kv: int(kv[0]))))
        wanted = {f"model.layers.{i}." for i in ids}
        self.load_weights((n, t) for n, t in weights if any(n.startswith(w) for w in wanted))

    def stage_layer(self, i: int, weights: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
        """A dropped layer rebuilt and loaded *beside* the model (it runs in no forward until
        :meth:`insert_layers`): KunServe Sec. 4.4 restores while requests keep running."""
        self.restore_layers([i], weights)
        return self.layers.pop(str(i))

    def insert_layers(self, staged: dict[int, nn.Module]) -> None:
        for i, layer in staged.items():
            if str(i) in self.layers:
                raise ConfigError(f"layer {i} is present; nothing to restore")
            self.layers[str(i)] = layer
        self.layers = nn.ModuleDict(dict(sorted(self.layers.items(), key=lambda kv: int(kv[0]))))

    # ----------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("this stage has no embedding (it is not the first stage)")
        return self.embed_tokens(input_ids)

    def forward(self, h: torch.Tensor, batch: AttentionBatch, kv_caches: dict[int, KVLayer],
                layer_ids: Iterable[int] | None = None) -> torch.Tensor:
        """Run the present layers (or ``layer_ids``) on hidden states ``h`` [T, hidden]."""
        batch.rope = self.rotary.tables(batch.positions, h.dtype)
        batch.native_attention = self.native_attention
        batch.triton_attention = self.triton_attention
        ids = self.layer_ids if layer_ids is None else layer_ids
        if DecoderLayer.fuses(batch):  # the Triton kernels: each layer's residual add done by the next one's norm
            residual = None
            for i in ids:
                h, residual = self.layers[str(i)].fused_forward(h, kv_caches[i], batch, residual)
            return h if residual is None else h + residual
        # eager steps run the layers in C++ (engine/kernels/decode_layer.cpp, what DecoderLayer.forward
        # computes): a step of decodes only as one call a layer, a step with prefills as the two halves
        # around the Python attention; under --compile Inductor fuses the Python layers instead
        native = self.native_attention and not torch.compiler.is_compiling()
        decodes_only = not batch.prefills and len(batch.decode_groups) == 1
        # a bfloat16 model's step of decodes: the fused float32 layers over the bfloat16 KV cache (the
        # hidden states widened here and rounded back after the last layer), when every layer has them
        wide = (self.native_bf16_decode and decodes_only and not torch.compiler.is_compiling()
                and all(self.layers[str(i)].native_args() is not None for i in ids))
        if wide:
            dtype, h = h.dtype, h.float()
            batch.rope = self.rotary.tables(batch.positions, torch.float32)
        for i in ids:
            layer = self.layers[str(i)]
            args = layer.native_args() if native or wide else None
            kv = kv_caches[i]
            if args is None:
                h = layer(h, kv, batch)
            elif decodes_only:
                h = torch.ops.tidal.decode_layer(h, *args, *batch.rope, kv.k, kv.v, batch.slot_mapping,
                                                 batch.decode_groups[0].block_tables, batch.positions,
                                                 layer.num_heads, layer.num_kv_heads, layer.input_layernorm.eps,
                                                 layer.scale)
            else:
                h = layer.native_forward(h, kv, batch, args)
        return h.to(dtype) if wide else h

    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(h).argmax(-1)`` where the LM head's Q8_0 kernel runs (tidal's fused argmax:
        the logits never reach memory), else None."""
        head = self.head_int8
        if self.norm is None or not isinstance(head, native.Q8_0Weight) or h.shape[0] > head.max_tokens:
            return None
        return head.argmax(self.norm(h))

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            raise RuntimeError("this stage has no head (it is not the last stage)")
        h = self.norm(h)
        if self.head_int8 is not None and h.shape[0] <= self.head_int8.max_tokens:
            return self.head_int8.matmul(h)
        w = self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight
        return F.linear(h, w).float()
