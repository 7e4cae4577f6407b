"""An engine whose preemption mode a cluster decision switches at run time (``--kv-pressure auto``):
swap from the moment it is told, the same greedy tokens as one engine with room for everything; and
KunServe's drop with a host pool: the swapped-out requests recompute (their answers one engine's),
the instance preempts by recompute while layers are dropped, and as configured once whole again."""

from __future__ import annotations

from tests.engine.test_parity import mixed_prompts
from tidal import LLM, SamplingParams
from tidal.core.request import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL = dict(max_num_batched_tokens=64, num_blocks_override=24, swap_space="2MiB", swap_pool=True)


def _add(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, GREEDY, prompt_token_ids=p)


def _finish(engine, outs, watch=None):
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        if watch is not None:
            watch(engine)
    return outs


def test_switched_to_swap_it_swaps_and_answers_as_one_engine(make_tiny_engine, smol_tokenizer):
    prompts = mixed_prompts(smol_tokenizer)[2:7]
    ref = LLM.from_engine(make_tiny_engine(max_num_batched_tokens=64)).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)
    e = make_tiny_engine(**SMALL)
    assert e.scheduler.preemption_mode == "recompute" and e.kv_manager.host_pool.num_blocks > 0  # the pool is kept
    e.scheduler.preemption_mode = "swap"
    _add(e, prompts)
    swapped = []
    outs = _finish(e, {}, lambda eng: swapped.append(len(eng.scheduler.swapped)))
    assert max(swapped) > 0 and e.scheduler.num_preemptions > 0  # it swapped out, and back in
    assert [outs[f"r{i}"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in ref]
    assert e.kv_manager.num_free_blocks == e.kv_manager.num_blocks and e.kv_manager.host_pool.num_free == \
        e.kv_manager.host_pool.num_blocks


def test_a_drop_with_a_host_pool_recomputes_the_swapped_and_restores_the_mode(make_tiny_engine, smol_tokenizer):
    prompts = mixed_prompts(smol_tokenizer)[2:7]
    ref = LLM.from_engine(make_tiny_engine(max_num_batched_tokens=64)).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)
    e = make_tiny_engine(**dict(SMALL, preemption_mode="swap"))
    _add(e, prompts)
    outs: dict = {}
    while not e.scheduler.swapped:
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    gone = [r.request_id for r in e.scheduler.swapped]
    layers = e.transfer.layer_ids
    e.pool.drop_layers(layers[len(layers) // 2:])
    assert not e.scheduler.swapped and e.scheduler.preemption_mode == "recompute"
    for rid in gone:  # first in the queue, to recompute from their tokens
        r = e.scheduler.requests[rid]
        assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0
    assert e.kv_manager.host_pool.num_free == e.kv_manager.host_pool.num_blocks
    e.pool.restore_layers(layers[len(layers) // 2:])
    assert e.scheduler.preemption_mode == "swap"  # whole again: as configured
    _finish(e, outs)
    # the swapped-out ones recomputed whole: one engine's tokens (those that ran through the drop lost the dropped
    # layers' KV, which a group's exchange carries: tidal.runtime.group; not this test's)
    assert gone and all(outs[rid] == ref[int(rid[1:])].outputs[0].token_ids for rid in gone)
