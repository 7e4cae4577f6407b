"""A worker's paused imports (DynaServe's beta part, a P/D hand-off) hold blocks only for the KV
that has landed: each arriving chunk grows the request's blocks; a chunk with no room waits (and
so does the rest of that request's hand-off) until a step frees blocks; when nothing on the
instance can ever free any, the youngest waiting import is given back (``refused``) instead of
waiting forever. Driven command by command on one in-process worker, so every step is exact."""

from __future__ import annotations

import pytest

from tests.runtime.test_cluster import ENGINE
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams
from tidal.runtime.kv_transfer import plan_chunks
from tidal.runtime.protocol import Finish, KVChunk, Landed, Refused, Reserve, decode_reply

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 16  # the engine's default block size


@pytest.fixture()
def worker(tmp_path):
    import zmq

    from tidal.runtime.worker import Worker, WorkerConfig

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)  # what the worker says
    out_addr = f"ipc://{tmp_path}/out"
    inbox.bind(out_addr)
    w = Worker(WorkerConfig(0, "colocated", EngineConfig.from_kwargs(**ENGINE, num_threads=1), f"ipc://{tmp_path}/cmd",
                            out_addr, layers_per_chunk=30, tokens_per_chunk=BS))

    def said() -> list:
        msgs = []
        while inbox.poll(200):
            msgs.append(decode_reply(inbox.recv())[2])
        return msgs

    yield w, said
    w.close()
    inbox.close(0)
    ctx.term()


def _chunks(worker, prompt, s):
    """The KV of a request's first ``s`` tokens as an alpha part streams it: (handle, last) with
    ``last`` False (a beta part resumes with ``finish``, not with its last chunk)."""
    from tidal.engine.llm_engine import LLMEngine

    alpha = LLMEngine.from_kwargs(**ENGINE)
    alpha.add_request("a", None, PARAMS, prompt_token_ids=prompt, pause_at=s)
    while not alpha.scheduler.drain_reached_pause():
        alpha.step()
    specs = plan_chunks(alpha.model.layer_ids, 0, s, 30, BS)
    out = [(worker.transport.put(alpha.export_kv("a", list(sp.layers), sp.start, sp.end), sp), False)
           for sp in specs]
    return out, list(alpha.scheduler.requests["a"].output_token_ids), alpha.scheduler.requests["a"].last_token_time


def test_an_import_grows_chunk_by_chunk_then_lands(worker, smol_tokenizer):
    w, said = worker
    kv = w.engine.kv_manager
    prompt = smol_tokenizer.encode("The tides rise and fall twice a day because the moon pulls the sea. " * 2)
    s = len(prompt) + 2  # inside the output: alpha sampled 3 tokens
    chunks, tokens, last_time = _chunks(w, prompt, s)
    assert len(chunks) >= 3
    w.handle(Reserve("r", prompt, PARAMS, 0, "online", s))
    assert kv.num_blocks_of("r") == 0 and said() == []
    for handle, last in chunks[:-1]:
        w.handle(KVChunk("r", handle, last))
        assert kv.num_blocks_of("r") == -(-handle.spec.end // BS)  # blocks for what has landed, no more
    w.handle(KVChunk("r", *chunks[-1]))
    assert kv.num_blocks_of("r") == -(-s // BS)
    assert "r" in w.engine.scheduler.paused  # all KV here, still waiting for alpha's tokens
    w.handle(Finish("r", tokens, 0, last_time))
    assert said() == [Landed("r")]
    assert w.engine.scheduler.requests["r"].last_token_time == last_time
    while w.engine.has_unfinished_requests():
        w.engine.step()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_chunk_without_room_waits_and_a_stuck_import_is_refused(worker, smol_tokenizer):
    w, said = worker
    kv = w.engine.kv_manager
    prompt = smol_tokenizer.encode("Why are there two high tides a day? " * 4)
    s = len(prompt)
    chunks, tokens, last_time = _chunks(w, prompt, s)
    assert len(chunks) >= 3
    w.handle(Reserve("r", prompt, PARAMS, 0, "online", s))
    w.handle(KVChunk("r", *chunks[0]))
    held = kv.num_blocks_of("r")
    assert held == 1
    assert kv.allocate("hog", kv.num_free_blocks * BS) is not None  # someone else holds every free block
    for c in chunks[1:]:
        w.handle(KVChunk("r", *c))
    w.handle(Finish("r", tokens, 0, last_time))
    assert kv.num_blocks_of("r") == held and len(w.waiting_kv["r"]) == len(chunks)  # all wait, in order
    kv.free("hog")
    w.land_arrived()  # what the worker does after a step that freed blocks
    assert said() == [Landed("r")] and not w.waiting_kv
    w.engine.abort_request("r")

    # nothing on the instance can free blocks (no request runs or waits): give the import back
    chunks, tokens, last_time = _chunks(w, prompt, s)
    w.handle(Reserve("q", prompt, PARAMS, 0, "online", s))
    w.handle(KVChunk("q", *chunks[0]))
    assert kv.allocate("hog", kv.num_free_blocks * BS) is not None
    w.handle(KVChunk("q", *chunks[1]))
    assert "q" in w.waiting_kv and not w.engine.has_runnable_requests()
    w.refuse_stuck_import()
    assert said() == [Refused("q", "no room in the KV cache for the rest of its KV")]
    assert not w.waiting_kv and "q" not in w.importing and kv.num_blocks_of("q") == 0
    w.handle(KVChunk("q", *chunks[2]))  # late chunks of a refused import are not ours
    assert "q" not in w.waiting_kv
    for handle, _ in chunks[1:]:
        w.transport.release(handle)  # the front end's job for a refused import
    kv.free("hog")
    assert kv.num_free_blocks == kv.num_blocks


def test_an_import_whose_kv_is_gone_is_refused_as_lost(worker, smol_tokenizer):
    """A chunk that cannot be read (its owner released it, or died) gives the import back at once,
    saying its KV is lost, so that the front end recomputes the request instead of retrying the
    same chunks (or the worker waiting for them for ever)."""
    w, said = worker
    prompt = smol_tokenizer.encode("Why are there two high tides a day? " * 2)
    s = len(prompt)
    chunks, _, _ = _chunks(w, prompt, s)
    w.handle(Reserve("r", prompt, PARAMS, 0, "online", s))
    w.handle(KVChunk("r", *chunks[0]))
    gone = chunks[1][0]
    w.transport.release(gone)
    w.handle(KVChunk("r", *chunks[1]))
    [refused] = said()
    assert refused.request_id == "r" and refused.kv_lost and gone.ref in refused.reason
    assert "r" not in w.importing and not w.waiting_kv and w.engine.kv_manager.num_blocks_of("r") == 0
    for handle, _ in chunks[2:]:
        w.transport.release(handle)
