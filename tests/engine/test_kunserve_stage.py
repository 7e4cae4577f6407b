"""KunServe in the engine: a drop grows the KV pool by exactly the freed bytes (Sec. 4.1), a
restore shrinks it back, and a head + tail pair after a drop (layers [0, L/2) and [L/2, L), the
tail's KV a mirror at the head's block ids, lookahead microbatches of Sec. 4.3) gives the same
greedy tokens as one engine with every layer -- for requests that started before the drop on
either member (KV exchanged, Sec. 4.2, no recompute) and for new ones. The engines run conftest's
random-weight ``tiny_llama`` (4 layers): none of this depends on the weights' values."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend's case runs its kernels on the CPU

from tests.engine.test_parity import mixed_prompts
from tidal import LLM, SamplingParams
from tidal.engine.stage import (
    InProcessLink,
    TailStage,
    eq1_flops,
    microbatch_cost,
    restore_head,
    split_microbatches,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smol_tokenizer):
    return mixed_prompts(smol_tokenizer)


@pytest.fixture(scope="module")
def reference(make_tiny_engine, prompts):
    """Greedy outputs of one engine with every layer and a pool large enough for everything."""
    outs = LLM.from_engine(make_tiny_engine(max_num_batched_tokens=64)).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def _layer_bytes(engine, i):
    return sum(p.numel() * p.element_size() for p in engine.model.layers[str(i)].parameters())


def test_drop_grows_the_pool_by_the_freed_bytes_and_restore_shrinks_it_back(make_tiny_engine):
    e = make_tiny_engine(num_blocks_override=100, block_size=16)
    a = e.arch
    L = a.num_layers
    kv_layer_block = 2 * 16 * a.num_kv_heads * a.head_dim * 4  # K and V of one layer, one block, fp32
    w = _layer_bytes(e, 0)
    assert all(_layer_bytes(e, i) == w for i in range(L))
    dropped = list(range(L // 2, L))
    n = e.drop_layers(dropped)
    # (100 blocks of 30 layers + 15 layers' weights) // (one block of 15 layers)
    expected = (100 * L * kv_layer_block + len(dropped) * w) // ((L - len(dropped)) * kv_layer_block)
    assert n == expected == e.kv_manager.num_blocks and n > 200  # the KV of 15 layers alone doubles it
    assert e.pool_spare_bytes == 100 * L * kv_layer_block + len(dropped) * w - n * (L // 2) * kv_layer_block
    assert e.model.layer_ids == list(range(L // 2)) and sorted(e.kv_cache.layers) == list(range(L // 2))
    assert e.kv_cache.layers[0].k.shape[0] == n
    assert e.model.embed_tokens is not None and e.model.norm is not None  # only decoder layers go
    # a restore that would not fit the blocks in use is refused and changes nothing
    e.kv_manager.allocate("hog", 16 * 150)
    with pytest.raises(ValueError, match="in use"):
        e.restore_layers(dropped)
    assert e.kv_manager.num_blocks == n and e.model.layer_ids == list(range(L // 2))
    e.kv_manager.free("hog")
    assert e.restore_layers(dropped) == 100 and e.pool_spare_bytes == 0
    assert e.model.layer_ids == list(range(L)) and e.kv_cache.layers[L - 1].k.shape[0] == 100
    e.kv_manager.check_invariants()


def test_microbatches_cut_a_prefill_and_keep_decodes_first(smol_ckpt):
    from tidal.core.plan import ScheduledChunk

    cost = eq1_flops(smol_ckpt.arch)
    chunks = [ScheduledChunk("d", (5,), 40, (0, 1, 2), True, GREEDY),
              ScheduledChunk("p", tuple(range(60)), 0, (3, 4, 5, 6), True, GREEDY)]
    mbs = split_microbatches(chunks, cost, min_tokens=4)
    assert len(mbs) == 2
    parts = [c for mb in mbs for c in mb if c.request_id == "p"]
    assert len(parts) == 2 and parts[0].start == 0 and parts[1].start == parts[0].num_tokens
    assert sum(c.num_tokens for c in parts) == 60 and not parts[0].sample and parts[1].sample
    assert mbs[0][0].request_id == "d"  # decodes lead their microbatch


class CountingLink(InProcessLink):
    def __init__(self, tail):
        super().__init__(tail)
        self.sent: list[tuple[int, int]] = []

    def send(self, step_id, index, h, chunks):
        self.sent.append((step_id, index))
        super().send(step_id, index, h, chunks)


def _outputs(engine, done):
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return done


@pytest.mark.parametrize("restore,backend", [(False, "auto"), (True, "auto"), (False, "triton")])
def test_head_tail_pair_after_a_drop_matches_one_engine(make_tiny_engine, prompts, reference, restore, backend):
    """(``triton``: the Triton attention and fused kernels, under Triton's interpreter: a stage's hidden states
    leave with the residual added, the tail's first norm starts afresh.)"""
    if backend == "triton":
        pytest.importorskip("triton")
    head = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=60, attention_backend=backend)
    tail = make_tiny_engine(max_num_batched_tokens=64, num_blocks_override=60, attention_backend=backend)
    L = head.arch.num_layers
    head_layers, tail_layers = list(range(L // 2)), list(range(L // 2, L))
    # before the drop: prompts 0-2 on the head, 3-4 on the tail, each some way into its work
    for i in (0, 1, 2):
        head.add_request(f"r{i}", None, GREEDY, prompt_token_ids=prompts[i])
    for i in (3, 4):
        tail.add_request(f"r{i}", None, GREEDY, prompt_token_ids=prompts[i])
    done: dict[str, list[int]] = {}
    for _ in range(3):
        assert not any(o.finished for o in head.step())
    while not all(len(r.output_token_ids) >= 2 for r in tail.scheduler.requests.values()):
        assert not any(o.finished for o in tail.step())
    started = [r for r in head.scheduler.requests.values() if r.num_computed_tokens]
    assert len(started) == 3 and any(r.output_token_ids for r in started)
    # Sec. 4.2's exchange, export side: the head's requests' KV of the tail's layers ...
    to_tail = {r.request_id: head.export_kv(r.request_id, tail_layers, 0, r.num_computed_tokens) for r in started}
    # ... and the tail's requests, whole (they continue on the head)
    moved = [tail.export_request(f"r{i}") for i in (3, 4)]
    assert all(s.num_computed_tokens > len(prompts[3 + k]) for k, s in enumerate(moved))  # decoding already
    tail.abort_request([s.request_id for s in moved])
    # the drop (Sec. 4.1): both pools grow; the group runs on the smaller count of blocks
    n = min(head.drop_layers(tail_layers), tail.drop_layers(head_layers))
    head.resize_pool(n)
    tail.resize_pool(n)
    assert n > 120 and head.kv_manager.num_blocks == tail.kv_manager.num_blocks == n
    stage = TailStage(tail)
    for rid, kv in to_tail.items():
        stage.import_kv(head.kv_manager.block_table(rid), kv)
    for s in moved:
        head.import_request(dataclasses.replace(s, kv={i: s.kv[i] for i in head_layers}))
        stage.import_kv(head.kv_manager.block_table(s.request_id), {i: s.kv[i] for i in tail_layers})
    link = CountingLink(stage)
    head.set_stage_link(link, eq1_flops(head.arch), min_tokens=4)
    # new requests arrive after the drop
    for i in (5, 6, 7):
        head.add_request(f"r{i}", None, GREEDY, prompt_token_ids=prompts[i])
    if restore:  # Sec. 4.4: some steps as a pair, then the group dissolves with requests in flight
        for _ in range(6):
            for o in head.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        live = [r for r in head.scheduler.requests.values() if r.num_computed_tokens]
        assert live and any(r.output_token_ids for r in live)
        back = {r.request_id: stage.export_kv(head.kv_manager.block_table(r.request_id), r.num_computed_tokens)
                for r in live}
        assert restore_head(head, back) == 60  # the pool of a whole instance again
        assert head.model.layer_ids == list(range(L)) and head.runner.link is None
        assert tail.restore_layers(tail.dropped_weight_bytes) == 60 and tail.model.layer_ids == list(range(L))
    _outputs(head, done)
    assert done == {f"r{i}": reference[i] for i in range(8)}
    assert any(k == 1 for _, k in link.sent), "no step was split into two microbatches"
    assert head.kv_manager.num_free_blocks == head.kv_manager.num_blocks == (60 if restore else n)
    head.kv_manager.check_invariants()


def test_layers_staged_while_serving_restore_to_the_same_weights_and_pool(make_tiny_engine):
    """Sec. 4.4 overlapped: layers loaded one at a time beside the model (never run until put in)
    give back exactly the weights and the pool of a restore that loads them at once."""
    e = make_tiny_engine(num_blocks_override=100, block_size=16)
    L = e.arch.num_layers
    before = {n: p.clone() for n, p in e.model.named_parameters() if n.startswith(f"layers.{L - 1}.")}
    dropped = list(range(L // 2, L))
    e.drop_layers(dropped)
    staged = {i: e.stage_layer(i) for i in dropped}
    assert e.model.layer_ids == list(range(L // 2))  # staged layers are not in the model yet
    with pytest.raises(ValueError, match="not dropped"):
        e.stage_layer(0)
    with pytest.raises(ValueError, match="staged layers"):
        e.restore_layers(dropped, {i: staged[i] for i in dropped[:-1]})
    assert e.restore_layers(dropped, staged) == 100 and e.pool_spare_bytes == 0
    assert e.model.layer_ids == list(range(L))
    after = dict(e.model.named_parameters())
    assert before and all(torch.equal(after[n], p) for n, p in before.items())


def test_a_head_splits_with_profiled_coefficients_when_given_else_flop_ratios(smol_ckpt):
    from tidal.cluster.pressure import ChunkCost

    arch = smol_ckpt.arch
    assert microbatch_cost(arch, None) == (eq1_flops(arch), "FLOP ratios")
    assert microbatch_cost(arch, (1e-9, 2e-6, 3e-4)) == (ChunkCost(1e-9, 2e-6, 3e-4), "profiled")
