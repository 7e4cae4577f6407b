"""The sampler draws from the distribution its parameters define: temperature, top-k, top-p and min-p
computed here from their definitions (numpy, float64), then many draws whose frequencies must match, and
the CPU's top-p over its likeliest candidates equal to the whole vocabulary's sort."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.core.sampling import SamplingParams
from tidal.engine import sampler as S
from tidal.engine.sampler import Sampler

LOGITS = np.array([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def reference(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The filtered distribution, from the definitions (vLLM's and OpenAI's)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k:
        p[p < np.sort(p)[::-1][top_k - 1]] = 0
        p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]  # mass of the likelier tokens
        keep = np.zeros_like(p, dtype=bool)
        keep[order[before < top_p]] = True
        keep[order[0]] = True
        p = np.where(keep, p, 0)
        p /= p.sum()
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0)
        p /= p.sum()
    return p


SETUPS = [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.3, top_k=3),
          dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, min_p=0.2), dict(temperature=1.0, top_k=5, top_p=0.9)]


# rows that all keep a top k are drawn among those alone; the whole vocabulary's filter draws them too
@pytest.mark.parametrize("kw, among_top_k",
                         [(kw, True) for kw in SETUPS] + [(kw, False) for kw in SETUPS if "top_k" in kw])
@pytest.mark.parametrize("seeded", [False, True])
def test_the_draws_follow_the_filtered_distribution(kw, among_top_k, seeded, monkeypatch):
    if not among_top_k:
        monkeypatch.setattr(S, "TOP_K_DIRECT", 0)
    n = 20000 if not seeded else 400  # seeded: each row a request of its own (its own generator)
    logits = torch.tensor(LOGITS, dtype=torch.float32).repeat(n, 1)
    params = [SamplingParams(seed=i if seeded else None, **kw) for i in range(n)]
    sampler = Sampler(0)
    counts = np.zeros(len(LOGITS))
    rounds = 1 if not seeded else 50  # seeded rows: 50 steps of the same 400 requests
    for _ in range(rounds):
        toks = sampler.draw(logits, [f"r{i}" for i in range(n)], params)
        counts += np.bincount(toks.numpy(), minlength=len(LOGITS))
    want = reference(LOGITS, **kw)
    total = counts.sum()
    assert counts[want == 0].sum() == 0  # never a filtered-out token
    sd = np.sqrt(want * (1 - want) / total)
    assert np.all(np.abs(counts / total - want) <= 4.5 * sd + 1e-9), (counts / total, want)


def test_top_p_over_the_candidates_is_the_whole_sorts(monkeypatch):
    """The CPU's short cut: where the likeliest candidates hold every row's top_p, their sort alone keeps
    the same tokens as the whole vocabulary's; rows they do not cover sort everything."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5000, generator=g) * torch.linspace(1.0, 6.0, 16).unsqueeze(1)  # flat to peaked
    probs = logits.softmax(-1)
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99] * 4).unsqueeze(1)
    monkeypatch.setattr(S, "TOP_P_CANDIDATES", ())  # the whole vocabulary's sort
    want = Sampler._top_p(probs, top_p)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(1) or real_sort(self, *a, **k))
    monkeypatch.setattr(S, "TOP_P_CANDIDATES", (64, 1024))
    # peaked rows only (some beyond the first candidates: the second ones); with flat ones (a whole sort)
    for rows, sorted_all in ((slice(10, 16), False), (slice(0, 16), True)):
        sorts.clear()
        got = Sampler._top_p(probs[rows], top_p[rows])
        assert bool(sorts) == sorted_all
        assert torch.equal(got > 0, want[rows] > 0) and torch.allclose(got, want[rows])
