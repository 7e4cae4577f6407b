"""tidal's own CPU kernels for float32: matmuls over GGUF's Q4_1 and Q8_0 blocks (their codes and float16
scales, unchanged; Q4_1 regrouped in tiles of eight output rows)
(``kernels/qmatmul.cpp``), and decode attention over the paged KV cache without gathering it
(``kernels/paged_attention.cpp``).

Why: where ``auto`` picks float32 (a CPU without native bf16, or whose bf16 matmuls are slower), torch's int4 kernel
(``_weight_int4pack_mm_for_cpu``) has no fast path and loses to the float32 matmul at every step
size, so one decode read the whole float32 model (~540 MB for SmolLM2-135M) per token. These read
Q4_1 at 0.625 bytes a weight (16 bytes of nibbles and two float16 scales per block of 32) and Q8_0
at 1.06, and unpack in registers (AVX2/FMA/F16C where the CPU has them). Steps of 16 rows or more
dequantize a panel of 16 outputs (32 where built for AVX-512) at a time into a float32 buffer and run
a register-blocked GEMM micro-kernel over it, so that prefill chunks and batches of decodes also run on the 4-bit weights
(where the start-up timing finds them faster than the float32 matmul).

A prefill chunk attends with a tiled causal kernel (``kernels/prefill_attention.cpp``, FlashAttention-2's
loop with register-blocked tiles, 512-bit where built for AVX-512), 1.0-2.3x torch's masked SDPA at chunks of 37-512 tokens on an AVX-512 Xeon.

Greedy decoding's token from a Q8_0 LM head at steps of 16 rows or more, on CPUs with AVX-512 VNNI,
comes by bound and verify (``kernels/greedy_head.cpp``): int8 estimates of every logit with a rigorous
error bound, then the few logits that can still win computed exactly as ``q8_0_mm`` computes them, so
the token is the same; ~2.2x the exact fused argmax at 16-64 rows (SmolLM2's 49152 x 576 head).

The decode attention kernel replaces, per layer, the gather of every decode's blocks into one padded tensor
and a masked SDPA call; a decode's context is split into spans merged afterwards (split-K), so a
lone decode keeps every core busy (see the source's header).

A step of decodes (eager) runs each decoder layer as one C++ call, ``decode_layer``
(``kernels/decode_layer.cpp``): the kernels above, with the norms, RoPE, KV writes, SiLU and residuals
as loops over the rows instead of ~35 torch calls a layer from Python, which at one decode cost more
than the layer's arithmetic (the same values to float32 rounding).

The sources are compiled at first use with torch's extension tooling (a C++ compiler and ninja;
about a minute, once per machine: the build is cached under ``TORCH_EXTENSIONS_DIR``), with a line on
stderr before and after. One process builds at a time, under a flock beside the build folder that dies
with its holder (``<build folder>.tidal.lock``, holding its pid): another start waits and says for whom,
at most ``TIDAL_START_WAIT_S`` (600 s), then runs torch's kernels; a build that was stopped (a SIGKILL,
a closed terminal) leaves torch's baton and half-built objects, which the next holder of the lock
removes. Without a compiler :func:`load` says why and the engine keeps torch's kernels. The ops are
``torch.ops.tidal.q4_1_mm``, ``q8_0_mm``, ``paged_decode_attention`` (with fake, shape-only
implementations so that ``--compile`` traces through them), and ``prefill_attention``, ``decode_layer``,
``layer_attn_in`` and ``layer_attn_out`` (eager steps only, never traced: compiled steps run the Python
layers, and SDPA for prefills).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.common.locks import LockTimeout, exclusive
from tidal.common.progress import startup_line, startup_phase
from tidal.config import env_str, start_wait_s

GROUP = 32  # weights per GGUF Q4_1 / Q8_0 block
_DIR = Path(__file__).with_name("kernels")
MATMUL_SOURCES = [_DIR / "qmatmul.cpp"]  # what the matmul crossovers (engine/quant.py) are timed on
SOURCES = [*MATMUL_SOURCES, *(_DIR / f for f in ("paged_attention.cpp", "prefill_attention.cpp", "decode_layer.cpp",
                                                   "greedy_head.cpp"))]
HEADERS = [_DIR / "kernels.h"]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str


def _simd_flags() -> list[str]:
    """AVX2 + FMA + F16C when torch found AVX2 (or better) on this CPU, and AVX-512F where it found
    AVX-512 (the panels' micro-kernel then runs 16 floats wide); portable code otherwise, or when
    ``TIDAL_NATIVE_SIMD=0`` (the tests build both; ``TIDAL_NATIVE_SIMD=avx2`` builds without AVX-512)."""
    cap = torch.backends.cpu.get_cpu_capability()
    want = env_str("TIDAL_NATIVE_SIMD", "1")
    if cap not in ("AVX2", "AVX512") or want == "0":
        return []
    return ["-mavx2", "-mfma", "-mf16c", *(["-mavx512f"] if cap == "AVX512" and want != "avx2" else [])]


def build_isa() -> str:
    """What the kernels are built for here: ``AVX-512``, ``AVX2`` or ``portable`` C++."""
    flags = _simd_flags()
    return "AVX-512" if "-mavx512f" in flags else "AVX2" if flags else "portable"


def load() -> str | None:
    """Build (first time on this machine) and load the kernels; None when loaded, else why not."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _build()
        return None if _state["ok"] else str(_state["why"])


def _flags() -> list[str]:
    return ["-O3", *_simd_flags()]


def _digest(files: list[Path], extra: str = "") -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in files) + " ".join(_flags()).encode()
                          + extra.encode()).hexdigest()[:12]


def build_name() -> str:
    """The library's name: a digest of the sources and flags, so an edited kernel is built anew; and of
    where the sources are and torch's version, so each checkout (each torch) has a build folder of its
    own, whose ninja file never changes. (Two checkouts of one source shared the folder, and each
    start of the other one rebuilt it, ninja's commands naming other paths, with no line saying so.)"""
    where = " ".join(sorted({str(f.resolve().parent) for f in SOURCES + HEADERS}))
    return f"tidal_kernels_{_digest(SOURCES + HEADERS, f' {where} torch {torch.__version__}')}"


def matmul_build() -> str:
    """The build of the Q4_1/Q8_0 matmuls alone (their source, the shared header, the flags): engine/
    quant.py keys its timed crossovers by it, so an edited matmul is timed anew and an edit of another
    kernel (attention) does not throw the timings away."""
    return f"qmatmul_{_digest(MATMUL_SOURCES + HEADERS)}"


def _build() -> tuple[bool, str]:
    if env_str("TIDAL_NO_NATIVE"):
        return False, "TIDAL_NO_NATIVE is set"
    flags, name, wait_s = _flags(), build_name(), start_wait_s()
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        # one process of the machine builds (or loads) at a time, under a lock that dies with it: torch's
        # own baton (the file `lock` in the build folder) is a plain file that a killed build leaves
        # behind, and every later start would wait on it for ever
        with exclusive(f"{build_dir}.tidal.lock", "building tidal's kernels", wait_s) as held:
            if held:
                _clear_interrupted(build_dir, name)
            phase = contextlib.nullcontext() if _complete(build_dir, name) else startup_phase(
                f"building tidal's CPU kernels ({' '.join(flags)}; once per machine, about a minute)", "kernels built")
            with phase:
                # -fopenmp: at::parallel_for is an OpenMP region compiled into this library (without the flag
                # it runs on one thread); libgomp.so.1 resolves to the copy torch has already loaded
                cpp_extension.load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=[*flags, "-fopenmp"],
                                   extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                                   is_python_module=False, verbose=False)
    except LockTimeout as e:
        startup_line(f"warning: {e}; this start runs torch's kernels (TIDAL_START_WAIT_S sets the wait)")
        return False, f"tidal's kernels were still being built elsewhere ({e})"
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: all mean "use torch's"
        first = " ".join(str(e).split())[:200] or type(e).__name__
        startup_line(f"tidal's kernels could not be built ({first}); torch's kernels run instead")
        return False, f"tidal's kernels could not be built ({first})"
    _register_fakes()
    return True, ""


def _complete(build_dir: Path, name: str) -> bool:
    """Whether the library was built to the end: ninja logs a step only once it has finished, so a link
    that was cut off (a partial ``.so``) is not in ``.ninja_log``."""
    try:
        log = (build_dir / ".ninja_log").read_text(errors="replace")
    except OSError:
        return False
    return (build_dir / f"{name}.so").is_file() and any(
        line.split("\t")[3:4] == [f"{name}.so"] for line in log.splitlines())


def _clear_interrupted(build_dir: Path, name: str) -> None:
    """Under the build lock, what an interrupted build left: torch's baton (only a holder of the lock
    builds, so no live process owns it) and, where the library was never finished, every half-built
    object, so that the build starts clean."""
    baton = build_dir / "lock"
    if baton.exists():
        baton.unlink(missing_ok=True)
        startup_line(f"removed the build lock {baton}, left by a kernel build that was stopped")
    if not _complete(build_dir, name) and any(build_dir.iterdir()):
        shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True)
        startup_line(f"removed the half-built kernels in {build_dir}")


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH: the pip package's binary is there only in an activated venv."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def _register_fakes() -> None:
    @torch.library.register_fake("tidal::q4_1_mm")
    def _q4(x, qs, dm, n, k):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tidal::q8_0_mm")
    def _q8(x, qs, d, n, k):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tidal::q8_0_argmax")
    def _q8_argmax(x, qs, d, n, k):
        return x.new_empty(x.shape[0], dtype=torch.long)

    @torch.library.register_fake("tidal::q8_0_argmax_bounded")
    def _q8_argmax_bounded(x, wu8, ds, nb, w1, n, k):
        return x.new_empty(x.shape[0], dtype=torch.long)

    @torch.library.register_fake("tidal::paged_decode_attention")
    def _attn(q, k_cache, v_cache, block_tables, positions, scale):
        return torch.empty_like(q)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tidal's kernels run here: float32 or bfloat16 on CPU, and the kernels built. They compute in
    float32: a bfloat16 model's activations are widened on the way in and rounded on the way out, and its
    decode steps run the fused layer in float32 over its bfloat16 KV cache (:func:`bf16_decode`)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and load() is None


def bf16_decode(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether a bfloat16 model's decode-only steps run ``decode_layer`` (hidden states in float32, the
    KV cache in bfloat16) instead of ~35 ATen calls a layer: on CPU, with the kernels built."""
    return device.type == "cpu" and dtype == torch.bfloat16 and kv_dtype == torch.bfloat16 and load() is None


def _in_f32(op, x: torch.Tensor, *args) -> torch.Tensor:
    """``op`` on ``x`` in float32 (the kernels' dtype), the result in ``x``'s dtype (a 16-bit float: widened
    and rounded back; anything else goes as it is, and the kernel names what it cannot take)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return op(x.contiguous(), *args)
    return op(x.float().contiguous(), *args).to(x.dtype)


# ------------------------------------------------------------------------------ packed weights
def _tiles(scales: torch.Tensor) -> torch.Tensor:
    """Per-block scales [N, K/32] in tiles of eight output rows: [N/8, K/32, 8]."""
    n, blocks = scales.shape
    return scales.view(n // 8, 8, blocks).permute(0, 2, 1)


@dataclass
class Q4_1Weight:
    """A Q4_1 matrix as the kernel reads it, eight output rows to a tile: nibbles [N/8, K/32, 16, 8]
    (byte (j, c) = q_j | q_{j+16} << 4 of the tile's row c) and (d, m) float16 [N/8, K/32, 2, 8]."""

    qs: torch.Tensor
    dm: torch.Tensor
    n: int
    k: int
    max_tokens: int = 0  # steps with at most this many tokens use it (set by measurement)

    @property
    def nbytes(self) -> int:
        return self.qs.numel() + self.dm.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _in_f32(torch.ops.tidal.q4_1_mm, x, self.qs, self.dm, self.n, self.k)

    @classmethod
    def pack(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4_1Weight:
        """From a grid ``w = q * d + m`` (q uint8 [N, K], d and m [N, K/32]), the scales kept as float16
        as GGUF stores them (:func:`q4_1_exact` checks that this loses nothing)."""
        n, k = q.shape
        d16, m16 = d.to(torch.float16), m.to(torch.float16)
        if n % 8:
            raise ValueError(f"a Q4_1 matrix for tidal's kernel needs a multiple of 8 output rows, not {n}")
        g = q.view(n // 8, 8, k // GROUP, 2, GROUP // 2)
        qs = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).permute(0, 2, 3, 1).contiguous()  # [N/8, K/32, 16, 8]
        return cls(qs, torch.stack([_tiles(d16), _tiles(m16)], dim=2).contiguous(), n, k)


@dataclass
class Q8_0Weight:
    """A Q8_0 matrix in the same tiles of eight output rows: int8 [N/8, K/32, 32, 8] (byte (j, c) =
    q_j of the tile's row c) and d float16 [N/8, K/32, 8]."""

    qs: torch.Tensor
    d: torch.Tensor
    n: int
    k: int
    max_tokens: int = 0
    # greedy_head.cpp's copy for bound-and-verify argmax (u8 codes, scales, block norms, row norms), or None
    bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in self.bounds) if self.bounds is not None else 0
        return self.qs.numel() + self.d.numel() * 2 + extra

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _in_f32(torch.ops.tidal.q8_0_mm, x, self.qs, self.d, self.n, self.k)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``matmul(x).argmax(-1)`` (torch's rule for ties and NaN) without the logits in memory: by bound
        and verify (int8 estimates, the few logits that can win computed exactly) for steps of
        ``BOUNDED_MIN_ROWS`` rows or more where the CPU has AVX-512 VNNI; the same token either way."""
        x = x.float().contiguous()
        if self.bounds is not None and x.shape[0] >= BOUNDED_MIN_ROWS:
            tokens = torch.ops.tidal.q8_0_argmax_bounded(x, *self.bounds, self.n, self.k)
            if bool((tokens >= 0).all()):
                return tokens
        return torch.ops.tidal.q8_0_argmax(x, self.qs, self.d, self.n, self.k)

    @classmethod
    def pack(cls, q: torch.Tensor, d: torch.Tensor, weight: torch.Tensor | None = None, *,
             argmax: bool = False) -> Q8_0Weight | None:
        """From ``w = q * d`` (q int8 [N, K], d [N, K/32]); with ``weight`` given, None unless the
        float16 ``d`` rebuilds it exactly. ``argmax``: the matrix will be asked for greedy tokens (an LM
        head), so it also gets the bound-and-verify copy where that runs."""
        n, k = q.shape
        if n % 8:
            raise ValueError(f"a Q8_0 matrix for tidal's kernel needs a multiple of 8 output rows, not {n}")
        d16 = d.to(torch.float16)
        if weight is not None and not _exact(weight, q, d16, None):
            return None
        qs = q.view(n // 8, 8, k // GROUP, GROUP).permute(0, 2, 3, 1).contiguous()
        ok = n % 16 == 0 and bool(torch.isfinite(d16).all())  # the bounds need finite scales
        bounds = _bounds(q, d16) if argmax and ok and bounded_argmax() else None
        return cls(qs, _tiles(d16).contiguous(), n, k, bounds=bounds)


BOUNDED_MIN_ROWS = 16  # greedy_head.cpp's kMinRows: from here q8_0_argmax runs the panels' one FMA chain per output


def bounded_argmax() -> bool:
    """Whether greedy_head.cpp's bound-and-verify argmax runs here (built for AVX-512, a CPU with VNNI)."""
    return load() is None and bool(torch.ops.tidal.q8_0_argmax_bounded_supported())


def _bounds(q: torch.Tensor, d16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """greedy_head.cpp's layouts of a Q8_0 matrix (q int8 [N, K], d [N, K/32]): codes + 128 as uint8
    [N/16, K/32, 8, 16, 4], scales d and block norms |d| sum|q| float32 [N/16, K/32, 16], row norms [N]
    (the sums in float64, rounded up to float32)."""
    n, k = q.shape
    g = k // GROUP
    wu8 = (q.to(torch.int16) + 128).to(torch.uint8).view(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    d = d16.double()
    norms = d.abs() * q.view(n, g, GROUP).abs().sum(-1, dtype=torch.int32).double()  # [N, K/32]
    up = float(torch.finfo(torch.float32).eps)

    def groups(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // 16, 16, g).permute(0, 2, 1).contiguous()

    return wu8, groups(d), groups(norms * (1 + up)), (norms.sum(-1) * (1 + up)).float().contiguous()


def q4_1_exact(weight: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> bool:
    """Whether the grid with its scales rounded to float16 rebuilds ``weight`` exactly."""
    return _exact(weight, q, d.to(torch.float16), m.to(torch.float16))


def _exact(weight: torch.Tensor, q: torch.Tensor, d16: torch.Tensor, m16: torch.Tensor | None) -> bool:
    """Whether the float16 scales rebuild ``weight`` (float32, as dequantized) bit for bit, as GGUF's
    own dequantization computes it: ``q * d + m`` in float32."""
    n, k = q.shape
    w = q.view(n, k // GROUP, GROUP).float() * d16.float().unsqueeze(-1)
    if m16 is not None:
        w = w + m16.float().unsqueeze(-1)
    return bool(torch.equal(w.view(n, k), weight))
