"""The real cluster's split planner learns what the simulator's does (issue 39): each worker's step
report carries its prefill chunks' own prefix, the front's profile table records it, and the
step's token budget joins the instance's recent budgets (DynaServe Sec. 4.1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams
from tidal.runtime.split_front import SplitCoordinator
from tidal.runtime.worker import instance_status


def _plan(prefills: list[tuple[int, int]], decodes: list[int]) -> StepPlan:
    sp = SamplingParams()
    chunks = [ScheduledChunk(f"d{i}", (0,), ctx, (), True, sp) for i, ctx in enumerate(decodes)]
    chunks += [ScheduledChunk(f"p{i}", (0,) * n, x, (), True, sp) for i, (x, n) in enumerate(prefills)]
    return StepPlan(0, tuple(chunks), BatchComposition.of(chunks))


def _engine(plan: StepPlan, token_budget: int = 256) -> SimpleNamespace:
    sched = SimpleNamespace(queued_block_demand=lambda: 0, hol_block_demand=lambda: 0, num_running=3, num_waiting=0,
                            num_preemptions=0, last_caps=SimpleNamespace(max_num_seqs=64, token_budget=token_budget),
                            prefix_queries=0, prefix_hits=0, prefix_host_hits=0, queued_prefill_tokens=lambda: 0,
                            queued_prefill_position=lambda: 0.0, num_swap_preemptions=0, num_swap_fallbacks=0,
                            kv_reused_tokens=0)
    kv = SimpleNamespace(block_size=16, num_blocks=100, num_free_blocks=50, num_cached_blocks=0,
                         pool=SimpleNamespace(log=None), host_pool=SimpleNamespace(num_free=0))
    return SimpleNamespace(scheduler=sched, kv_manager=kv, last_plan=plan,
                           config=SimpleNamespace(scheduler=SimpleNamespace(batching="slo-compose")),
                           policy=SimpleNamespace(state=lambda: SimpleNamespace(to_dict=lambda: {})))


def test_a_step_report_carries_the_prefill_chunks_prefix():
    st = instance_status(_engine(_plan([(1000, 200), (0, 56)], [300, 500])), 1, step_time_s=0.05)
    assert st.step_prefill_tokens == 256 and st.step_decode_count == 2 and st.step_decode_context == 401
    assert st.step_prefill_prefix == pytest.approx(1000 * 200 / 256)  # token-weighted: sum c_i*x_i / p
    assert st.step_prefill_sq == 200 * 200 + 56 * 56
    idle = instance_status(_engine(_plan([], [300])), 1, step_time_s=0.02)
    assert idle.step_prefill_prefix == 0.0 and idle.step_prefill_sq is None


def _coordinator() -> SplitCoordinator:
    cluster = SimpleNamespace(config=SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=512,
                                                                               max_num_seqs=64)),
                              cluster=SimpleNamespace(split_placement="load"), cache_routing=False)
    return SplitCoordinator(cluster)  # type: ignore[arg-type]


def _cost(p: int, prefix: float, d: int, ctx: float) -> float:
    """A step time with a strong prefix term (attention over the chunk's own cached prefix)."""
    return 0.01 + 2e-5 * p + 4e-8 * p * prefix + 1e-4 * d + 1e-8 * d * ctx


def test_the_front_learns_the_prefix_and_the_recent_budgets():
    co = _coordinator()
    assert co.planner.budget(1) == 512  # the configured budget until a report
    for k in range(64):
        p, prefix, d, ctx = 64 + 32 * (k % 7), 512.0 * (k % 9), k % 5, 100.0 + 40 * (k % 11)
        plan = _plan([(int(prefix), p)], [int(ctx)] * d) if d else _plan([(int(prefix), p)], [])
        st = instance_status(_engine(plan, token_budget=128), 1, step_time_s=_cost(p, prefix, d, ctx))
        co.record_step(st)
    assert co.planner.budget(1) == 128 and co.planner.budget(0) == 512
    # a chunk deep into a long prompt: priced at its own prefix (the old record left the prefix out)
    for p, prefix in ((200, 4000.0), (100, 3500.0), (250, 500.0)):
        got = co.step_table.predict(p, 300.0, 2, prefix)
        assert got == pytest.approx(_cost(p, prefix, 2, 300.0), rel=0.05)


def test_an_alpha_part_streams_its_kv_every_16_tokens_and_at_its_split_point():
    """One chunk set per STREAM_TOKENS new tokens (as the simulator's split streams), not one per
    decode step: a step-by-step stream made thousands of tiny shared-memory chunks a request."""
    from collections import deque

    from tidal.runtime.kv_moves import STREAM_TOKENS, _Export
    from tidal.runtime.worker import Worker

    state = {"upto": 55, "reached": []}
    transfer = SimpleNamespace(layer_ids=list(range(30)), computed_tokens=lambda rid: state["upto"],
                               drain_reached_pause=lambda: state.pop("reached", []) or [])
    w = SimpleNamespace(engine=SimpleNamespace(transfer=transfer), exports=deque([_Export("r", stream=True)]),
                        cfg=SimpleNamespace(layers_per_chunk=8, tokens_per_chunk=0))
    ex = w.exports[0]
    Worker.stream_splits(w)  # the prompt's 55 tokens: 4 layer groups of 8, 8, 8, 6
    assert [(c.start, c.end) for c in ex.chunks] == [(0, 55)] * 4 and ex.sent == 55 and not ex.done
    ex.chunks.clear()
    for k in range(1, STREAM_TOKENS):  # decode steps: too few new tokens for a chunk yet
        state["upto"] = 55 + k
        Worker.stream_splits(w)
        assert not ex.chunks and ex.sent == 55
    state["upto"] = 55 + STREAM_TOKENS
    Worker.stream_splits(w)
    assert {(c.start, c.end) for c in ex.chunks} == {(55, 71)} and len(ex.chunks) == 4
    ex.chunks.clear()
    state["upto"], state["reached"] = 74, ["r"]  # the split point: the rest goes at once
    Worker.stream_splits(w)
    assert {(c.start, c.end) for c in ex.chunks} == {(71, 74)} and ex.done
