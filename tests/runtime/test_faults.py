"""A worker killed under streams, in every mode, on Ray actors (and P/D on processes): every stream
finishes with one engine's greedy tokens, and a new request sent at any moment of the outage is
answered or refused as retryable (``InstanceUnavailableError``: the server's 503 with
``Retry-After``), never an internal error. P/D degrades to colocated while a role is down: with
its prefill instance dead the decode instance serves new requests whole, with its decode instance
dead the prefill instance decodes what it prefills. Nothing is left behind: KV blocks, processes.

A random-weight 4-layer Llama keeps each actor's start and restart short; one Ray session serves
every mode's cluster."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from tests.processes import alive
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig
from tidal.core.sampling import SamplingParams
from tidal.engine.async_engine import InstanceUnavailableError

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
N = 8
LAYOUTS = {  # mode: (layout, --kv-pressure, KV blocks per instance)
    "colocate": (ClusterLayout(2), "preempt", None),
    "disaggregate": (ClusterLayout(2, "disaggregate", 1), "preempt", None),
    "split": (ClusterLayout(2, "split"), "preempt", None),
    "drop": (ClusterLayout(2), "drop", 24),
    "migrate": (ClusterLayout(2), "migrate", 24),
}


def _prompts(seed: int, n: int = N) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(20 + 9 * (i % 5))] for i in range(n)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tiny_llama, smol_tokenizer):
    import shutil

    path = tmp_path_factory.mktemp("tiny-faults")
    shutil.copytree(tiny_llama.path, path, dirs_exist_ok=True)
    smol_tokenizer.hf.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(make_tiny_engine):
    """Each prompt's greedy tokens on one engine, and the outage's short requests'."""
    from tidal import LLM

    llm = LLM.from_engine(make_tiny_engine(kv_cache_memory="64MiB"))
    ref = {}
    for seed, params in ((0, PARAMS), (1, SHORT)):
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(seed, 64 if seed else N)], params)
        ref.update({(seed, i): o.outputs[0].token_ids for i, o in enumerate(outs)})
    return ref


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _start(model: str, mode: str, backend: str):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    layout, pressure, blocks = LAYOUTS[mode]
    engine = EngineConfig.from_kwargs(model=model, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64,
                                      num_blocks_override=blocks)
    llm = ClusterLLM(ServingConfig(engine, ClusterConfig(layout=layout, backend=backend, threads_per_instance=1,
                                                         transport="ray" if backend == "ray" else "shm",
                                                         kv_pressure=pressure, layers_per_chunk=2,
                                                         tokens_per_chunk=16)))
    llm.start()
    return llm


async def _stream(llm, ids: list[int], rid: str, params: SamplingParams, on_token=None) -> list[int]:
    toks: list[int] = []
    async for o in llm.generate(None, params, rid, prompt_token_ids=ids):
        toks += o.outputs[0].delta_token_ids
        if on_token is not None:
            on_token(len(toks))
    return toks


async def _outage(llm, victim: int, pid: int, tag: str, out: dict) -> None:
    """New short requests every 50 ms from the kill until ``victim`` is back: each one is answered
    (its tokens kept) or refused as retryable; anything else is raised."""
    k = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        i = k % 64
        try:
            out[(i, f"{tag}{k}")] = await _stream(llm, _prompts(1, 64)[i], f"{tag}{k}", SHORT)
        except InstanceUnavailableError:
            out[(i, f"{tag}{k}")] = None
        k += 1
        rec = llm.monitor.instances[victim]
        if rec.alive and llm.pids[victim] not in (None, pid):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"instance {victim} was not back within 120 s")


def _kill_under_streams(llm, victim: int, tag: str) -> tuple[list[list[int]], dict]:
    """N streams; ``victim``'s worker SIGKILLed once they have some tokens, new requests meanwhile."""
    pid = llm.pids[victim]
    assert pid and llm.hosts[victim]
    outage: dict = {}

    async def run():
        killed = asyncio.Event()

        def on_token(n: int) -> None:
            if n >= 3 and not killed.is_set():
                killed.set()
                os.kill(pid, signal.SIGKILL)

        streams = [asyncio.create_task(_stream(llm, p, f"{tag}-r{i}", PARAMS, on_token))
                   for i, p in enumerate(_prompts(0))]
        await killed.wait()
        await _outage(llm, victim, pid, f"{tag}-new", outage)
        return await asyncio.gather(*streams)

    return asyncio.run(run()), outage


def _settle(llm, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = llm.stats
        if st["num_free_kv_blocks"] == st["num_kv_blocks"] and not st["num_requests_running"] \
                and not st["num_requests_waiting"] and not llm.requests:
            return
        time.sleep(0.1)
    st = llm.stats
    raise AssertionError(f"not idle: {st['num_kv_blocks'] - st['num_free_kv_blocks']} blocks in use, "
                         f"{len(llm.requests)} requests tracked")


def _check(llm, results, outage, reference, failures: int) -> None:
    assert results == [reference[(0, i)] for i in range(N)]  # every stream finished, tokens as one engine's
    answered = {rid: toks for (i, rid), toks in outage.items() if toks is not None}
    assert outage and all(toks == reference[(1, i)] for (i, rid), toks in outage.items() if toks is not None)
    assert answered, "no request was answered during the outage: the survivor served none"
    assert llm.stats["instance_failures"] == failures and llm.stats["instance_restarts"] == failures
    _settle(llm)


def _stop(llm) -> None:
    pids = [p for p in llm.pids if p]
    llm.shutdown()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a worker outlived its cluster"


def _both_roles_down_in_turn(llm, reference, tag: str) -> None:
    """P/D: the prefill instance killed (the decode one serves whole), then the decode one (the
    prefill one decodes what it prefills)."""
    results, outage = _kill_under_streams(llm, 0, f"{tag}p")
    _check(llm, results, outage, reference, 1)
    assert llm.monitor.num_handoffs >= 1
    results, outage = _kill_under_streams(llm, 1, f"{tag}d")
    _check(llm, results, outage, reference, 2)
    assert not llm.monitor.pending_handoffs


def test_pd_on_processes_degrades_to_colocated_while_a_role_is_down(tiny_model, reference):
    llm = _start(tiny_model, "disaggregate", "process")
    try:
        _both_roles_down_in_turn(llm, reference, "pp")
    finally:
        _stop(llm)


@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_a_killed_ray_actor_loses_no_request_in_any_mode(ray_session, tiny_model, reference, mode, capfd):
    llm = _start(tiny_model, mode, "ray")
    try:
        # the actors' start-up lines reach the front end's stderr (Ray keeps their own output in its logs)
        err = capfd.readouterr().err
        for i in (0, 1):
            assert f"worker {i} engine: loading the weights of" in err and f"worker {i} engine: weights loaded" in err
        if mode == "disaggregate":
            _both_roles_down_in_turn(llm, reference, "rp")
        else:
            results, outage = _kill_under_streams(llm, 1, f"r{mode}")
            _check(llm, results, outage, reference, 1)
    finally:
        _stop(llm)
