"""DynaServe's micro-requests on real worker processes (``--mode split``): for each request the
planner names a pair (alpha, beta) and a split point; alpha computes the first ``s`` tokens of KV
and streams it through shared memory while it computes, beta holds a reservation and continues.
Greedy outputs equal one engine's for splits at every kind of position, also when the output
outgrows the predicted length; the KV moved is counted; nothing leaks.

The split positions here are chosen by a fixed test planner, so every kind of position is
exercised; the real planner (DynaServe Alg. 1) is tested on its own in tests/cluster."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest

from tests.runtime import test_cluster as tc
from tests.runtime.test_cluster import ENGINE, PARAMS, PROMPTS, no_leak, settle, shm_segments, stop, stream
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import ConfigError, EngineConfig

reference = tc.reference  # the same fixture: one engine's tokens and text for PROMPTS

KINDS = ("whole-on-beta", "inside-prompt", "prompt-end", "inside-output", "beyond-prediction", "whole-on-alpha")
PREDICTED = 3  # the test planner's output-length guess; the requests produce PARAMS.max_tokens = 12


@dataclass(frozen=True)
class _Decision:
    request_id: str
    pair: tuple[int, int]
    prompt_len: int
    predicted_output: int
    split: int
    alpha: object
    beta: object


class FixedSplits:
    """Splits request ``r{i}`` at the position of kind ``KINDS[i % len(KINDS)]``; records the
    ledger calls the front end makes."""

    def __init__(self):
        self.calls: list[tuple] = []

    def plan(self, request_id, prompt_len, max_tokens, pair, now, candidates, cached=None):
        from tidal.cluster.split import split_parts

        kind = KINDS[int(request_id[1:]) % len(KINDS)]
        p, predicted = prompt_len, PREDICTED
        s = {"whole-on-beta": 0, "inside-prompt": p // 2, "prompt-end": p, "inside-output": p + 1,
             "beyond-prediction": p + predicted - 2, "whole-on-alpha": p + predicted - 1}[kind]
        self.calls.append(("plan", request_id, candidates))
        return _Decision(request_id, candidates[0], p, predicted, s, *split_parts(p, predicted, s, request_id))

    def on_progress(self, instance, request_id, decoded=None, prefill_done=None):
        self.calls.append(("progress", request_id, instance, decoded))

    def on_handoff(self, request_id):
        self.calls.append(("handoff", request_id))

    def on_finish(self, request_id, output_len):
        self.calls.append(("finish", request_id, output_len))

    def on_failure(self, instance):
        self.calls.append(("failure", instance))

    def on_restart(self, instance):
        self.calls.append(("restart", instance))


@pytest.fixture(scope="module")
def split_cluster():
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    before = shm_segments()
    planner = FixedSplits()
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2, "split"), threads_per_instance=1, layers_per_chunk=10,
                      tokens_per_chunk=16)), splitter=planner)
    llm.start()
    yield llm, planner
    stop(llm)
    assert shm_segments() <= before


def test_split_at_every_kind_of_position_equals_one_engine(split_cluster, reference):
    llm, planner = split_cluster

    async def run():
        return await asyncio.gather(*[stream(llm, i) for i in range(len(PROMPTS))])

    assert asyncio.run(run()) == reference
    by_rid = {e["request_id"]: e for e in llm.splits}
    for i in range(len(PROMPTS)):
        kind, e = KINDS[i % len(KINDS)], by_rid[f"r{i}"]
        if kind.startswith("whole"):
            assert e["whole_on"] == (1 if kind == "whole-on-beta" else 0) and e["kv_bytes"] == 0
        else:  # the KV of [0, s) moved: every layer's K and V for s tokens
            assert e["whole_on"] is None
            assert e["kv_bytes"] == kv_bytes_per_token(llm) * e["split"], (kind, e)
    n_split = sum(not KINDS[i % len(KINDS)].startswith("whole") for i in range(len(PROMPTS)))
    st = llm.stats
    assert st["splits"] == n_split and st["failovers"] == 0
    # alpha's hand-off ended each split request's alpha part; every request finished, with 12 tokens
    handoffs = {c[1] for c in planner.calls if c[0] == "handoff"}
    assert handoffs == {f"r{i}" for i in range(len(PROMPTS)) if not KINDS[i % len(KINDS)].startswith("whole")}
    assert sorted(c[1:] for c in planner.calls if c[0] == "finish") == sorted(
        (f"r{i}", PARAMS.max_tokens) for i in range(len(PROMPTS)))
    # each part's progress reaches the planner as its totals (what on_progress takes, as the simulator sends):
    # 1, 2, 3... per request and instance, the instances' last totals adding up to the request's tokens
    totals: dict[tuple[str, int], list[int]] = {}
    for c in planner.calls:
        if c[0] == "progress":
            totals.setdefault((c[1], c[2]), []).append(c[3])
    assert all(v == sorted(set(v)) and v[0] >= 1 for v in totals.values())
    for i in range(len(PROMPTS)):
        assert sum(v[-1] for (rid, _), v in totals.items() if rid == f"r{i}") == PARAMS.max_tokens
    settle(llm)
    no_leak(llm)
    assert all(not r["reserved_blocks"] for r in st["cluster"]["instances"])


def kv_bytes_per_token(llm) -> int:
    a = llm.engine.arch
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4  # K and V, float32


def test_split_mode_needs_pairs():
    with pytest.raises(ConfigError, match="even number"):
        ClusterLayout(3, "split")
    with pytest.raises(ConfigError, match="even number"):
        ClusterLayout(1, "split")
    assert ClusterLayout(4, "split").pairs() == [(0, 1), (2, 3)]


def test_sigkill_of_beta_under_16_split_streams(split_cluster, reference):
    """Beta dies while it holds reservations, receives KV and decodes landed parts: every stream
    completes with one engine's tokens (re-run whole on alpha, the only live instance), beta comes
    back, and neither instance keeps a block or a reservation."""
    import os
    import signal
    import time

    llm, _ = split_cluster
    killed: list[int] = []
    victim = llm.handles[1].pid
    failures = llm.stats["instance_failures"]

    def on_token(i: int, n: int) -> None:
        if not killed and n >= 2:
            killed.append(victim)
            os.kill(victim, signal.SIGKILL)

    async def run():
        return await asyncio.gather(*[stream(llm, i, on_token) for i in range(len(PROMPTS))])

    assert asyncio.run(run()) == reference
    assert killed == [victim] and llm.stats["instance_failures"] == failures + 1
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(r.alive for r in llm.monitor.instances):
        time.sleep(0.5)
    assert all(r.alive for r in llm.monitor.instances) and llm.handles[1].pid != victim
    settle(llm)
    no_leak(llm)
    assert all(not r["reserved_blocks"] for r in llm.stats["cluster"]["instances"])


def test_aborts_while_kv_chunks_are_in_flight_leave_beta_serving(split_cluster, reference):
    """Clients that give up mid-split (the load client's time limit, a disconnect): the front end
    releases the request's chunks while their ``kv`` messages may still be queued at beta. Beta
    drops such an import instead of failing on the missing chunk: no instance fails, nothing is
    left in use, and the next requests still get one engine's tokens."""
    llm, _ = split_cluster
    failures = llm.stats["instance_failures"]
    before = shm_segments()

    from tidal.core.sampling import SamplingParams

    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # keeps both instances stepping

    async def give_up(k: int, i: int) -> None:
        async def consume():
            async for o in llm.generate(PROMPTS[i] * (1 + k % 4), long, f"r{k}"):
                if o.outputs[0].token_ids and k % 3 == 0:
                    return  # after its first token (closing the stream aborts the request)

        with contextlib.suppress(TimeoutError):  # or a little later
            await asyncio.wait_for(consume(), timeout=0.05 * (k % 9) + 0.05)

    async def run():
        for rnd in range(3):
            await asyncio.gather(*[give_up(100 + 16 * rnd + i, i) for i in range(len(PROMPTS))])
        return await asyncio.gather(*[stream(llm, i) for i in range(len(PROMPTS))])

    assert asyncio.run(run()) == reference
    settle(llm)
    no_leak(llm)
    assert llm.stats["instance_failures"] == failures
    assert all(not r["reserved_blocks"] for r in llm.stats["cluster"]["instances"])
    assert shm_segments() <= before
