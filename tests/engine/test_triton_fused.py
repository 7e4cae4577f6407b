"""The fused elementwise kernels (engine/triton_fused.py) against the torch ops they replace, on the CPU under
Triton's interpreter, and a decoder layer run both ways.

The interpreter rounds float32 to bfloat16 by truncation where a GPU rounds to nearest, so bfloat16 is checked
to a few units in the last place here (a kernel rounds up to three times in a chain, each a truncation here);
float32, where the logic shows, is checked tightly or bit for bit."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors, numpy semantics
pytest.importorskip("triton")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tidal.engine import triton_fused as tf  # noqa: E402
from tidal.engine.model import Rotary  # noqa: E402

ULP_BF16 = 2.0 ** -7  # a bfloat16's relative spacing (8 bits of significand)
BF16_ULPS = 4  # the interpreter's truncations, chained (see the module docstring)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    if ref.dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=2e-6)
    else:  # a few bfloat16 steps of the tensor's scale (a difference of products cancels: see the docstring)
        g, r = got.float(), ref.float()
        assert ((g - r).abs() <= BF16_ULPS * ULP_BF16 * r.abs().max()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_the_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 300, generator=g).to(dtype) for _ in range(2))  # 300: a row that is not a power of two
    w = torch.randn(300, generator=g).to(dtype)
    out, same = tf.rms_norm(x, w, 1e-5)
    assert same is x
    _close(out, w * F.rms_norm(x, (300,), eps=1e-5))
    out, res = tf.rms_norm(x, w, 1e-5, residual=r)
    _close(res, x + r)
    _close(out, w * F.rms_norm(x + r, (300,), eps=1e-5))
    if dtype == torch.float32:
        assert torch.equal(res, x + r)  # a float32 sum is exact IEEE arithmetic either way
    assert x.shape == out.shape and tf.rms_norm(x[:0], w, 1e-5)[0].shape == (0, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_rotates_and_writes_only_its_slots(dtype):
    heads, kv_heads, d, t = 6, 2, 32, 7
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 9, 17, 2, 40, 63])
    rot = Rotary.__new__(Rotary)
    torch.nn.Module.__init__(rot)
    rot.cos, rot.sin = torch.randn(64, d // 2, generator=g), torch.randn(64, d // 2, generator=g)
    cos, sin = rot.tables(pos, dtype)
    kc = torch.full((8, 16, kv_heads, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    slots = torch.tensor([5, 17, 40, 100, 127, 64, 3])
    q = tf.rope_write_kv(qkv, cos, sin, kc, vc, slots, heads, kv_heads, d)
    qk = Rotary.apply(qkv[:, :(heads + kv_heads) * d].view(t, -1, d), cos, sin)  # what DecoderLayer.forward does
    _close(q, qk[:, :heads])
    _close(kc.view(-1, kv_heads, d)[slots], qk[:, heads:])
    assert torch.equal(vc.view(-1, kv_heads, d)[slots], qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d))
    if dtype == torch.float32:  # products rounded before the sums (no fused multiply-add): torch's values
        assert torch.equal(q, qk[:, :heads]) and torch.equal(kc.view(-1, kv_heads, d)[slots], qk[:, heads:])
    others = torch.ones(8 * 16, dtype=torch.bool)
    others[slots] = False
    assert kc.view(-1, kv_heads, d)[others].isnan().all() and vc.view(-1, kv_heads, d)[others].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gu = (3 * torch.randn(4, 2 * 1500, generator=torch.Generator().manual_seed(2))).to(dtype)  # two column tiles
    gate, up = gu.chunk(2, dim=-1)
    _close(tf.silu_mul(gu), F.silu(gate) * up)


def test_merge_splits_weighs_each_span_by_its_log_sum_exp():
    g = torch.Generator().manual_seed(3)
    o, lse = torch.randn(3, 4, 5, 32, generator=g), torch.randn(3, 4, 5, generator=g)
    lse[0, 0, 2:] = float("-inf")  # spans past a short context: no weight
    o[0, 0, 2:] = float("nan")  # (whatever their partials hold)
    out = tf.merge_splits(o, lse, torch.float32)
    ref = (o.nan_to_num() * torch.softmax(lse, dim=-1).unsqueeze(-1)).sum(2)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert not out.isnan().any()


def test_fused_layer_equals_the_torch_layer(make_tiny_engine):
    """One decoder layer of a real (tiny) model over the same cache: fused with the Triton attention against
    DecoderLayer's torch ops with SDPA; the same hidden states and the same K/V written."""
    from tidal.engine.attention import AttentionBatch, DecodeGroup, KVLayer

    e = make_tiny_engine(attention_backend="triton", max_num_seqs=4)
    model, first = e.model, e.model.layer_ids[0]
    layer = model.layers[str(first)]
    g = torch.Generator().manual_seed(4)
    kv0 = e.kv_cache.layers[first]
    kv_a = KVLayer(torch.randn(kv0.k.shape, generator=g), torch.randn(kv0.v.shape, generator=g))
    kv_b = KVLayer(kv_a.k.clone(), kv_a.v.clone())
    bs = kv0.k.shape[1]
    ctx = torch.tensor([bs // 2 + 1, 2 * bs - 2], dtype=torch.int32)  # contexts in one block and in two
    positions = (ctx - 1).long()
    tables = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    slots = torch.tensor([3 * bs + bs // 2, 6 * bs + bs - 3])
    h = torch.randn(2, model.arch.hidden_size, generator=g)

    def batch(triton: bool) -> AttentionBatch:
        mask = None if triton else (torch.arange(2 * bs).unsqueeze(0) < ctx.unsqueeze(1)).view(2, 1, 1, 2 * bs)
        b = AttentionBatch(positions=positions, slot_mapping=slots, num_decodes=2, prefills=[], block_size=bs,
                           decode_groups=[DecodeGroup(0, 2, tables if triton else tables.long(), mask,
                                                      ctx if triton else None)])
        b.rope, b.triton_attention = model.rotary.tables(positions, h.dtype), triton
        return b

    fused = layer(h, kv_a, batch(True))  # forward takes the fused path on the Triton attention's steps
    ref = layer(h, kv_b, batch(False))
    torch.testing.assert_close(fused, ref, atol=1e-4, rtol=1e-4)  # (the two attentions sum in other orders)
    for a, b in ((kv_a.k, kv_b.k), (kv_a.v, kv_b.v)):  # (the norm's rsqrt rounds differently: K, V within it)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    written = torch.zeros(kv_a.k.shape[:2], dtype=torch.bool)
    written.view(-1)[slots] = True
    assert torch.equal(kv_a.k[~written], kv_b.k[~written])  # no other slot touched


def test_padded_static_step_on_the_fused_kernels_gives_the_torch_tokens(make_tiny_engine, monkeypatch):
    """The CUDA graphs' padded static step (run eagerly on the CPU) over the fused kernels and the Triton
    attention, with tables wide enough for three FlashDecoding splits: the tokens of torch's dynamic step."""
    from tidal import SamplingParams
    from tidal.engine.attention import num_splits
    from tidal.engine.llm_engine import LLMEngine

    prompts = [[(29 * i + 7 * j) % 3000 + 100 for j in range(n)] for i, n in enumerate((3, 17, 33, 9))]

    def run(e):
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          prompt_token_ids=p)
        out = {}
        while e.has_unfinished_requests():
            out.update({o.request_id: list(o.outputs[0].token_ids) for o in e.step() if o.finished})
        return out

    kw = {"max_num_seqs": 6, "max_num_batched_tokens": 32, "max_model_len": 1100}
    want = run(make_tiny_engine(attention_backend="torch", **kw))
    monkeypatch.setattr(LLMEngine, "static_decode_on_cpu", True)
    e = make_tiny_engine(attention_backend="triton", **kw)
    g = e.runner.graphs
    assert g is not None and not g.capture and num_splits(g.width * g.bs) == 3
    assert run(e) == want
    assert g.replays > 0
