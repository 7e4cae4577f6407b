"""Sampling parameters at the edges of their ranges (what a fuzzer sends: a top_p or temperature
that is a denormal, which float32 rounds to 0) still sample a token; an engine whose step raised
on them failed every request of the server (found by schemathesis)."""

from __future__ import annotations

import pytest
import torch

from tidal.core.sampling import SamplingParams
from tidal.engine.sampler import Sampler


@pytest.mark.parametrize("kw", [dict(top_p=5e-324), dict(temperature=5e-324), dict(temperature=1e-38, top_p=1e-300),
                                dict(min_p=1.0, top_p=5e-324), dict(top_k=2**70, temperature=2.0)])
@pytest.mark.parametrize("seed", [None, 7])
def test_degenerate_sampling_parameters_still_pick_a_likely_token(kw, seed):
    logits = torch.tensor([[1.0, 30.0, 2.0, 29.5], [5.0, 4.0, 3.0, 2.0]])
    params = [SamplingParams(seed=seed, **kw)] * 2
    tokens, _ = Sampler(0).sample(logits, ["a", "b"], params)
    if "top_k" not in kw:  # top_p ~ 0 or temperature ~ 0: the likeliest token
        assert tokens == [1, 0]
    else:
        assert all(0 <= t < 4 for t in tokens)
