"""``--kv-pressure migrate`` (the Llumnix-like baseline, KunServe Sec. 2.3) on real worker processes.

Round-robin sends three long prompts to instance 0 and two short ones to instance 1, each with a
pool of 20 blocks: instance 0 can hold one long request at a time, so its queue waits for memory
(throttled) while instance 1 has room. The pure MigrationController moves running requests of
instance 0, with their KV in chunks through shared memory, to instance 1, where they continue
without recompute: every request's greedy tokens equal one engine's with a large pool, the moves
are counted in /admin/state and /metrics, and afterwards every block is free, no reservation is
left on the monitor and no shared-memory segment is left behind."""

from __future__ import annotations

import time

import pytest

from tests.runtime.test_cluster import wait_gone
from tests.runtime.test_kunserve_runtime import _metrics, _serve, shm_segments
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams

ENGINE = dict(dtype="float32", num_blocks_override=20, max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FILLER = "The lighthouse keeper wrote down every ship that passed the point at dusk. "


def _prompts(tokenizer) -> list[list[int]]:
    out = []
    for i in range(5):  # round-robin: 0, 2, 4 (long) to instance 0; 1, 3 (short) to instance 1
        ids = tokenizer.encode(f"Log {i}: " + FILLER * 20)
        out.append(ids[:180] if i % 2 == 0 else ids[:20])
    return out


@pytest.fixture(scope="module")
def reference(make_engine, smol_tokenizer):
    from tidal import LLM

    outs = LLM.from_engine(make_engine(max_num_batched_tokens=64)).generate(
        [{"prompt_token_ids": p} for p in _prompts(smol_tokenizer)], PARAMS)
    return [o.outputs[0].token_ids for o in outs]


def test_a_throttled_instance_migrates_running_requests_with_their_kv(smol_tokenizer, reference):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    before = shm_segments()
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), router="round-robin", threads_per_instance=1,
                      layers_per_chunk=8, kv_pressure="migrate")))
    llm.start()
    pids = [h.pid for h in llm.handles]
    try:
        assert _serve(llm, _prompts(smol_tokenizer), params=PARAMS) == reference
        kp = llm.stats["cluster"]["kv_pressure"]
        assert kp["mode"] == "migrate" and kp["migrated"] >= 1, kp
        moves = [e for e in kp["events"] if e["kind"] == "migrate"]
        assert moves and all(e["instances"] == [0, 1] for e in moves)  # from the throttled one to the spare one
        assert all(e["blocks"] >= 12 for e in moves)  # long requests (180 prompt tokens) moved, whole
        assert _metrics(llm)[("tidal:kv_pressure_events_total", "migrate")] == len(moves) == kp["events_total"]["migrate"]
        assert llm.kv_bytes_moved > 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the last idle reports
            st = llm.stats
            if st["num_free_kv_blocks"] == st["num_kv_blocks"] == 40:
                break
            time.sleep(0.1)
        assert st["num_free_kv_blocks"] == st["num_kv_blocks"] == 40
        assert st["cluster"]["kv_pressure"]["moving"] == 0
        assert all(not r.reserved and not r.outstanding for r in llm.monitor.instances)
    finally:
        llm.shutdown()
    wait_gone(pids)
    assert shm_segments() <= before


def test_serve_migrate_with_one_instance_is_one_line(capsys):
    from tests.runtime.test_kunserve_runtime import _serve_error

    assert "--kv-pressure migrate needs at least 2 instances (got 1): requests migrate to a peer" in \
        _serve_error(capsys, "--kv-pressure", "migrate")
