"""The few-row matrix product (engine/triton_skinny.py) against torch's, on the CPU under Triton's interpreter,
and a decoder layer run through it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors, numpy semantics
pytest.importorskip("triton")
import torch  # noqa: E402

from tidal.engine import triton_skinny as ts  # noqa: E402


def test_plan_fills_the_gpu_and_refuses_what_it_cannot_take():
    # 64 programs of 64 rows (N = 4096) on 132 multiprocessors: split K until there are 2 x 132 programs
    p = ts.plan(1, 4096, 4096, sms=132)
    assert p == ts.Plan(split=8, bm=16) and 64 * p.split >= 2 * 132
    assert ts.plan(32, 28672, 4096, sms=132) == ts.Plan(split=1, bm=32)  # 448 programs already
    assert ts.plan(33, 4096, 4096, sms=132).bm == 64
    assert ts.plan(8, 4096, 384, sms=132).split == 1  # K = 3 loop steps: no even split
    assert ts.plan(65, 4096, 4096, sms=132) is None  # a prefill's rows: cuBLAS
    assert ts.plan(1, 4096, 100, sms=132) is None  # K not a multiple of the loop step


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("n,k,sms", [(100, 256, 1), (192, 512, 8)])  # a partial last slab; splits of 1 and 4
def test_matmul_equals_torch(m, n, k, sms):
    g = torch.Generator().manual_seed(m * 7 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    p = ts.plan(m, n, k, sms)
    assert p is not None and p.split == (1 if sms == 1 else 4)
    got = ts.matmul(x, w, p)
    torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-5)
    assert got.shape == (m, n) and got.dtype == x.dtype


def test_matmul_of_a_strided_input():
    """(bfloat16 is checked on the GPU by benchmarks/gpu_check.py's kernels stage: the interpreter's bfloat16
    dot products are not a GPU's.)"""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 2 * 256, generator=g)[:, ::2]  # rows not contiguous in K
    w = torch.randn(64, 256, generator=g)
    torch.testing.assert_close(ts.matmul(x, w, ts.plan(4, 64, 256, sms=4)), x @ w.T, atol=1e-4, rtol=1e-5)


def test_skinny_caches_a_plan_per_shape_and_declines_large_steps():
    s = ts.Skinny(sms=4)
    w = torch.randn(64, 256)
    assert s(torch.randn(2, 256), w) is not None and s(torch.randn(80, 256), w) is None
    assert set(s._plans) == {(2, 64, 256), (80, 64, 256)} and s._plans[(80, 64, 256)] is None


def test_layer_through_the_skinny_products_equals_cublas_s(make_tiny_engine):
    """A decode step of the tiny model with the layers' products in the kernel: the logits of torch's."""
    from tidal import SamplingParams

    prompts = [[(31 * i + 5 * j) % 3000 + 100 for j in range(n)] for i, n in enumerate((4, 19, 11))]
    outs = {}
    for skinny in (False, True):
        e = make_tiny_engine(attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=64)
        if skinny:
            e.model.skinny = ts.Skinny(sms=4)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", None, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          prompt_token_ids=p)
        got = {}
        while e.has_unfinished_requests():
            got.update({o.request_id: list(o.outputs[0].token_ids) for o in e.step() if o.finished})
        outs[skinny] = got
        if skinny:
            assert len(e.model.skinny._plans) >= 4  # every decoder matrix went through it
    assert outs[True] == outs[False]
