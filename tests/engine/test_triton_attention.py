"""The Triton paged attention kernels (engine/triton_attention.py) against SDPA, run on the CPU under Triton's
interpreter (the same kernels a GPU compiles), and an engine whose attention they run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors, numpy semantics
pytest.importorskip("triton")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tidal import SamplingParams  # noqa: E402
from tidal.config import ConfigError  # noqa: E402
from tidal.engine import triton_attention as ta  # noqa: E402

NB, BS, KVH, D = 48, 16, 2, 32


def _cache(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NB, BS, KVH, D, generator=g), torch.randn(NB, BS, KVH, D, generator=g)


def _ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: list[int], ctx: int,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over the first ``ctx`` tokens of ``table``'s blocks; q [n, H, D] -> [n, H, D]."""
    h = q.shape[1]
    kk = k[table].reshape(-1, KVH, D)[:ctx].repeat_interleave(h // KVH, 1).transpose(0, 1)
    vv = v[table].reshape(-1, KVH, D)[:ctx].repeat_interleave(h // KVH, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=D ** -0.5).transpose(0, 1)


@pytest.mark.parametrize("heads", [2, 6])  # one query head per KV head, and GQA groups of three
def test_decode_matches_sdpa_for_every_context(heads):
    k, v = _cache()
    width = 40  # 640 tokens of table: two FlashDecoding splits
    assert ta.num_splits(width * BS) == 2
    ctx = [1, 15, 16, 17, 512, 513, 640]  # one token, block edges, the split edge, the whole width
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(NB, generator=g)[:width] for _ in ctx])
    q = torch.randn(len(ctx), heads, D, generator=g)
    out = ta.decode(q, k, v, tables.to(torch.int32), torch.tensor(ctx, dtype=torch.int32), D ** -0.5)
    for i, c in enumerate(ctx):
        ref = _ref(q[i:i + 1], k, v, tables[i].tolist(), c)[0]
        torch.testing.assert_close(out[i], ref, atol=2e-6, rtol=1e-5)


def test_decode_ignores_blocks_past_the_context():
    """A decode reads only its own context: poisoning every other block of the cache changes nothing."""
    k, v = _cache()
    tables = torch.arange(8, dtype=torch.int32).view(1, 8)
    q = torch.randn(1, 4, D)
    lens = torch.tensor([20], dtype=torch.int32)
    before = ta.decode(q, k, v, tables, lens, 0.2)
    k[2:], v[2:] = float("nan"), float("nan")  # tokens 32.. and every unreferenced block
    torch.testing.assert_close(ta.decode(q, k, v, tables, lens, 0.2), before)


def test_prefill_varlen_matches_sdpa_with_and_without_a_cached_prefix():
    k, v = _cache(2)
    heads = 4
    g = torch.Generator().manual_seed(3)
    # (row offset, tokens, cached prefix): a fresh chunk, a chunk after a prefix spanning tiles, one token
    chunks = [(0, 5, 0), (5, 70, 30), (75, 1, 100)]
    tables = [torch.randperm(NB, generator=g)[:12].tolist() for _ in chunks]
    q = torch.randn(76, heads, D, generator=g)
    out = torch.full_like(q, float("nan"))
    meta = ta.varlen_meta([(o, n, s, t) for (o, n, s), t in zip(chunks, tables, strict=True)], torch.device("cpu"))
    assert meta.tile_seq.tolist() == [0, 1, 1, 1, 2]  # tiles of 32 query rows
    ta.prefill(q, k, v, meta, D ** -0.5, out)
    for (o, n, s), t in zip(chunks, tables, strict=True):
        mask = torch.arange(s + n).unsqueeze(0) <= (s + torch.arange(n)).unsqueeze(1)
        torch.testing.assert_close(out[o:o + n], _ref(q[o:o + n], k, v, t, s + n, mask), atol=2e-6, rtol=1e-5)


def test_supported_head_sizes():
    assert ta.supported(64) and ta.supported(128) and ta.supported(16)
    assert not ta.supported(8) and not ta.supported(96)


def test_engine_on_triton_attention_gives_the_torch_tokens(make_tiny_engine):
    """Mixed steps (prefill chunks beside decodes, cached prefixes) through the Triton kernels: the same
    greedy tokens as torch's SDPA path."""
    prompts = [[(37 * i + 11 * j) % 4000 + 100 for j in range(n)] for i, n in enumerate((5, 40, 23))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        e = make_tiny_engine(attention_backend=backend, max_num_batched_tokens=24, max_num_seqs=4)
        assert e.model.attention_backend == backend
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", None, params, prompt_token_ids=p)
        got, mixed = {}, 0
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    got[o.request_id] = list(o.outputs[0].token_ids)
            comp = e.last_result.composition
            mixed += bool(comp.num_prefill_tokens and comp.num_decode_seqs)
        assert mixed > 0
        outs[backend] = got
    assert outs["triton"] == outs["torch"]


def test_triton_backend_without_triton_is_a_config_error(make_tiny_engine, monkeypatch):
    import tidal.engine.model as model_mod

    monkeypatch.setattr(model_mod, "_triton_unavailable", lambda head_dim: "Triton is not importable (test)")
    with pytest.raises(ConfigError, match="attention-backend triton: Triton is not importable"):
        make_tiny_engine(attention_backend="triton")
