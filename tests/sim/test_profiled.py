"""ProfiledCostModel: fitting a synthetic profile, NNLS, and validation of profile files (pure)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.sim.profiled import FEATURES, ProfiledCostModel, decode_groups, features, nnls, token_knots

TRUE = dict(sampled=3e-4, prefill_attn=2e-8, prefix_kv=4e-7, decode_kv=6e-8, decode_kv15=2e-10,
            decodes=5e-5, decode_groups=4e-4, prefills=1e-3)
CONST, BETA = 2e-3, 8e-5  # the true token curve: a straight line


def _true_time(chunks) -> float:
    tokens, f = features(chunks, 16)
    return CONST + BETA * tokens + float(np.dot([TRUE[k] for k in FEATURES], f))


def _grid() -> list[list[tuple[int, int, bool]]]:
    grid = []
    for p, d, c in itertools.product((0, 16, 128, 512), (0, 1, 4, 16, 64), (64, 512, 1024)):
        if p == 0 and d == 0:
            continue
        chunks = [(c, 1, True)] * d + ([(0, p, True)] if p else [])
        grid.append(chunks)
    for p, prefix in itertools.product((64, 256), (256, 1024)):
        grid.append([(prefix, p, False)])
        grid.append([(prefix, p, True), (300, 1, True), (310, 1, True)])
    for d in (8, 32):
        grid.append([(64 + 30 * i, 1, True) for i in range(d)])  # spread contexts: several groups
    grid.append([(0, 128, False)])
    return grid


def _profile(weights: dict[str, float], noise: float = 0.0, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    samples = []
    for chunks in _grid():
        tokens, f = features(chunks, 16)
        t = CONST + BETA * tokens + float(np.dot([weights[k] for k in FEATURES], f))
        t *= 1.0 + noise * rng.standard_normal()
        samples.append({"chunks": [list(c) for c in chunks], "time_s": t, "times_s": [t]})
    return {"format": "tidal-profile/1", "block_size": 16, "decode_grouping": {"fill": 0.67, "min_group": 4},
            "samples": samples, "overhead": {"per_step_s": 1e-4, "per_seq_s": 2e-6}}


def _plan(chunks) -> StepPlan:
    sched = tuple(ScheduledChunk(f"r{i}", (1,) * n, s, tuple(range(-(-(s + n) // 16))), smp, SamplingParams())
                  for i, (s, n, smp) in enumerate(chunks))
    return StepPlan(0, sched, BatchComposition.of(sched))


def test_fit_recovers_known_coefficients_and_predicts_exactly():
    model = ProfiledCostModel.from_profile(_profile(TRUE))
    coef = model.coefficients()
    for name, true in TRUE.items():
        assert coef[name] == pytest.approx(true, rel=0.01), name
    assert model.knots == token_knots(features(c, 16)[0] for c in _grid())
    for k in model.knots:
        assert coef[f"tokens@{k}"] == pytest.approx(CONST + BETA * k, rel=0.01)
    # past the last knot the curve goes on with its slope
    assert model.token_time(4 * model.knots[-1]) == pytest.approx(CONST + BETA * 4 * model.knots[-1], rel=0.01)
    rep = model.fit_report()
    assert rep["r2"] > 0.999999 and rep["median_abs_rel_err"] < 1e-6 and rep["num_samples"] == len(_grid())
    for chunks in _grid():
        plan = _plan(chunks)
        want = _true_time(chunks) + 1e-4 + 2e-6 * len(chunks)
        assert model.step_time(plan) == pytest.approx(want, rel=1e-6)
    assert model.name == "profiled"


def test_fit_with_noise_stays_close_and_non_negative():
    model = ProfiledCostModel.from_profile(_profile(TRUE, noise=0.02, seed=3))
    rep = model.fit_report()
    assert rep["median_abs_rel_err"] < 0.03
    assert all(w >= 0 for w in model.weights)


def test_zero_weight_feature_is_not_made_negative():
    w = dict(TRUE, prefix_kv=0.0, decodes=0.0)
    model = ProfiledCostModel.from_profile(_profile(w, noise=0.01, seed=5))
    assert all(v >= 0 for v in model.weights)


def test_step_time_of_empty_plan_is_the_overhead():
    model = ProfiledCostModel.from_profile(_profile(TRUE))
    assert model.step_time(StepPlan(0, (), BatchComposition())) == pytest.approx(1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_nnls_is_non_negative_and_optimal(seed):
    rng = np.random.default_rng(seed)
    m, n = 12, 5
    a = rng.standard_normal((m, n))
    b = rng.standard_normal(m)
    x = nnls(a, b)
    assert (x >= 0).all()
    # brute force over the supports: the best non-negative unconstrained solution on any subset
    best = float(np.sum(b * b))
    for k in range(1, n + 1):
        for sub in itertools.combinations(range(n), k):
            z = np.linalg.lstsq(a[:, sub], b, rcond=None)[0]
            if (z >= 0).all():
                best = min(best, float(np.sum((a[:, sub] @ z - b) ** 2)))
    assert float(np.sum((a @ x - b) ** 2)) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_nnls_matches_least_squares_when_unconstrained_is_positive():
    rng = np.random.default_rng(1)
    a = rng.random((30, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    assert np.allclose(nnls(a, a @ x_true), x_true)


def test_decode_groups_follow_the_runner():
    assert decode_groups([100, 100, 100], 0.67, 4) == [(3, 100)]
    # a drop below 0.67 x the longest only splits once the group has min_group decodes
    assert decode_groups([1000, 900, 100], 0.67, 4) == [(3, 1000)]
    assert decode_groups([1000, 990, 980, 970, 300, 290], 0.67, 4) == [(4, 1000), (2, 300)]
    assert decode_groups([], 0.67, 4) == []


def test_features_follow_eq1():
    tokens, f = features([(0, 10, True), (20, 5, False), (63, 1, True)], 16)
    f = dict(zip(FEATURES, f, strict=True))
    assert tokens == 16 and f["sampled"] == 2 and f["prefills"] == 2 and f["decodes"] == 1
    assert f["prefill_attn"] == (10 * 10 + 10) / 2 + 20 * 5 + (25 + 5) / 2
    assert f["prefix_kv"] == 25
    assert f["decode_kv"] == 64 and f["decode_kv15"] == 64 ** 1.5 and f["decode_groups"] == 1


def test_token_knots_skip_knots_without_samples():
    assert token_knots([1, 4, 16, 17, 80]) == [1, 4, 16, 32, 80]
    assert token_knots([1, 100]) == [1, 100]  # nothing between: no knot could be fitted
    assert token_knots([5]) == [5]


# ------------------------------------------------------------------------------ bad files
def _write(tmp_path, content) -> str:
    p = tmp_path / "profile.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        ProfiledCostModel.load(str(tmp_path / "nope.json"))


def test_bad_json(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        ProfiledCostModel.load(_write(tmp_path, "{not json"))


def test_wrong_format(tmp_path):
    with pytest.raises(ValueError, match="unknown format"):
        ProfiledCostModel.load(_write(tmp_path, dict(_profile(TRUE), format="other/2")))
    with pytest.raises(ValueError, match="expected a JSON object"):
        ProfiledCostModel.load(_write(tmp_path, "[1, 2]"))


def test_too_few_samples(tmp_path):
    data = _profile(TRUE)
    data["samples"] = data["samples"][:3]
    with pytest.raises(ValueError, match="too few samples"):
        ProfiledCostModel.load(_write(tmp_path, data))


def test_malformed_sample(tmp_path):
    data = _profile(TRUE)
    data["samples"][2] = {"chunks": [[0, 5]], "time_s": 0.1}
    with pytest.raises(ValueError, match="sample 2 is malformed"):
        ProfiledCostModel.load(_write(tmp_path, data))
    data["samples"][2] = {"chunks": [[0, 5, True]], "time_s": -1}
    with pytest.raises(ValueError, match="sample 2"):
        ProfiledCostModel.load(_write(tmp_path, data))


def test_load_round_trip(tmp_path):
    path = _write(tmp_path, _profile(TRUE))
    model = ProfiledCostModel.load(path)
    assert model.coefficients()["decode_kv"] == pytest.approx(TRUE["decode_kv"], rel=0.01)
