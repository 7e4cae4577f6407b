"""The cluster runtime on real worker processes: greedy outputs equal one engine's, colocated and
disaggregated (P/D hand-off of chunked KV through shared memory); a SIGKILLed worker's requests
finish elsewhere with identical tokens, the worker comes back, and nothing leaks."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tidal.cluster.dispatch import ClusterLayout
from tidal.config import ConfigError, EngineConfig
from tidal.core.sampling import SamplingParams

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [f"Item {i}: the list of fruits goes apple, banana," for i in range(16)]


@pytest.fixture(scope="module")
def reference(make_engine):
    """(tokens, text) of every prompt on one engine in one process."""
    from tidal import LLM

    outs = LLM.from_engine(make_engine(**{k: v for k, v in ENGINE.items() if k != "kv_cache_memory"})).generate(
        PROMPTS, PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


def shm_segments() -> set[str]:
    """The KV segments of the clusters this process runs (their front end names them
    tidal-kv-<its pid>-*), whatever other tests on the machine make meanwhile."""
    mine = f"tidal-kv-{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)} if os.path.isdir("/dev/shm") else set()


def start(mode: str, prefill: int = 0, prefill_batching: str | None = None, engine: dict | None = None):
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    engine = engine or ENGINE
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**engine),
        ClusterConfig(layout=ClusterLayout(2, mode, prefill), prefill_batching=prefill_batching,
                      threads_per_instance=1, layers_per_chunk=10, tokens_per_chunk=16)))
    llm.start()
    return llm


def wait_gone(pids, timeout: float = 10.0) -> None:
    """All of these worker processes have exited within ``timeout`` seconds (they stop together)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.1)
            raise AssertionError(f"worker {pid} still running")


def stop(llm) -> None:
    pids = [h.pid for h in llm.handles if h is not None]
    llm.shutdown()
    wait_gone(pids)  # every worker stopped by its own id


async def stream(llm, i: int, on_token=None) -> tuple[list[int], str]:
    toks, text = [], ""
    async for o in llm.generate(PROMPTS[i], PARAMS, f"r{i}"):
        toks += o.outputs[0].delta_token_ids
        text += o.outputs[0].delta_text
        if on_token is not None:
            on_token(i, len(toks))
    return toks, text


def no_leak(llm) -> None:
    st = llm.stats
    assert st["num_free_kv_blocks"] == st["num_kv_blocks"] > 0
    assert st["num_requests_running"] == st["num_requests_waiting"] == 0


def settle(llm, timeout: float = 5.0) -> None:
    """Wait for every live worker's idle report after the last step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = llm.stats
        if st["num_free_kv_blocks"] == st["num_kv_blocks"] and not st["num_requests_running"]:
            return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def colocated():
    before = shm_segments()
    llm = start("colocate")
    yield llm
    stop(llm)
    assert shm_segments() <= before


def test_colocated_greedy_equals_one_engine(colocated, reference):
    async def run():
        return await asyncio.gather(*[stream(colocated, i) for i in range(len(PROMPTS))])

    assert asyncio.run(run()) == reference
    snap = colocated.stats["cluster"]
    assert [r["outstanding"] for r in snap["instances"]] == [0, 0]
    assert snap["num_dispatched"] >= len(PROMPTS) and all(r["alive"] for r in snap["instances"])
    settle(colocated)
    no_leak(colocated)


def test_a_closed_stream_frees_its_blocks_and_a_bad_prompt_is_rejected(colocated):
    from tidal.core.scheduler import RequestRejected

    async def run():
        gen = colocated.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "gone")
        async for o in gen:
            if len(o.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()  # the client went away mid-stream
        with pytest.raises(RequestRejected, match="context length"):
            async for _ in colocated.generate(None, SamplingParams(max_tokens=4), "long",
                                              prompt_token_ids=[1] * 10_000):
                pass

    asyncio.run(run())
    settle(colocated)
    no_leak(colocated)
    assert not colocated.requests


def test_sigkill_of_a_worker_under_16_streams(colocated, reference):
    killed: list[int] = []
    victim = colocated.handles[0].pid

    def on_token(i: int, n: int) -> None:
        if not killed and n >= 3:
            killed.append(victim)
            os.kill(victim, signal.SIGKILL)

    async def run():
        return await asyncio.gather(*[stream(colocated, i, on_token) for i in range(len(PROMPTS))])

    results = asyncio.run(run())
    assert killed == [victim]
    assert results == reference  # every stream completed with full length and the same tokens
    assert colocated.stats["instance_failures"] == 1 and colocated.stats["failovers"] >= 1
    deadline = time.monotonic() + 120  # the worker comes back
    while time.monotonic() < deadline and not all(r.alive for r in colocated.monitor.instances):
        time.sleep(0.5)
    assert all(r.alive for r in colocated.monitor.instances)
    assert colocated.handles[0].pid != victim and colocated.stats["instance_restarts"] == 1
    settle(colocated)
    no_leak(colocated)


def test_disaggregated_greedy_equals_one_engine_and_hands_off_everything(reference):
    """BucketServe's setup (Sec. III): length buckets on the prefill instance (with its own
    --policy-arg), continuous batching on the decode instance."""
    before = shm_segments()
    llm = start("disaggregate", prefill=1, prefill_batching="bucket",
                engine={**ENGINE, "policy_args": ["bucket.theta=0.4"]})
    try:
        async def run():
            return await asyncio.gather(*[stream(llm, i) for i in range(len(PROMPTS))])

        assert asyncio.run(run()) == reference
        snap = llm.stats["cluster"]
        assert snap["num_handoffs"] == len(PROMPTS) and snap["pending_handoffs"] == 0
        assert [(r["role"], r["batching"]) for r in snap["instances"]] == [("prefill", "bucket"),
                                                                            ("decode", "continuous")]
        settle(llm)
        no_leak(llm)
    finally:
        stop(llm)
    assert shm_segments() <= before


def test_distserve_as_it_behaves_greedy_equals_one_engine(reference):
    """The DistServe baseline on real workers (tidal reproduce bucketserve's): P/D with strict FCFS
    whole prefills (prefill-first), padded batches of prompts (the padding computed and thrown
    away) and swap-out on decode overflow; every request handed off, outputs equal one engine's."""
    llm = start("disaggregate", prefill=1, engine={**ENGINE, "max_num_batched_tokens": 512, "scheduling": "prefill-first",
                                                  "pad_prefill": True, "preemption_mode": "swap"})
    try:
        async def run():
            return await asyncio.gather(*[stream(llm, i) for i in range(len(PROMPTS))])

        assert asyncio.run(run()) == reference
        assert llm.stats["cluster"]["num_handoffs"] == len(PROMPTS)
        settle(llm)
        no_leak(llm)
    finally:
        stop(llm)


def test_ray_backend_greedy_equals_one_engine(reference):
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    import ray

    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**ENGINE),
        ClusterConfig(layout=ClusterLayout(2), backend="ray", threads_per_instance=1)))
    try:
        llm.start()

        async def run():
            return await asyncio.gather(*[stream(llm, i) for i in range(len(PROMPTS))])

        assert asyncio.run(run()) == reference
        assert all(r["alive"] for r in llm.stats["cluster"]["instances"])
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the local Ray tidal started is stopped with it


class _FakeRay:
    """What RayBackend asks a joined Ray cluster: its node address and its live nodes."""

    def __init__(self, nodes):
        self._nodes = nodes
        self.util = type("util", (), {"get_node_ip_address": staticmethod(lambda: "10.1.2.3")})

    def nodes(self):
        return [{"NodeManagerAddress": a, "Alive": True} for a in self._nodes]


def test_a_joined_ray_cluster_listens_on_the_node_address_and_needs_ray_kv_across_machines(monkeypatch):
    from tidal.runtime.backend import RayBackend
    from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

    backend = object.__new__(RayBackend)
    backend.ray, backend.started_here = _FakeRay(["10.1.2.3", "10.1.2.4"]), False
    assert backend.control_host == "10.1.2.3" and not backend.single_machine  # actors elsewhere can reach it
    backend.started_here = True
    assert backend.control_host == "127.0.0.1" and backend.single_machine
    backend.started_here = False
    backend.ray = _FakeRay(["10.1.2.3"])
    assert backend.single_machine

    shut = []
    multi = object.__new__(RayBackend)
    multi.ray, multi.started_here = _FakeRay(["10.1.2.3", "10.1.2.4"]), False
    monkeypatch.setattr(RayBackend, "shutdown", lambda self: shut.append(self))
    monkeypatch.setattr(ClusterLLM, "_make_backend", lambda self: multi)
    with pytest.raises(ConfigError, match="use --kv-transport ray"):
        ClusterLLM(ServingConfig(
            EngineConfig.from_kwargs(**ENGINE),
            ClusterConfig(layout=ClusterLayout(2), backend="ray", transport="shm")))
    assert shut == [multi]
    with pytest.raises(ConfigError, match="pipeline group's members over sockets of one machine"):
        ClusterLLM(ServingConfig(
            EngineConfig.from_kwargs(**ENGINE),
            ClusterConfig(layout=ClusterLayout(2), backend="ray", transport="ray", kv_pressure="drop")))
    assert shut == [multi, multi]


FRONT_END = """
import os, sys, time
from tidal.cluster.dispatch import ClusterLayout
from tidal.config import EngineConfig
from tidal.runtime.cluster import ClusterConfig, ClusterLLM, ServingConfig

if __name__ == "__main__":
    kw = dict(dtype="float32", num_blocks_override=10)
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**kw),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), threads_per_instance=1)))
    llm.start()
    print("ready", *[h.pid for h in llm.handles], flush=True)
    time.sleep(300)
"""


def _process_tree() -> dict[int, list[int]]:
    """Every process's children, read from /proc."""
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(p))
    return children


def _descendants(tree: dict[int, list[int]], pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_a_sigkilled_front_end_takes_its_forkserver_and_workers_with_it(tmp_path):
    """The workers are forked from a forkserver (the front end's child): killing the front end by
    SIGKILL (no cleanup runs) kills the forkserver, and each worker with it -- no orphan."""
    import subprocess
    import sys

    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        workers = {int(p) for p in line[1:]}
        tree = _process_tree()
        family = _descendants(tree, proc.pid)
        assert len(workers) == 2 and workers < family and not workers & set(tree[proc.pid])
        forkservers = [c for c in tree[proc.pid] if workers <= set(tree.get(c, []))]
        assert len(forkservers) == 1  # both workers are the children of one child of the front end
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    wait_gone(family)


def test_a_worker_that_cannot_start_fails_the_start_with_its_reason_not_a_restart_loop():
    """A worker whose engine cannot be built (a KV budget too small for one block: the workers
    build the pools, the front end does not) dies before it is ready. After START_ATTEMPTS such
    deaths in a row it is not restarted, and start() fails at once, naming it, with nothing left
    running (it used to be restarted until the 600 s start timeout, ~11 times a second)."""
    from tidal.engine.async_engine import EngineDeadError
    from tidal.runtime.cluster import START_ATTEMPTS, ClusterConfig, ClusterLLM, ServingConfig

    kw = dict(dtype="float32", kv_cache_memory="1KiB")
    llm = ClusterLLM(ServingConfig(
        EngineConfig.from_kwargs(**kw),
        ClusterConfig(layout=ClusterLayout(2, "colocate", 0), threads_per_instance=1)))
    seen: list[int] = []
    start = llm.backend.start

    def counted(cfg):
        h = start(cfg)
        seen.append(h.pid)
        return h

    llm.backend.start = counted
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"died {START_ATTEMPTS} times before it was ready"):
        llm.start()
    assert time.monotonic() - t0 < 120
    assert len(seen) <= 2 * START_ATTEMPTS
    assert max(llm.unready_deaths) == START_ATTEMPTS
    wait_gone(set(seen))


def test_stop_unlinks_the_chunks_no_receiver_read():
    """A chunk whose receiver died before reading it (a group's exchange, a worker that failed
    mid-move) is known to no live process: the cluster's stop unlinks every segment left in its
    own name space, and only those (another cluster's, here a transport of this test's, stay)."""
    import torch

    from tidal.cluster.handoff import ChunkSpec
    from tidal.runtime.kv_transfer import SharedMemoryTransport

    llm = start("colocate")
    other = SharedMemoryTransport(f"tidal-kv-{os.getpid()}-other")
    kv = {0: (torch.ones(4, 2, 8), torch.ones(4, 2, 8))}
    try:
        orphan = llm.transport.put(kv, ChunkSpec((0,), 0, 4))
        theirs = other.put(kv, ChunkSpec((0,), 0, 4))
        assert {orphan.ref, theirs.ref} <= shm_segments()
    finally:
        stop(llm)
    assert orphan.ref not in shm_segments() and theirs.ref in shm_segments()
    other.release(theirs)
