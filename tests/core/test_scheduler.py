"""The Scheduler driven by hand with fabricated StepResults (no torch, no model).

``Driver`` plays the executor: it applies each plan's swap copies and chunk writes to a
simulated paged KV store (block id -> token per slot) and checks, before every chunk, that the
cache really holds the request's earlier tokens where its block table says. Its fake "model"
samples ``fake_token(request id, output index)``, so any lost or duplicated token is visible.
"""

from __future__ import annotations

import random
import zlib

import pytest

from tidal.config import SchedulerConfig
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import StepPlan, StepResult
from tidal.core.request import FinishReason, Request, RequestStatus
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import Scheduler

PROMPT_BASE = 5000  # prompt token ids never collide with sampled ones (10..1009) or EOS


def fake_token(rid: str, index: int) -> int:
    return zlib.crc32(f"{rid}:{index}".encode()) % 1000 + 10


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, mode="recompute", host_blocks=0,
                   max_model_len=None, watermark=0.0, threshold=0) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, num_host_blocks=host_blocks)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=threshold, preemption_mode=mode)
    return Scheduler(cfg, kv, max_model_len=max_model_len, watermark=watermark)


def make_request(rid: str, prompt_len: int, max_tokens: int | None = 16, arrival: float = 0.0,
                 priority: int = 0, eos: tuple[int, ...] = (), **sampling) -> Request:
    prompt = [PROMPT_BASE + (zlib.crc32(rid.encode()) + i) % 1000 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sampling), arrival_time=arrival,
                   eos_token_ids=eos, priority=priority)


class Driver:
    """schedule -> fabricate a StepResult -> update, with a simulated KV store checked each step."""

    def __init__(self, sched: Scheduler, token_fn=fake_token):
        self.sched = sched
        self.token_fn = token_fn
        self.now = 0.0
        self.added: dict[str, Request] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[str | None, int | str | None]] = {}
        self.updates: list = []
        self.plans: list[StepPlan] = []
        self.aborted: set[str] = set()
        bs = sched.kv.block_size
        self.dev: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self._empty = lambda: [None] * bs

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        self.added[req.request_id] = req
        self.prompts[req.request_id] = list(req.prompt_token_ids)
        self.outputs[req.request_id] = []
        return req

    def seq(self, rid: str) -> list[int]:
        return self.prompts[rid] + self.outputs[rid]

    def step(self, token_fn=None):
        token_fn = token_fn or self.token_fn
        sched, kv = self.sched, self.sched.kv
        plan = sched.schedule(self.now)
        self.plans.append(plan)
        budget = sched.config.max_num_batched_tokens
        assert plan.num_tokens <= budget
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        assert sched.num_running <= sched.config.max_num_seqs
        # executor: swap copies first (out, then in), then the chunks' KV writes
        for d, h in plan.swap_out:
            self.host[h] = list(self.dev.get(d, self._empty()))
        for h, d in plan.swap_in:
            self.dev[d] = list(self.host[h])
        bs = kv.block_size
        sampled = {}
        for c in plan.chunks:
            seq = self.seq(c.request_id)
            assert list(c.token_ids) == seq[c.start:c.start + c.num_tokens]
            assert c.sample == (c.start + c.num_tokens == len(seq))
            assert c.output_index == len(self.outputs[c.request_id])
            assert len(c.block_table) >= kv.blocks_for_tokens(c.context_len)
            for p in range(c.start):  # the cache holds exactly this request's earlier tokens
                got = self.dev.get(c.block_table[p // bs], self._empty())[p % bs]
                assert got == seq[p], (c.request_id, p, got, seq[p])
            for i, t in enumerate(c.token_ids):
                p = c.start + i
                self.dev.setdefault(c.block_table[p // bs], self._empty())[p % bs] = t
            if c.sample:
                sampled[c.request_id] = token_fn(c.request_id, c.output_index)
        result = StepResult(plan.step_id, sampled=sampled, step_time_s=0.01)
        self.now += 0.01
        updates = sched.update(plan, result, self.now)
        self.updates.extend(updates)
        for u in updates:
            self.outputs[u.request_id].extend(u.new_token_ids)
            if u.finished:
                self.finish[u.request_id] = (u.finish_reason, u.stop_reason)
        self.check_state()
        return plan, updates

    def check_state(self):
        sched, kv = self.sched, self.sched.kv
        kv.check_invariants()
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert kv.num_blocks_of(r.request_id) == kv.blocks_for_tokens(r.num_computed_tokens)
        for r in sched.waiting:
            assert r.status is RequestStatus.WAITING
            assert r.num_computed_tokens == 0 and not kv.has(r.request_id)
        for r in sched.swapped:
            assert r.status is RequestStatus.SWAPPED
            assert kv.num_blocks_of(r.request_id) == 0
            assert kv.num_host_blocks_of(r.request_id) == kv.blocks_for_tokens(r.num_computed_tokens)
        for rid, req in sched.requests.items():
            assert req.output_token_ids == self.outputs[rid]

    def run(self, max_steps=2000, token_fn=None):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step(token_fn)
        raise AssertionError("the scheduler did not finish its requests (livelock?)")


def chunks_of(plan: StepPlan, rid: str):
    return [c for c in plan.chunks if c.request_id == rid]


# ============================================================================ chunked prefill


def test_chunked_prefill_splits_prompt_and_samples_only_on_last_chunk():
    d = Driver(make_scheduler(budget=32, block_size=16, num_blocks=32))
    d.add(make_request("a", 100, max_tokens=2))
    shapes = []
    for _ in range(4):
        plan, updates = d.step()
        (c,) = plan.chunks
        shapes.append((c.start, c.num_tokens, c.sample))
        assert plan.composition.num_prefill_seqs == 1 and plan.composition.num_decode_seqs == 0
        assert plan.composition.num_prefill_tokens == c.num_tokens
        assert bool(updates) == c.sample
    assert shapes == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert d.outputs["a"] == [fake_token("a", 0)]
    req = d.sched.requests["a"]
    assert req.num_computed_tokens == 100 and req.first_token_time is not None
    plan, _ = d.step()
    (c,) = plan.chunks
    assert (c.start, c.num_tokens, c.sample, c.is_decode) == (100, 1, True, True)
    assert d.finish["a"] == ("length", None)


def test_long_prefill_threshold_caps_a_chunk():
    d = Driver(make_scheduler(budget=32, threshold=10))
    d.add(make_request("a", 25, max_tokens=1))
    sizes = [d.step()[0].chunks[0].num_tokens for _ in range(3)]
    assert sizes == [10, 10, 5]


def test_decodes_go_before_new_prefills_and_share_the_budget():
    d = Driver(make_scheduler(budget=32))
    d.add(make_request("a", 10, max_tokens=8))
    d.step()  # a's prefill
    d.add(make_request("b", 100, max_tokens=2, arrival=1.0))
    plan, _ = d.step()
    assert [(c.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 10, 1), ("b", 0, 31)]
    comp = plan.composition
    assert (comp.num_decode_seqs, comp.num_prefill_seqs, comp.num_prefill_tokens) == (1, 1, 31)
    assert comp.batch_size == 2 and comp.num_tokens == 32 == plan.num_tokens
    assert comp.context_lens == (11, 31)
    assert comp.mean_context == pytest.approx(21.0)
    # b's unfinished prefill (a running request) still comes after a's decode, before admissions
    d.add(make_request("c", 5, arrival=2.0))
    plan, _ = d.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 31)]
    # b's prompt ends (38 left after 31+31): a's decode, b's last 38 tokens do not fit: 31 more
    plan, _ = d.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 31)]
    plan, _ = d.step()  # b: 7 left, then c is admitted with what remains of the budget
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 7), ("c", 5)]


def test_running_prefill_continues_before_admissions():
    d = Driver(make_scheduler(budget=16))
    d.add(make_request("a", 40, max_tokens=1))
    d.add(make_request("b", 4, max_tokens=1, arrival=1.0))
    plan, _ = d.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 16)]
    plan, _ = d.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 16)]
    plan, _ = d.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 8), ("b", 4)]


def test_max_num_seqs_caps_running():
    d = Driver(make_scheduler(max_seqs=2, budget=64))
    for i in range(4):
        d.add(make_request(f"r{i}", 4, max_tokens=2 + i, arrival=float(i)))
    plan, _ = d.step()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert d.sched.num_running == 2 and d.sched.num_waiting == 2
    d.step()  # r0 finishes (2 tokens)
    assert d.finish["r0"] == ("length", None)
    plan, _ = d.step()
    assert [c.request_id for c in plan.chunks] == ["r1", "r2"]
    d.run()
    assert {rid: len(o) for rid, o in d.outputs.items()} == {"r0": 2, "r1": 3, "r2": 4, "r3": 5}


# ============================================================================ stop conditions


def test_max_tokens_finishes_with_length_and_frees_blocks():
    d = Driver(make_scheduler())
    d.add(make_request("a", 6, max_tokens=3))
    d.run()
    assert d.outputs["a"] == [fake_token("a", i) for i in range(3)]
    assert d.finish["a"] == ("length", None)
    req_updates = [u for u in d.updates if u.request_id == "a"]
    assert [u.finished for u in req_updates] == [False, False, True]
    assert d.sched.kv.num_free_blocks == d.sched.kv.num_blocks
    assert "a" not in d.sched.requests


def eos_at(index: int, eos: int):
    return lambda rid, i: eos if i == index else fake_token(rid, i)


def test_eos_finishes_with_stop():
    d = Driver(make_scheduler())
    r = d.add(make_request("a", 6, max_tokens=10, eos=(2,)))
    d.run(token_fn=eos_at(2, 2))
    assert len(d.outputs["a"]) == 3 and d.outputs["a"][-1] == 2
    assert d.finish["a"] == ("stop", None)
    assert r.finish_reason is FinishReason.STOP and r.stop_reason is None
    assert r.status is RequestStatus.FINISHED


def test_ignore_eos_runs_to_max_tokens():
    d = Driver(make_scheduler())
    d.add(make_request("a", 6, max_tokens=10, eos=(2,), ignore_eos=True))
    d.run(token_fn=lambda rid, i: 2)
    assert d.outputs["a"] == [2] * 10
    assert d.finish["a"] == ("length", None)


def test_stop_token_ids_finish_with_stop_reason():
    d = Driver(make_scheduler())
    r = d.add(make_request("a", 6, max_tokens=10, stop_token_ids=[55]))
    d.run(token_fn=eos_at(1, 55))
    assert len(d.outputs["a"]) == 2
    assert d.finish["a"] == ("stop", 55)
    assert r.stop_reason == 55


def test_min_tokens_suppresses_eos_and_stop_tokens():
    d = Driver(make_scheduler())
    d.add(make_request("a", 6, max_tokens=10, eos=(2,), min_tokens=4))
    d.add(make_request("b", 6, max_tokens=10, min_tokens=3, stop_token_ids=[55]))
    d.run(token_fn=lambda rid, i: 2 if rid == "a" else 55)
    assert d.outputs["a"] == [2, 2, 2, 2] and d.finish["a"] == ("stop", None)
    assert d.outputs["b"] == [55, 55, 55] and d.finish["b"] == ("stop", 55)


def test_context_length_limits_output():
    d = Driver(make_scheduler(max_model_len=12))
    r = d.add(make_request("a", 8, max_tokens=None))
    assert r.max_model_len == 12 and r.max_output_tokens == 4
    d.run()
    assert len(d.outputs["a"]) == 4 and d.finish["a"] == ("length", None)


# ============================================================================ abort / finished


def test_abort_frees_all_blocks_at_once():
    s = make_scheduler(num_blocks=16, block_size=4, budget=16, mode="swap", host_blocks=16)
    d = Driver(s)
    for i in range(5):
        d.add(make_request(f"r{i}", 10, max_tokens=50, arrival=float(i)))
    for _ in range(12):
        d.step()
    assert s.kv.num_free_blocks < s.kv.num_blocks
    assert s.running and (s.waiting or s.swapped)
    ids = list(s.requests)
    assert s.abort_requests(ids + ["unknown"], now=1.0) == ids
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.kv.host_pool.num_free == s.kv.host_pool.num_blocks
    assert not s.has_unfinished() and not s.requests
    s.kv.check_invariants()
    plan = s.schedule(2.0)
    assert plan.is_empty and set(plan.finished) == set(ids)


def test_abort_while_step_runs_skips_its_result():
    s = make_scheduler()
    d = Driver(s)
    d.add(make_request("a", 8, max_tokens=5))
    d.add(make_request("b", 8, max_tokens=5))
    plan = s.schedule(0.0)
    s.abort_requests(["a"])
    updates = s.update(plan, StepResult(plan.step_id, sampled={"a": 11, "b": 12}), 0.01)
    assert [u.request_id for u in updates] == ["b"]
    assert s.kv.num_blocks_of("a") == 0


def test_plan_finished_lists_ids_finished_since_previous_plan():
    d = Driver(make_scheduler())
    d.add(make_request("a", 4, max_tokens=1))
    d.add(make_request("b", 4, max_tokens=3))
    plan, _ = d.step()  # a finishes in this update
    assert plan.finished == ()
    plan, _ = d.step()
    assert plan.finished == ("a",)
    d.sched.abort_requests(["b"])
    plan, _ = d.step()
    assert plan.finished == ("b",) and plan.is_empty
    plan, _ = d.step()
    assert plan.finished == ()


def test_add_running_resumes_from_imported_kv():
    s = make_scheduler(num_blocks=8, block_size=4)
    d = Driver(s)
    req = make_request("m", 8, max_tokens=5)
    req.output_token_ids = [fake_token("m", 0), fake_token("m", 1)]
    req.num_computed_tokens = 9  # prompt + first output in the imported KV; the last one is not
    assert s.add_running(req)
    assert req.status is RequestStatus.RUNNING and s.running == [req]
    assert s.kv.num_blocks_of("m") == 3
    d.added["m"], d.prompts["m"], d.outputs["m"] = req, list(req.prompt_token_ids), list(req.output_token_ids)
    seq = d.seq("m")
    for p in range(9):  # what the engine's import writes into the blocks
        d.dev.setdefault(s.kv.block_table("m")[p // 4], [None] * 4)[p % 4] = seq[p]
    plan, _ = d.step()
    (c,) = plan.chunks
    assert (c.start, c.num_tokens, c.sample, c.output_index) == (9, 1, True, 2)
    d.run()
    assert d.outputs["m"] == [fake_token("m", i) for i in range(5)]
    big = make_request("big", 8, max_tokens=5)
    big.num_computed_tokens = 40  # more than the free blocks
    assert not s.add_running(big)
    assert "big" not in s.requests and not s.kv.has("big") and big not in s.waiting


def test_waiting_requests_admitted_by_priority_then_arrival():
    d = Driver(make_scheduler(max_seqs=1))
    d.add(make_request("c", 4, max_tokens=1, arrival=0.0, priority=2))
    d.add(make_request("a", 4, max_tokens=1, arrival=2.0, priority=0))
    d.add(make_request("b", 4, max_tokens=1, arrival=1.0, priority=0))
    d.add(make_request("d", 4, max_tokens=1, arrival=3.0, priority=-1))
    order = []
    d.run()
    for plan in d.plans:
        order += [c.request_id for c in plan.chunks]
    assert order == ["d", "b", "a", "c"]


# ============================================================================ randomized


def _run_random(seed: int, mode: str, abort_p: float = 0.0):
    """Many requests of random lengths arriving over time on a tight pool; with ``abort_p``, a
    random live request (waiting, running or swapped) is aborted before a step now and then."""
    rng = random.Random(seed)
    bs = 4
    num_blocks = rng.randint(12, 24)
    budget = rng.choice([8, 16, 24, 48])
    s = make_scheduler(num_blocks=num_blocks, block_size=bs, budget=budget, max_seqs=rng.randint(2, 8),
                       mode=mode, host_blocks=rng.choice([2, 8, 32]),
                       threshold=rng.choice([0, 0, 6]), watermark=rng.choice([0.0, 0.01, 0.1]))
    d = Driver(s)
    cap_tokens = num_blocks * bs
    pending = []
    for i in range(rng.randint(10, 30)):
        prompt = rng.randint(1, min(40, cap_tokens - 2))
        max_tokens = rng.randint(1, min(30, cap_tokens - prompt))  # fits the pool when alone
        pending.append((rng.randint(0, 40), make_request(f"q{i}", prompt, max_tokens=max_tokens,
                                                            arrival=float(i), priority=rng.choice([0, 0, 1]))))
    pending.sort(key=lambda x: x[0])
    aborted: set[str] = set()
    step = 0
    while pending or s.has_unfinished():
        while pending and pending[0][0] <= step:
            d.add(pending.pop(0)[1])
        if s.requests and rng.random() < abort_p:
            rid = rng.choice(sorted(s.requests))
            assert s.abort_requests([rid], now=d.now) == [rid]
            assert not s.kv.has(rid)
            aborted.add(rid)
        d.step()
        step += 1
        assert step < 3000, "livelock"
    for rid, out in d.outputs.items():
        assert out == [fake_token(rid, i) for i in range(len(out))], rid
        if rid in aborted:
            assert rid not in d.finish and d.added[rid].finish_reason is FinishReason.ABORT
        else:
            assert d.finish[rid] == ("length", None), rid
    d.aborted = aborted
    return d, s


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_never_loses_or_duplicates_tokens(seed, mode):
    d, s = _run_random(seed, mode)
    expected = {rid: r.sampling_params.max_tokens for rid, r in d.added.items()}
    assert {rid: len(o) for rid, o in d.outputs.items()} == expected
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.kv.host_pool.num_free == s.kv.host_pool.num_blocks
    s.kv.check_invariants()
    assert not s.requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_aborts_frees_everything(seed, mode):
    d, s = _run_random(seed + 100, mode, abort_p=0.05)
    for rid, r in d.added.items():
        if rid not in d.aborted:
            assert len(d.outputs[rid]) == r.sampling_params.max_tokens
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.kv.host_pool.num_free == s.kv.host_pool.num_blocks
    s.kv.check_invariants()
    assert not s.requests


def test_random_workloads_do_preempt():
    """Guard the randomized test's power: the tight pools really do force preemption and swaps."""
    preempt = swaps = 0
    for seed in range(12):
        for mode in ("recompute", "swap"):
            d, s = _run_random(seed, mode)
            preempt += s.num_preemptions
            swaps += sum(len(p.swap_out) for p in d.plans)
    assert preempt > 10 and swaps > 0


def test_decode_only_fast_path_keeps_the_finished_ids_for_the_next_plan():
    """begin_decodes / end_decodes (a simulator's steps without a plan) must not lose the ids a
    plan carries so that executors drop their state: they reach the next plan."""
    s = make_scheduler()
    d = Driver(s)
    d.add(make_request("a", 4, max_tokens=1))
    d.add(make_request("b", 4, max_tokens=4))
    d.step()  # both prefill; a finishes in this update
    positions = s.decode_positions()
    assert positions == [("b", 4)]  # its first output token, at the position after the prompt
    batch = s.begin_decodes(positions)
    s.end_decodes(batch, 7, 1.0)
    s.end_decode_run(0, 7, 1.0)
    assert s.schedule(2.0).finished == ("a",)
