"""tidal's own Q4_1/Q8_0 kernels (tidal/engine/native.py): the same matmul as the dequantized float32
weights for every row count and block count (the SIMD path and the portable one), errors named,
and the engine in float32 picks them and falls back to torch's kernels when they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tidal.engine import native
from tidal.engine.quant import GROUP, describe_quantization, int4_grid, int8_grid

_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # GGUF names

pytestmark = pytest.mark.skipif(native.load() is not None, reason=f"kernels not built: {native.load()}")


def q4_1(n: int, k: int, seed: int = 0):
    """A Q4_1 matrix as GGUF dequantizes it: float16 d and m, w = q * d + m in float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q[:, ::GROUP], q[:, 1::GROUP] = 0, 15
    d = (torch.rand(n, k // GROUP, generator=g) * 0.05 + 1e-3).half().float()
    m = (-torch.rand(n, k // GROUP, generator=g) * 0.4).half().float()
    w = (q.float().view(n, -1, GROUP) * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, k)
    return w, q, d, m


def q8_0(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    q[:, ::GROUP] = 127
    d = (torch.rand(n, k // GROUP, generator=g) * 0.01 + 1e-4).half().float()
    return (q.float().view(n, -1, GROUP) * d.unsqueeze(-1)).view(n, k), q, d


# K/32 of 3, 8 and 9 blocks: the float16 scales convert eight at a time plus a tail; n=296 (37 tiles of
# eight outputs) splits a step of many rows into 19 tasks taken by two threads, the last of one tile
@pytest.mark.parametrize("n,k", [(48, 96), (40, 256), (8, 288), (296, 64)])
def test_q4_1_equals_the_dequantized_matmul(n, k):
    w, q, d, m = q4_1(n, k)
    grid = int4_grid(w)
    assert grid is not None and native.q4_1_exact(w, *grid)
    packed = native.Q4_1Weight.pack(*grid)
    assert packed.nbytes == n * k // 2 + 2 * 2 * n * k // GROUP
    g = torch.Generator().manual_seed(1)
    # few rows: whole tiles of four and every remainder; many rows (the panel kernels, from 16): whole
    # groups of six and every remainder, an odd number of output tiles (n=40) included
    for rows in (1, 2, 3, 4, 5, 7, 9, 16, 17, 18, 19, 20, 23, 37, 130):
        x = torch.randn(rows, k, generator=g)
        got = packed.matmul(x)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(48, 96), (40, 288), (296, 64)])
def test_q8_0_equals_the_dequantized_matmul(n, k):
    w, q, d = q8_0(n, k)
    grid = int8_grid(w)
    assert grid is not None
    packed = native.Q8_0Weight.pack(*grid, weight=w, argmax=True)
    bounded = 0 if packed is None or packed.bounds is None else n * k + 2 * 4 * n * k // GROUP + 4 * n  # u8 codes, two f32 per block, row norms
    assert packed is not None and packed.nbytes == n * k + 2 * n * k // GROUP + bounded
    g = torch.Generator().manual_seed(2)
    for rows in (1, 4, 6, 16, 21, 33):
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(packed.matmul(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


def _q8_argmax_cases():
    """(name, weight, x): ties between equal vocabulary rows, NaN and infinite logits, more and fewer
    outputs than one part of the fused kernel (64 tiles), an odd tile count, rows for both kernels."""
    w, q, d = q8_0(1544, 64, seed=3)  # 193 tiles: parts of 48-49 tiles on 4 parts, 24-25 on 8
    g = torch.Generator().manual_seed(4)
    cases = []
    for rows in (1, 2, 3, 5, 15, 16, 17, 33):
        cases.append((f"random x{rows}", q, d, torch.randn(rows, 64, generator=g)))
    tie = q.clone()
    tie[1000], tie[1500], tie[7] = tie[3], tie[3], tie[3]  # the same logit at columns 3, 7, 1000, 1500
    dt = d.clone()
    dt[1000], dt[1500], dt[7] = dt[3], dt[3], dt[3]
    x = torch.zeros(20, 64)
    x[:, :32] = (tie[3, :32].float() * dt[3, 0]).sign()  # aligned with row 3: it (and its copies) win
    cases.append(("ties", tie, dt, x))
    dn = d.clone()
    dn[600, 1], dn[900, 0] = float("nan"), float("nan")  # columns 600 and 900 NaN: the first wins
    cases.append(("nan", q, dn, torch.randn(4, 64, generator=g)))
    cases.append(("nan x17", q, dn, torch.randn(17, 64, generator=g)))
    xi = torch.randn(3, 64, generator=g)
    xi[1] = float("nan")  # a whole row NaN: column 0
    cases.append(("nan row", q, d, xi))
    di = d.clone()
    di[1200, 0], di[40, 0] = float("inf"), float("inf")
    cases.append(("inf", q, di, torch.ones(2, 64)))
    return cases


@pytest.mark.parametrize("threads", [1, 2])
def test_q8_0_argmax_is_the_argmax_of_the_logits(threads):
    """The fused greedy head picks torch.argmax(q8_0_mm(x)): the lowest column among equal maxima, the
    first NaN above all, whatever the split over threads and parts."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, q, d, x in _q8_argmax_cases():
            packed = native.Q8_0Weight.pack(q, d, argmax=True)
            want = packed.matmul(x).argmax(-1)
            got = packed.argmax(x)
            assert got.dtype == torch.long and torch.equal(got, want), (name, got, want)
            if name == "ties":
                assert set(want.tolist()) == {3}
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not native.bounded_argmax(), reason="no AVX-512 VNNI build here")
def test_bounded_argmax_is_the_exact_token():
    """greedy_head.cpp's bound and verify gives q8_0_argmax's token (-1 only where it hands a row back):
    activations with a massive channel as real hidden states have, near-ties one code apart either
    way, exact ties, row counts off the register blocks; all-equal logits (too many candidates) and a
    non-finite x come back -1 and Q8_0Weight.argmax then runs the exact kernel."""
    n, k = 4096, 576
    _, q, d = q8_0(n, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, k, generator=g)
    x[:, 199] *= 40  # a massive activation: its block's int8 step is ~40x the others'
    w5 = q[5].float() * d[5].repeat_interleave(GROUP)
    x[30:] = w5.sign() * torch.rand(10, k, generator=g)  # rows aligned with output 5: it leads
    near = q.clone()
    near[4000], near[4001], near[4002] = q[5], q[5], q[5]  # 4001: an exact tie with 5
    kp = int(((q[5] < 127) & (q[5] > -127) & (w5 > 0)).nonzero()[0])
    near[4000, kp] += 1  # one code up where x > 0: 4000 beats 5 by d x_k
    near[4002, kp] -= 1  # one code down: 4002 loses to 5 by as little
    dn = d.clone()
    dn[4000], dn[4001], dn[4002] = d[5], d[5], d[5]
    for name, qq, dd in (("random", q, d), ("near", near, dn)):
        packed = native.Q8_0Weight.pack(qq, dd, argmax=True)
        assert packed.bounds is not None
        for rows in (16, 17, 23, 40):
            xr = x[-rows:].contiguous()
            want = torch.ops.tidal.q8_0_argmax(xr, packed.qs, packed.d, n, k)
            got = torch.ops.tidal.q8_0_argmax_bounded(xr, *packed.bounds, n, k)
            assert bool((got >= 0).all()) and torch.equal(got, want), (name, rows, got, want)
            assert torch.equal(packed.argmax(xr), packed.matmul(xr).argmax(-1))
        if name == "near":
            assert set(want[-10:].tolist()) == {4000}
    packed = native.Q8_0Weight.pack(q, d, argmax=True)
    xt = x[:16].clone()
    xt[:, 32:64] = 1e-38  # a denormal block: left out of the estimate, within its bound
    xt[3, :] = 1e-35  # a row of them: every logit ~0 and within its bound of all others, so it comes back -1
    want = torch.ops.tidal.q8_0_argmax(xt, packed.qs, packed.d, n, k)
    got = torch.ops.tidal.q8_0_argmax_bounded(xt, *packed.bounds, n, k)
    assert got[3] == -1 and torch.equal(got[got >= 0], want[got >= 0]) and int((got >= 0).sum()) == 15
    assert torch.equal(packed.argmax(xt), want)
    for xr in (torch.zeros(16, k), torch.full((16, k), float("nan"))):
        assert bool((torch.ops.tidal.q8_0_argmax_bounded(xr, *packed.bounds, n, k) < 0).all())
        assert torch.equal(packed.argmax(xr), packed.matmul(xr).argmax(-1))
    with pytest.raises(RuntimeError, match="at least 16 rows"):
        torch.ops.tidal.q8_0_argmax_bounded(x[:15].contiguous(), *packed.bounds, n, k)
    dn = d.clone()
    dn[7, 0] = float("nan")
    assert native.Q8_0Weight.pack(q, dn, argmax=True).bounds is None  # non-finite scales: the exact kernel only
    assert native.Q8_0Weight.pack(q, d).bounds is None  # a matrix never asked for argmax gets no copy


def test_scales_that_float16_would_round_are_refused():
    w, q, d, m = q4_1(16, 64)
    off = (q.float().view(16, -1, GROUP) * (d * (1 + 1e-4)).unsqueeze(-1) + m.unsqueeze(-1)).view(16, 64)
    grid = int4_grid(off)  # on a 4-bit grid, but its step is not a float16
    assert grid is not None and not native.q4_1_exact(off, *grid)
    w8, q8, d8 = q8_0(16, 64)
    scaled = w8 * (1 + 1e-4)
    assert native.Q8_0Weight.pack(*int8_grid(scaled), weight=scaled) is None


def test_bad_inputs_are_named():
    w, q, d, m = q4_1(32, 64)
    packed = native.Q4_1Weight.pack(q, d, m)
    with pytest.raises(RuntimeError, match="float32"):
        packed.matmul(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.tidal.q4_1_mm(torch.randn(2, 96), packed.qs, packed.dm, 32, 64)
    with pytest.raises(RuntimeError, match="wrong type or size"):
        torch.ops.tidal.q4_1_mm(torch.randn(2, 64), packed.qs.flatten()[:8], packed.dm, 32, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        native.Q4_1Weight.pack(*q4_1(36, 64)[1:])
    with pytest.raises(ValueError, match="multiple of 8"):
        native.Q8_0Weight.pack(*q8_0(36, 64)[1:])
    q8 = native.Q8_0Weight.pack(*q8_0(16, 64)[1:])
    with pytest.raises(RuntimeError, match="q8_0_argmax: x has 96 columns"):
        torch.ops.tidal.q8_0_argmax(torch.randn(2, 96), q8.qs, q8.d, 16, 64)
    with pytest.raises(RuntimeError, match="q8_0_argmax: the output size"):
        torch.ops.tidal.q8_0_argmax(torch.randn(2, 64), q8.qs[:0], q8.d[:0], 0, 64)


def test_the_portable_build_computes_the_same():
    """Built without AVX2 flags (``TIDAL_NATIVE_SIMD=0``: another library, in a fresh process), the
    plain C++ loops give the same results, matmuls and attention (decode and prefill)."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "from tidal.engine import native\n"
        "assert native._simd_flags() == [] and native.build_isa() == 'portable', native._simd_flags()\n"
        "assert native.load() is None, native.load()\n"
        "from tests.engine.test_native import q4_1, q8_0\n"
        "w, q, d, m = q4_1(40, 288); x = torch.randn(5, 288)\n"
        "torch.testing.assert_close(native.Q4_1Weight.pack(q, d, m).matmul(x), F.linear(x, w), rtol=1e-5, atol=1e-5)\n"
        "w, q, d = q8_0(40, 288)\n"
        "torch.testing.assert_close(native.Q8_0Weight.pack(q, d).matmul(x), F.linear(x, w), rtol=1e-5, atol=1e-4)\n"
        "from tests.engine.test_native import test_q8_0_argmax_is_the_argmax_of_the_logits as head\n"
        "head(1); head(2)\n"
        "from tests.engine.test_native import test_paged_attention_equals_the_gathered_sdpa as attn\n"
        "attn(9, 3, 64, [0, 3, 4, 17, 9], 2); attn(4, 4, 36, [130, 5, 300], 1); attn(9, 3, 64, [700], 2)\n"
        "from tests.engine.test_native import test_prefill_attention_equals_masked_sdpa as pre\n"
        "pre(9, 3, 64, 130, 0, 0, 2); pre(6, 1, 32, 33, 5, 3, 1)\n"
        "print('ok')\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TIDAL_NATIVE_SIMD": "0"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="no AVX-512 here")
def test_the_avx512_panels_give_the_avx2_floats(tmp_path):
    """Built for AVX-512, the panels' micro-kernel (16 outputs a vector) gives exactly the floats of
    the AVX2 build (``TIDAL_NATIVE_SIMD=avx2``: another library, in a fresh process), at row counts
    that make every group size and an odd last tile; so do the prefill attention's 512-bit tiles and
    16-lane exponentials (chunks of one, part of a tile, several tiles, a cached prefix)."""
    code = (
        "import sys, torch\n"
        "from tidal.engine import native\n"
        "assert native.load() is None, native.load()\n"
        "from tests.engine.test_native import q4_1, q8_0\n"
        "torch.manual_seed(0); outs = []\n"
        "w, q, d, m = q4_1(120, 288); w8, q8, d8 = q8_0(40, 288)\n"
        "for rows in (16, 17, 25, 32, 37, 64, 100, 130):\n"
        "    x = torch.randn(rows, 288)\n"
        "    outs += [native.Q4_1Weight.pack(q, d, m).matmul(x), native.Q8_0Weight.pack(q8, d8).matmul(x)]\n"
        "for n, offset in ((1, 0), (37, 0), (300, 0), (70, 200)):\n"
        "    qkv = torch.randn(offset + n, 15 * 64) * 2\n"
        "    k, v = qkv[:, 576:768].view(-1, 3, 64), qkv[:, 768:].view(-1, 3, 64)\n"
        "    outs.append(torch.ops.tidal.prefill_attention(qkv[offset:, :576].view(n, 9, 64), k, v, offset, 0.125))\n"
        "torch.save(outs, sys.argv[1])\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {}
    for simd in ("1", "avx2"):
        path = tmp_path / f"{simd}.pt"
        out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, capture_output=True, text=True,
                             timeout=600, env={**os.environ, "TIDAL_NATIVE_SIMD": simd})
        assert out.returncode == 0, out.stderr[-2000:]
        got[simd] = torch.load(path)
    assert len(got["1"]) == 20 and all(torch.equal(a, b) for a, b in zip(got["1"], got["avx2"], strict=True))


def test_compile_traces_through_the_ops():
    """``--compile`` puts the ops inside one graph: their fake implementations give the shapes."""
    w, q, d, m = q4_1(32, 64)
    packed = native.Q4_1Weight.pack(q, d, m)
    fn = torch.compile(lambda x: packed.matmul(x) * 2, fullgraph=True, backend="eager")
    x = torch.randn(3, 64)
    torch.testing.assert_close(fn(x), 2 * F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_float32_engine_uses_them_and_falls_back(tmp_path, monkeypatch):
    """In float32 on CPU a GGUF model's 4-bit matrices go to tidal's kernels; when they cannot be
    built, to torch's (and the report says which)."""
    from gguf import GGMLQuantizationType as QT

    from .test_quant import _tiny_model

    types = dict.fromkeys(_MATRICES, QT.Q4_1)
    model, _ = _tiny_model(tmp_path, types, "int4")
    assert model.kernels == "tidal" and isinstance(model.layers["0"].qkv_proj.int4, native.Q4_1Weight)
    report = model.quantization_report()
    assert report["kernels"] == "tidal" and report["kernel_isa"] == native.build_isa()
    if os.environ.get("TIDAL_NATIVE_SIMD", "1") == "1":  # built for what torch found on this CPU
        want = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability(), "portable")
        assert native.build_isa() == want
    assert f"tidal's Q4_1/Q8_0 kernels, built for {native.build_isa()})" in describe_quantization(report)
    x = torch.randn(2, 64)
    lin = model.layers["0"].gate_up_proj
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(native, "_state", {"ok": False, "why": "no compiler"})
    torch_model, _ = _tiny_model(tmp_path, types, "int4")
    assert torch_model.kernels == "torch" and not isinstance(torch_model.layers["0"].qkv_proj.int4, native.Q4_1Weight)
    torch.testing.assert_close(torch_model.layers["0"].gate_up_proj(x), lin(x), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ paged decode attention
def _paged(n: int, heads: int, kv_heads: int, d: int, block_size: int, positions: list[int], seed: int = 0):
    """A shuffled KV pool, each decode's table pointing at its own blocks, padded with block 0."""
    from tidal.engine.attention import KVLayer

    g = torch.Generator().manual_seed(seed)
    width = max(p // block_size + 1 for p in positions) + 1
    blocks = torch.randperm(n * width + 3, generator=g)
    k = torch.randn(n * width + 3, block_size, kv_heads, d, generator=g)
    v = torch.randn(n * width + 3, block_size, kv_heads, d, generator=g)
    tables = torch.zeros(n, width, dtype=torch.long)
    for i, p in enumerate(positions):
        used = p // block_size + 1
        tables[i, :used] = blocks[i * width:i * width + used]
    q = torch.randn(n, heads, d, generator=g)
    return q, KVLayer(k, v), tables, torch.tensor(positions)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("positions", [[0, 3, 4, 17, 9], [700], [130, 5, 300]])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 36), (8, 2, 16), (8, 2, 32), (10, 2, 64), (6, 6, 32)])
def test_paged_attention_equals_the_gathered_sdpa(heads, kv_heads, d, positions, threads):
    """Against the eager path (every block gathered, padded, masked SDPA): grouped-query heads, 1 to
    5 query heads per KV head (the kernel takes them three at a time, so every remainder), a head
    size that is not a multiple of 8, positions at 0, at a block's edge and mid-block; long
    contexts of a few decodes, which the kernel splits into spans merged afterwards (how many
    depends on the thread count)."""
    from tidal.engine.attention import AttentionBatch, DecodeGroup, _decode_attention

    bs = 4
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    q, kv, tables, pos = _paged(len(positions), heads, kv_heads, d, bs, positions)
    width = tables.shape[1]
    mask = (torch.arange(width * bs).unsqueeze(0) <= pos.unsqueeze(1)).view(len(positions), 1, 1, width * bs)
    group = DecodeGroup(0, len(positions), tables, mask)
    batch = AttentionBatch(positions=pos, slot_mapping=pos, num_decodes=len(positions), decode_groups=[group],
                           prefills=[], block_size=bs)
    try:
        want = _decode_attention(q, kv, batch, group, d ** -0.5)
        batch.native_attention = True
        got = _decode_attention(q, kv, batch, group, d ** -0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("positions", [[0, 3, 17], [700], [130, 5, 300]])
def test_paged_attention_reads_a_bfloat16_cache_exactly(positions, threads):
    """A bfloat16 cache (a bfloat16 model's) is widened span by span (exactly: bf16 -> float32 loses
    nothing): the same output, bit for bit, as a float32 cache holding the same values."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, kv, tables, pos = _paged(len(positions), 9, 3, 64, 4, positions)
        k16, v16 = kv.k.bfloat16(), kv.v.bfloat16()
        op = torch.ops.tidal.paged_decode_attention
        got = op(q, k16, v16, tables, pos, 0.125)
        want = op(q, k16.float(), v16.float(), tables, pos, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q, k16, v16.float(), tables, pos, 0.125)


def test_paged_attention_refuses_what_it_cannot_read():
    q, kv, tables, pos = _paged(2, 4, 2, 16, 4, [5, 2])
    op = torch.ops.tidal.paged_decode_attention
    with pytest.raises(RuntimeError, match="outside the 3 blocks"):
        op(q, kv.k, kv.v, tables, torch.tensor([5, 12]), 0.25)
    bad = tables.clone()
    bad[0, 0] = kv.k.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, kv.k, kv.v, bad, pos, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.bfloat16(), kv.k, kv.v, tables, pos, 0.25)
    with pytest.raises(RuntimeError, match="heads"):
        op(torch.randn(2, 3, 16), kv.k, kv.v, tables, pos, 0.25)


# ------------------------------------------------------------------------------ prefill attention
def _causal_sdpa(q, k, v, offset, scale):
    n, m = q.shape[0], k.shape[0]
    mask = torch.arange(m)[None] <= (offset + torch.arange(n))[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,offset,extra", [(1, 0, 0), (7, 0, 0), (130, 0, 0), (33, 5, 3), (70, 200, 0)])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 36), (8, 2, 16), (6, 1, 32)])
def test_prefill_attention_equals_masked_sdpa(heads, kv_heads, d, n, offset, extra, threads):
    """tidal's tiled causal kernel against SDPA with the mask "query i sees keys 0..offset + i": one
    token, a part of a tile, several query blocks and key tiles, a cached prefix (offset) with keys past
    the last query, grouped-query heads, head sizes on the SIMD path (multiples of 16) and off it, rows
    read in place from a step's QKV rows (strided)."""
    g = torch.Generator().manual_seed(n + offset)
    m = offset + n + extra
    qs, kvs = heads * d, kv_heads * d
    qkv = torch.randn(max(n, m), qs + 2 * kvs, generator=g) * 2
    q = qkv[:n, :qs].view(n, heads, d)
    k, v = qkv[:m, qs:qs + kvs].view(m, kv_heads, d), qkv[:m, qs + kvs:].view(m, kv_heads, d)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.tidal.prefill_attention(q, k, v, offset, d ** -0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, _causal_sdpa(q, k, v, offset, d ** -0.5), rtol=1e-5, atol=1e-5)


def test_prefill_attention_refuses_what_it_cannot_read():
    op = torch.ops.tidal.prefill_attention
    q, k = torch.randn(4, 4, 16), torch.randn(6, 2, 16)
    with pytest.raises(RuntimeError, match="need keys up to there; there are 6"):
        op(q, k, k, 3, 0.25)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k, k, 0, 0.25)
    with pytest.raises(RuntimeError, match="heads"):
        op(torch.randn(4, 3, 16), k, k, 0, 0.25)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        op(q.transpose(1, 2), k, k, 0, 0.25)


# ------------------------------------------------------------------------------ one layer in C++


@pytest.mark.parametrize("step", ["decodes", "prefills"])
@pytest.mark.parametrize("kind", ["q4_1", "mixed", "float"])
def test_decode_layer_equals_the_python_layers(tmp_path, monkeypatch, kind, step):
    """A step of decodes runs each layer as one C++ call (``torch.ops.tidal.decode_layer``), a step with
    prefills its two halves around the Python attention (``layer_attn_in``/``layer_attn_out``): the same
    hidden states and KV writes as the Python layers, to float32 rounding (the loops sum and round in
    another order). Qwen2 (a QKV bias); matrices on tidal's Q4_1 kernel, float ones, a mix, and one
    whose 4-bit copy stops at 2 rows. The step with prefills has 2 decodes, a prompt's first chunk and a
    chunk after 20 cached tokens."""
    from gguf import GGMLQuantizationType as QT

    from tidal.engine.attention import AttentionBatch, DecodeGroup, KVLayer, PrefillSeq
    from tidal.engine.model import DecoderLayer

    from .test_quant import _tiny_model

    types = {"q4_1": dict.fromkeys(_MATRICES, QT.Q4_1), "float": dict.fromkeys(_MATRICES, QT.F16),
             "mixed": {**dict.fromkeys(_MATRICES, QT.Q4_1), "attn_q": QT.Q8_0, "ffn_down": QT.F16}}[kind]
    (tmp_path / kind).mkdir()
    model, _ = _tiny_model(tmp_path / kind, types, "int4")
    assert model.native_attention
    if kind != "float":
        model.layers["1"].gate_up_proj.int4.max_tokens = 2  # 3+ tokens: that matrix runs the float matmul
    layer0 = model.layers["0"]
    assert (layer0.qkv_proj.int4 is None) == (kind != "q4_1") and layer0.qkv_proj.bias is not None
    bs = 16
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(12, generator=g).view(4, 3)
    if step == "decodes":
        seqs, prefills = [0, 1, 2], []
        pos = torch.tensor([5, 17, 40])
    else:
        seqs = [0, 1] + [2] * 6 + [3] * 4
        pos = torch.tensor([5, 17, *range(6), *range(20, 24)])
        prefix_mask = torch.arange(24)[None] <= pos[8:, None]
        prefills = [PrefillSeq(2, 6, 0, tables[2], None), PrefillSeq(8, 4, 20, tables[3], prefix_mask)]
    nd = 3 if step == "decodes" else 2
    slots = tables[seqs, pos // bs] * bs + pos % bs
    mask = (torch.arange(3 * bs) <= pos[:nd, None]).view(nd, 1, 1, -1)
    kvh, d = 2, 16
    k0, v0 = torch.randn(12, bs, kvh, d, generator=g), torch.randn(12, bs, kvh, d, generator=g)
    h0 = torch.randn(len(seqs), 64, generator=g)

    def run():
        batch = AttentionBatch(positions=pos, slot_mapping=slots, num_decodes=nd,
                               decode_groups=[DecodeGroup(0, nd, tables[:nd], mask)], prefills=prefills,
                               block_size=bs)
        kv = {i: KVLayer(k0.clone(), v0.clone()) for i in model.layer_ids}
        with torch.inference_mode():
            return model.forward(h0.clone(), batch, kv), kv

    fused, fused_kv = run()
    assert all(isinstance(model.layers[str(i)]._native, tuple) for i in model.layer_ids)  # the C++ layers ran
    monkeypatch.setattr(DecoderLayer, "native_args", lambda self: None)
    python, python_kv = run()
    torch.testing.assert_close(fused, python, rtol=1e-5, atol=1e-5)
    for i in model.layer_ids:
        torch.testing.assert_close(fused_kv[i].k, python_kv[i].k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_kv[i].v, python_kv[i].v, rtol=1e-5, atol=1e-5)
    written = fused_kv[0].k.view(-1, kvh, d)[slots]
    assert not torch.allclose(written, k0.view(-1, kvh, d)[slots])  # the step wrote its keys
    assert (fused - h0).abs().max() > 0.1  # and the layers changed the hidden states


@pytest.mark.parametrize("kind", ["q4_1", "mixed"])
def test_a_bfloat16_models_decode_step_runs_the_fused_layers_in_float32(tmp_path, kind):
    """A bfloat16 model's step of decodes: hidden states widened to float32, each layer one C++ call over
    the bfloat16 KV cache (its K/V written rounded to nearest even, as torch rounds), the output rounded
    back. Against the same layers run as float32 Python over a float32 copy of the cache: the KV rows
    written are that float32 computation's, rounded by torch; the hidden states agree to bf16 rounding."""
    from gguf import GGMLQuantizationType as QT

    from tidal.engine.attention import AttentionBatch, DecodeGroup, KVLayer

    from .test_quant import _tiny_model

    types = {"q4_1": dict.fromkeys(_MATRICES, QT.Q4_1),
             "mixed": {**dict.fromkeys(_MATRICES, QT.Q4_1), "ffn_down": QT.F16}}[kind]
    (tmp_path / kind).mkdir()
    model, _ = _tiny_model(tmp_path / kind, types, "int4", dtype=torch.bfloat16)
    model.set_attention("auto", torch.bfloat16)
    assert model.native_bf16_decode and not model.native_attention and model.kernels == "tidal"
    bs, kvh, d = 16, 2, 16
    g = torch.Generator().manual_seed(1)
    tables = torch.randperm(12, generator=g).view(4, 3)[:3]
    pos = torch.tensor([5, 17, 40])
    slots = tables[torch.arange(3), pos // bs] * bs + pos % bs
    mask = (torch.arange(3 * bs) <= pos[:, None]).view(3, 1, 1, -1)
    k0 = torch.randn(12, bs, kvh, d, generator=g).bfloat16()
    v0 = torch.randn(12, bs, kvh, d, generator=g).bfloat16()
    h0 = torch.randn(3, 64, generator=g).bfloat16()

    def batch():
        return AttentionBatch(positions=pos, slot_mapping=slots, num_decodes=3,
                              decode_groups=[DecodeGroup(0, 3, tables, mask)], prefills=[], block_size=bs)

    kv = {i: KVLayer(k0.clone(), v0.clone()) for i in model.layer_ids}
    with torch.inference_mode():
        fused = model.forward(h0.clone(), batch(), kv)
    assert fused.dtype == torch.bfloat16
    assert all(isinstance(model.layers[str(i)]._native, tuple) for i in model.layer_ids)
    # layer by layer: the rows decode_layer writes into the bfloat16 cache are what layer_attn_in computes
    # from the same input, rounded by torch; chained, the layers give forward's output exactly
    h = h0.float()
    b = batch()
    b.rope = model.rotary.tables(pos, torch.float32)
    q_size = model.layers["0"].q_size
    for i in model.layer_ids:
        layer = model.layers[str(i)]
        args = layer.native_args()
        norm1, _, ws, qs, dm, shapes, bias = args
        mine = KVLayer(k0.clone(), v0.clone())
        with torch.inference_mode():
            f32 = KVLayer(k0.float(), v0.float())
            qkv = torch.ops.tidal.layer_attn_in(h, norm1, ws, qs, dm, shapes, bias, *b.rope, f32.k, f32.v, slots,
                                                layer.num_heads, layer.num_kv_heads, layer.input_layernorm.eps)
            h = torch.ops.tidal.decode_layer(h, *args, *b.rope, mine.k, mine.v, slots, tables, pos, layer.num_heads,
                                             layer.num_kv_heads, layer.input_layernorm.eps, layer.scale)
        kvs = layer.kv_size
        want_k = qkv[:, q_size:q_size + kvs].reshape(3, kvh, d).bfloat16()
        want_v = qkv[:, q_size + kvs:].reshape(3, kvh, d).bfloat16()
        assert torch.equal(mine.k.view(-1, kvh, d)[slots], want_k)
        assert torch.equal(mine.v.view(-1, kvh, d)[slots], want_v)
        assert torch.equal(kv[i].k, mine.k) and torch.equal(kv[i].v, mine.v)  # forward wrote the same
    assert torch.equal(fused, h.bfloat16())
    # and the whole step agrees with the Python layers in bfloat16 to bfloat16 rounding
    with torch.inference_mode():
        model.native_bf16_decode = False
        python = model.forward(h0.clone(), batch(), {i: KVLayer(k0.clone(), v0.clone()) for i in model.layer_ids})
    torch.testing.assert_close(fused.float(), python.float(), rtol=0.05, atol=0.05)
