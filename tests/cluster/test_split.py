"""DynaServe's global scheduler (tidal.cluster.split): split points, the length predictor, the
execution predictor against a naive pass-by-pass reference, Alg. 1 on hand-worked cases, the
ledger, pairing, and replaying recorded decisions."""

from __future__ import annotations

import random
import time

import pytest

from tidal.cluster.split import (
    LengthPredictor,
    SplitParams,
    SplitPlanner,
    pairs,
    replay,
    split_parts,
    with_cached,
)
from tidal.cluster.split_predict import ExecutionPredictor, MicroRequest
from tidal.config import ConfigError
from tidal.policies.profile_table import ProfileTable

BIG = dict(token_budget=2048, max_num_seqs=256)


def one_per_pass(p, ctx, d, prefix=0.0):  # every pass takes 1 s: predicted times count passes
    return 1.0


def linear(p, ctx, d, prefix=0.0):  # prefix: the prefill chunks' token-weighted mean prefix
    return 0.01 + 1e-4 * p + 2e-4 * d + 1e-7 * d * ctx + 1e-8 * p * ctx + 3e-8 * p * prefix


# ============================================================================ split points
@pytest.mark.parametrize("s, alpha, beta", [
    (0, None, (10, 0, 5)),  # whole request on beta
    (4, (4, 0, 0), (6, 4, 5)),  # inside the prompt: alpha samples nothing
    (10, (10, 0, 1), (0, 10, 4)),  # at its end: P/D disaggregation, alpha samples the first token
    (12, (10, 0, 3), (0, 12, 2)),  # inside the output
    (13, (10, 0, 4), (0, 13, 1)),  # beta samples only the last token
    (14, (10, 0, 5), None),  # L - 1: alpha has sampled all 5 tokens
    (15, (10, 0, 5), None),  # L: whole request on alpha
    (99, (10, 0, 5), None),  # clamped to L
    (-3, None, (10, 0, 5)),  # clamped to 0
])
def test_split_parts_positions(s, alpha, beta):
    a, b = split_parts(10, 5, s, "r")
    as_tuple = lambda m: None if m is None else (m.prefill_tokens, m.context, m.decode_tokens)  # noqa: E731
    assert (as_tuple(a), as_tuple(b)) == (alpha, beta)


@pytest.mark.parametrize("P, D", [(1, 1), (1, 7), (9, 1), (13, 12), (219, 1467), (8192, 32)])
def test_split_parts_cover_the_request_exactly_once(P, D):
    L = P + D
    for s in range(0, L + 1):
        a, b = split_parts(P, D, s)
        sampled = (a.decode_tokens if a else 0) + (b.decode_tokens if b else 0)
        assert sampled == D  # alpha's and beta's sampled tokens add up to the prediction
        if a is not None and b is not None:
            assert a.context == 0 and a.end == s == b.context  # alpha's KV is [0, s), beta starts there
            assert a.prefill_tokens + b.prefill_tokens == P
        last = b if b is not None else a
        assert last.end == L - 1  # the last sampled token's KV is never computed


def test_split_parts_rejects_empty_requests():
    with pytest.raises(ValueError):
        split_parts(0, 5, 1)
    with pytest.raises(ValueError):
        split_parts(5, 0, 1)


# ============================================================================ output length
def test_length_predictor_default_margin_and_cap():
    lp = LengthPredictor(margin=20, default=256)
    assert lp.predict(100, 10_000) == 256 + 20  # no history: the default plus the margin
    assert lp.predict(100, 50) == 50  # never above max_tokens
    for out in (90, 100, 110):
        lp.observe(300, out)
    assert lp.estimate(300) == pytest.approx(100.0)
    assert lp.predict(300, 10_000) == 120  # mean + margin covers every observed output (underestimate protection)
    assert all(lp.predict(300, 10_000) >= out for out in (90, 100, 110))
    assert lp.predict(300, 105) == 105


def test_length_predictor_buckets_by_prompt_length_and_falls_back_to_the_global_mean():
    lp = LengthPredictor(margin=0, buckets=(256, 4096))
    for _ in range(4):
        lp.observe(200, 1000)  # short prompts, long outputs
        lp.observe(8000, 30)  # long prompts, short outputs
    assert lp.predict(100, 1 << 20) == 1000 and lp.predict(9000, 1 << 20) == 30
    assert lp.predict(1000, 1 << 20) == 515  # the middle bucket has no history: the mean of all
    with pytest.raises(ValueError):
        LengthPredictor(margin=-1)


# ============================================================================ execution predictor
def naive_total(queue, f, budget, max_seqs, kv_cap=float("inf")):
    """The virtual passes one by one (tidal.cluster.split_predict's docstring), per request."""
    live = [m for m in queue if not m.empty]
    held = lambda: sum(live[i].end for i in running)  # noqa: E731  (KV reserved by the running ones)
    pre = [m.prefill_tokens for m in live]
    kv = [m.context for m in live]
    steps = [m.decode_steps for m in live]
    waiting, running, t = list(range(len(live))), [], 0.0
    while waiting or running:
        left, sched, ptok, ctxs, pairs = budget, [], 0, [], 0
        for i in running:  # admission order: decodes take 1, prefills what is left (at least 1)
            if pre[i] > 0:
                c = min(pre[i], max(left, 1))
                sched.append((i, c, True))
                ptok += c
                pairs += c * kv[i]  # its chunk after a prefix of kv[i]
            else:
                c = 1
                sched.append((i, 1, False))
                ctxs.append(kv[i] + 1)
            left -= c
        while (waiting and len(running) < max_seqs and left > 0  # then FCFS admissions, while their KV fits
               and (held() + live[waiting[0]].end <= kv_cap or not running)):
            i = waiting.pop(0)
            running.append(i)
            if pre[i] > 0:
                c = min(pre[i], left)
                sched.append((i, c, True))
                ptok += c
                pairs += c * kv[i]
            else:
                c = 1
                sched.append((i, 1, False))
                ctxs.append(kv[i] + 1)
            left -= c
        ctx = sum(ctxs) / len(ctxs) if ctxs else 0.0
        t += f(ptok, ctx, len(ctxs), pairs / ptok) if pairs else f(ptok, ctx, len(ctxs))
        for i, c, is_prefill in sched:
            if is_prefill:
                pre[i] -= c
                kv[i] += c
                if pre[i] == 0 and steps[i] == 0:
                    running.remove(i)
            else:
                kv[i] += 1
                steps[i] -= 1
                if steps[i] == 0:
                    running.remove(i)
    return t


def random_part(rng, name):
    kind = rng.random()
    if kind < 0.3:
        return MicroRequest(name, rng.randint(1, 100), 0, rng.randint(0, 50))  # alpha-like / whole
    if kind < 0.6:
        return MicroRequest(name, 0, rng.randint(1, 100), rng.randint(1, 50))  # beta after s >= P
    return MicroRequest(name, rng.randint(1, 80), rng.randint(1, 50), rng.randint(0, 40))  # beta after s < P


@pytest.mark.parametrize("seed", range(4))
def test_execution_predictor_equals_the_naive_passes(seed):
    rng = random.Random(seed)
    for _ in range(60):
        budget, seqs = rng.choice([8, 16, 64, 2048]), rng.choice([1, 2, 4, 8, 256])
        kv = rng.choice([None, None, 150, 400])  # a KV pool of that many tokens, or none
        queue = [random_part(rng, str(j)) for j in range(rng.randint(0, 12))]
        ep = ExecutionPredictor(linear, budget, seqs, kv_capacity=kv)
        cap = float("inf") if kv is None else kv
        assert ep.total_time(queue) == pytest.approx(naive_total(queue, linear, budget, seqs, cap), rel=1e-9)
        # the delta of one more part (the planner's PREDICT) equals predicting the longer queue
        new = random_part(rng, "new")
        with_new = ep.total_time_with(ep.timeline(queue), new)
        assert with_new == pytest.approx(naive_total([*queue, new], linear, budget, seqs, cap), rel=1e-9)


def test_a_kv_pool_serializes_what_does_not_fit_together():
    # two decode-only parts of 10 passes whose ends (110 tokens each) fit a 250-token pool together
    # but not a 150-token one: 10 passes side by side, or 20 one after the other
    queue = [MicroRequest("a", 0, 100, 10), MicroRequest("b", 0, 100, 10)]
    assert ExecutionPredictor(one_per_pass, kv_capacity=250).total_time(queue) == 10
    assert ExecutionPredictor(one_per_pass, kv_capacity=150).total_time(queue) == 20
    assert ExecutionPredictor(one_per_pass, kv_capacity=50).total_time(queue) == 20  # alone it always runs


def test_execution_predictor_with_a_profile_table_stays_close_to_the_naive_passes():
    table = ProfileTable()
    for p in (0, 256, 1024, 2048):
        for c in (100, 1000, 4000):
            for d in (0, 1, 16, 64, 128):
                table.record(p, c, d, linear(p, c, d) * (1.2 if d > 32 else 1.0))  # not linear
    rng = random.Random(7)
    queue = [MicroRequest(str(i), rng.randint(0, 3000), rng.randint(0, 2000), rng.randint(1, 600)) for i in range(40)]
    fast = ExecutionPredictor(table.predict, 512, 64).total_time(queue)
    assert fast == pytest.approx(naive_total(queue, table.predict, 512, 64), rel=0.01)


def test_execution_predictor_jumps_over_runs_and_is_fast():
    calls = []

    def counted(p, c, d, prefix=0.0):
        calls.append(1)
        return linear(p, c, d, prefix)
    ep = ExecutionPredictor(counted, 2048, 256)
    queue = ([MicroRequest(str(i), 0, 500 + i, 1000) for i in range(50)]
             + [MicroRequest(str(50 + i), 2000, 0, 1000) for i in range(50)])
    tl = ep.timeline(queue)
    assert tl.passes > 1000 and len(tl.runs) < 250 and len(calls) < 500  # runs, not passes
    t0 = time.perf_counter()
    for _ in range(10):
        ep.timeline(queue)
    assert (time.perf_counter() - t0) / 10 < 0.02  # about 0.3 ms here; loose for a shared machine
    assert tl.total == pytest.approx(naive_total(queue, linear, 2048, 256), rel=1e-9)


def test_empty_profile_falls_back_to_the_token_proxy():
    ep = ExecutionPredictor(ProfileTable().predict, 2048, 256, proxy_s_per_token=1e-3, proxy_min_tokens=100)
    assert ep.total_time([]) == 0.0
    # one 500-token prefill pass (samples), then 3 decode passes of one token (the 100-token floor)
    assert ep.total_time([MicroRequest("a", 500, 0, 4)]) == pytest.approx(0.5 + 3 * 0.1)


# ============================================================================ Alg. 1
def planner(step=one_per_pass, **kw):
    return SplitPlanner(SplitParams(**{**BIG, **kw}), step)


def test_cold_start_takes_the_pd_seed_without_a_search():
    pl = planner()
    d = pl.plan("r", 100, 1000, (0, 1), predicted_output=50)
    assert d.cold_start and d.probes == 0
    assert d.split == 100 and d.phi == pytest.approx(100 / 150)  # phi = P/L: alpha samples the first token
    assert pl.ledger(0) == (MicroRequest("r", 100, 0, 1),) and pl.ledger(1) == (MicroRequest("r", 0, 100, 49),)
    assert not pl.plan("s", 100, 1000, (0, 1), predicted_output=50).cold_start  # the ledgers are no longer empty


def test_alg1_hand_worked_alpha_loaded_balances_inside_the_output():
    # alpha has 60 decode passes left, beta nothing; P=10, D=100 (L=110), every pass 1 s.
    # probes s = 10, 60, 35, 48, 54, 51 give (T_alpha, T_beta) = (60, 99), (60, 49), (60, 74), (60, 61),
    # (60, 55), (60, 58): the best is s = 48
    pl = planner(epsilon_s=0.0)
    pl.load_ledger(0, [MicroRequest("old", 0, 500, 60)])
    d = pl.plan("r", 10, 1000, (0, 1), predicted_output=100)
    assert [p.split for p in d.trace] == [10, 60, 35, 48, 54, 51]
    assert [(p.t_alpha, p.t_beta) for p in d.trace] == [(60, 99), (60, 49), (60, 74), (60, 61), (60, 55), (60, 58)]
    assert (d.split, d.t_alpha, d.t_beta, d.probes) == (48, 60, 61, 6)
    assert pl.ledger(0)[-1] == MicroRequest("r", 10, 0, 39) and pl.ledger(1) == (MicroRequest("r", 0, 48, 61),)


def test_alg1_stops_once_balanced_within_epsilon():
    pl = planner(epsilon_s=1.5)
    pl.load_ledger(0, [MicroRequest("old", 0, 500, 60)])
    d = pl.plan("r", 10, 1000, (0, 1), predicted_output=100)
    assert d.probes == 4 and d.split == 48  # |60 - 61| < 1.5 at the 4th probe


def test_alg1_loaded_beta_moves_the_split_toward_alpha():
    # beta has 80 decode passes left, alpha nothing: alpha takes 80 of the 100 tokens (s = 89)
    pl = planner()
    pl.load_ledger(1, [MicroRequest("old", 0, 500, 80)])
    d = pl.plan("r", 10, 1000, (0, 1), predicted_output=100)
    assert [p.split for p in d.trace] == [10, 60, 85, 98, 92, 89]
    assert (d.split, d.t_alpha, d.t_beta) == (89, 80, 80)
    assert d.phi > 10 / 110 and d.alpha.decode_tokens == 80 and d.beta.decode_tokens == 20


def test_alg1_idle_beta_moves_the_split_into_the_prompt():
    # alpha is far behind: even P/D (s = P) leaves alpha the slower, so beta takes part of the prompt
    pl = planner(step=linear)
    pl.load_ledger(0, [MicroRequest(f"old{i}", 0, 2000, 400) for i in range(32)])
    d = pl.plan("r", 4000, 1 << 20, (0, 1), predicted_output=20)
    assert d.split < 4000 and d.phi < 4000 / 4020 and d.alpha.decode_tokens == 0
    assert d.beta.prefill_tokens == 4000 - d.split and d.beta.decode_tokens == 20
    assert 1 <= d.probes <= 6


@pytest.mark.parametrize("k", [1, 2, 6, 9])
def test_alg1_runs_at_most_k_probes(k):
    pl = planner(max_probes=k, epsilon_s=0.0)
    pl.load_ledger(0, [MicroRequest("old", 0, 500, 60)])
    d = pl.plan("r", 10, 1000, (0, 1), predicted_output=100)
    assert d.probes == len(d.trace) == k  # never balanced within 0 s here: every probe runs, no more


def test_ledger_follows_progress_handoff_and_finish():
    pl = planner()
    pl.load_ledger(0, [MicroRequest("old", 0, 10, 5)])
    d = pl.plan("r", 10, 1000, (0, 1), predicted_output=100)
    before = pl.load(1)
    pl.on_progress(1, "r", decoded=d.beta.decode_tokens - 1)
    assert pl.ledger(1)[0].decode_tokens == 1 and pl.load(1) < before
    pl.on_progress(0, "r", prefill_done=4)
    assert pl.ledger(0)[-1].prefill_tokens == 6 and pl.ledger(0)[-1].context == 4
    pl.on_handoff("r")
    assert [m.request_id for m in pl.ledger(0)] == ["old"] and len(pl.ledger(1)) == 1
    pl.on_finish("r", output_len=90)
    assert pl.ledger(1) == () and pl.lengths.count == 1 and pl.lengths.estimate(10) == 90
    pl.on_finish("r", 90)  # twice is harmless
    pl.plan("r2", 10, 1000, (0, 1), predicted_output=5)
    with pytest.raises(ValueError, match="already planned"):
        pl.plan("r2", 10, 1000, (0, 1), predicted_output=5)


def test_plan_uses_the_length_predictor_capped_at_max_tokens():
    pl = planner(margin=20)
    assert pl.plan("a", 50, 1 << 20, (0, 1)).predicted_output == 256 + 20
    assert pl.plan("b", 50, 100, (0, 1)).predicted_output == 100


# ============================================================================ pairs
@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_pairs_need_an_even_number_of_instances(n):
    with pytest.raises(ConfigError, match="even number"):
        pairs(n)


def test_pairs_and_choose_pair():
    assert pairs(2) == [(0, 1)] and pairs(6) == [(0, 1), (2, 3), (4, 5)]
    pl = planner()
    assert pl.choose_pair(10, 100, pairs(4)) == (0, 1)  # a tie: the lowest index
    pl.load_ledger(1, [MicroRequest("old", 0, 10, 500)])
    assert pl.choose_pair(10, 100, pairs(4)) == (2, 3)
    d = pl.plan("r", 10, 1000, None, predicted_output=100, candidates=pairs(4))
    assert d.pair == (2, 3)
    pl.on_failure(3)
    assert pl.choose_pair(10, 100, pairs(4)) == (0, 1) and pl.ledger(3) == ()
    pl.on_failure(0)
    assert pl.choose_pair(10, 100, pairs(4)) is None


def test_split_params_ranges_are_config_errors():
    with pytest.raises(ConfigError, match="max_probes"):
        SplitParams(max_probes=0)
    with pytest.raises(ConfigError, match="epsilon_s"):
        SplitParams(epsilon_s=-1.0)


# ============================================================================ record and replay
def test_every_decision_replays_from_its_record():
    records = []
    params = SplitParams(**BIG)
    pl = SplitPlanner(params, linear, recorder=records.append)
    rng = random.Random(3)
    for i in range(30):
        d = pl.plan(str(i), rng.randint(50, 4000), 4096, None, now=float(i), candidates=pairs(4))
        for inst in (d.pair[0], d.pair[1]):
            for m in pl.ledger(inst):
                pl.on_progress(inst, m.request_id, decoded=rng.randint(0, 3))
        if i % 3 == 0:
            pl.on_finish(str(i - 1), rng.randint(10, 800))
    assert len(records) == 30 and any(r.decision.pair == (2, 3) for r in records)
    assert any(not r.decision.cold_start and r.decision.split != r.decision.prompt_len for r in records)
    for rec in records:
        assert replay(rec, linear, params) == rec.decision
    # a different planner answers differently on the same views: the replay checks something
    other = SplitParams(**{**BIG, "max_probes": 1})
    assert any(replay(rec, linear, other) != rec.decision for rec in records)


def test_the_predictor_budget_comes_from_each_instances_recent_steps():
    from tidal.cluster.split import BUDGET_WINDOW

    planner = SplitPlanner(SplitParams(token_budget=2048, max_num_seqs=64), linear)
    planner.load_ledger(0, [MicroRequest("a", 8000, 0, 4)])  # a long prefill on alpha
    assert planner.budget(0) == 2048  # nothing reported yet: the configured budget
    before = planner.load(0)
    for _ in range(BUDGET_WINDOW):  # alpha's composer has been giving its steps ~500 tokens
        planner.on_budget(0, 500)
    assert planner.budget(0) == 496  # the mean, in steps of 16 tokens
    assert planner.load(0) > before  # more, smaller passes: the ledger is predicted again, longer
    assert planner.load(0) == pytest.approx(ExecutionPredictor(linear, 496, 64).total_time([MicroRequest("a", 8000, 0, 4)]))
    planner.on_budget(0, 5000)  # capped at the configured budget; a window of BUDGET_WINDOW steps
    assert planner.budget(0) == round((500 * (BUDGET_WINDOW - 1) + 2048) / BUDGET_WINDOW / 16) * 16
    assert planner.budget(1) == 2048  # each instance its own
    # a decision records the budgets it saw, and a replay with them decides the same
    records = []
    planner.recorder = records.append
    dec = planner.plan("r", 3000, 200, (0, 1), predicted_output=180)
    assert dict(records[0].budgets) == {0: planner.budget(0)}
    again = replay(records[0], linear, planner.params)
    assert (again.split, again.t_alpha, again.t_beta) == (dec.split, dec.t_alpha, dec.t_beta)


def test_flip_roles_puts_alpha_on_the_less_loaded_instance():
    busy = [MicroRequest(f"q{i}", 1500, 0, 200) for i in range(6)]
    for flip, want in ((False, (0, 1)), (True, (1, 0))):
        planner = SplitPlanner(SplitParams(token_budget=2048, max_num_seqs=64, flip_roles=flip), linear)
        planner.load_ledger(0, busy)  # instance 0 holds a queue; 1 has a short one
        planner.load_ledger(1, [MicroRequest("w", 100, 0, 10)])
        dec = planner.plan("r", 2000, 300, None, predicted_output=250, candidates=[(0, 1)])
        assert dec.pair == want
        assert planner.orientations([(0, 1)]) == (((0, 1), (1, 0)) if flip else ((0, 1),))


def test_a_cached_prefix_shortens_only_the_part_that_starts_the_request():
    alpha, beta = split_parts(3000, 200, 1000)  # split inside the prompt
    assert with_cached(alpha, 768) == MicroRequest("", 232, 768, 0)
    assert with_cached(alpha, 5000) == MicroRequest("", 1, 999, 0)  # the engine's hit stays short of s
    assert with_cached(beta, 768) == beta  # beta starts from alpha's KV, not from position 0
    whole, _ = split_parts(3000, 200, 3200)  # all on alpha: its last prompt token is still computed
    assert with_cached(whole, 4096) == MicroRequest("", 1, 2999, 200)
    assert with_cached(None, 100) is None and with_cached(alpha, 0) == alpha


def test_with_a_cache_view_alpha_goes_where_the_prefix_is_unless_load_says_otherwise():
    def decide(cached, busy_1=0):
        records = []
        pl = SplitPlanner(SplitParams(token_budget=2048, max_num_seqs=64, flip_roles=True), linear,
                          recorder=records.append)
        pl.load_ledger(0, [MicroRequest("w0", 400, 0, 50)])
        pl.load_ledger(1, [MicroRequest("w1", 400, 0, 50)] + [MicroRequest(f"q{i}", 4000, 0, 300) for i in range(busy_1)])
        dec = pl.plan("r", 6000, 300, None, predicted_output=250, candidates=[(0, 1)], cached=cached)
        return dec, records[0], pl

    dec, rec, _ = decide(None)
    assert dec.pair == (0, 1)  # equal loads, nothing known of caches: the lower index is alpha
    dec, rec, pl = decide({0: 0, 1: 5120})  # instance 1 holds the first 5,120 prompt tokens
    assert dec.pair == (1, 0) and dec.alpha is not None and dec.alpha.context == 5120
    assert pl.ledger(1)[-1] == dec.alpha  # the ledger holds the part less its cached prefix
    assert dict(rec.cached) == {1: 5120}
    again = replay(rec, linear, pl.params)  # the view is part of the record: the same decision comes back
    assert (again.pair, again.split, again.t_alpha, again.t_beta) == (dec.pair, dec.split, dec.t_alpha, dec.t_beta)
    dec, _, pl = decide({0: 0, 1: 5120}, busy_1=8)  # instance 1 is far behind: load wins over the cache,
    mine = [m for m in pl.ledger(1) if m.request_id == "r"]  # which gives it next to nothing of the request
    assert len(mine) == 1 and mine[0].prefill_tokens + mine[0].decode_tokens < 50


def test_a_ttft_target_keeps_the_prefill_unsplit_when_a_split_is_too_slow():
    def case(target):
        planner = SplitPlanner(SplitParams(token_budget=512, max_num_seqs=64, ttft_target_s=target), linear)
        # alpha is busy decoding; beta holds a short prefill queue: the balance point splits the prompt
        planner.load_ledger(0, [MicroRequest(f"a{i}", 0, 1000, 100) for i in range(40)])
        planner.load_ledger(1, [MicroRequest(f"b{i}", 2000, 0, 1) for i in range(2)])
        return planner.plan("r", 4000, 100, (0, 1), predicted_output=60)

    free = case(None)
    assert 0 < free.split < 4000  # Alg. 1 alone: inside the prompt (prefill on alpha, then on beta)
    inside = next(p for p in free.trace if p.split == free.split)
    bound = 0.5 * inside.ttft
    held = case(bound)
    chosen = next(p for p in held.trace if p.split == held.split)
    assert held.split in (0, 4000, 4060) or chosen.ttft <= bound
    assert chosen.ttft < inside.ttft  # the constraint bought a lower predicted TTFT
