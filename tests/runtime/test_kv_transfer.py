"""KV transfer between instances: chunk planning, the shared-memory and Ray transports, exact
block-level moves between two paged KV caches, and a request migrated mid-decode that continues
with the same tokens."""

from __future__ import annotations

import glob
import math
import multiprocessing
import os
import secrets
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.config import ModelArch
from tidal.engine.kv_cache import PagedKVCache
from tidal.runtime.kv_transfer import (
    ChunkSpec,
    KVHandle,
    RayTransport,
    SharedMemoryTransport,
    build_transport,
    chunk_of,
    iter_chunks,
    plan_chunks,
)

# every segment these tests make starts with this, so leftovers are ours (other work may share /dev/shm)
PREFIX = f"tidal-kv-test{secrets.token_hex(4)}"
HEADS, DIM = 2, 4
RAY_SKIP = "Ray is not installed (pip install -e '.[ray]'); the Ray transport is not tested"


def leftovers(prefix: str = PREFIX) -> list[str]:
    return glob.glob(f"/dev/shm/{prefix}*")


def rand_kv(layers, tokens: int, dtype=torch.float32, heads: int = HEADS, dim: int = DIM, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {i: (torch.randn(tokens, heads, dim, generator=g).to(dtype),
                torch.randn(tokens, heads, dim, generator=g).to(dtype)) for i in layers}


def assert_kv_equal(a, b) -> None:
    assert list(a) == list(b)
    for i in a:
        for x, y in zip(a[i], b[i], strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), f"layer {i} differs"


@pytest.fixture(autouse=True)
def no_segment_left():
    yield
    left = leftovers()
    for path in left:  # clean up, then fail: one leaky test must not fail the others
        os.unlink(path)
    assert not left, f"shared-memory segments left behind: {left}"


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray", reason=RAY_SKIP)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(params=["shm", "ray"])
def transport(request):
    if request.param == "ray":
        request.getfixturevalue("ray_local")
        return RayTransport()
    return SharedMemoryTransport(prefix=PREFIX)


# ============================================================================ plan_chunks
def covered(chunks: list[ChunkSpec]) -> list[tuple[int, int]]:
    return [(layer, t) for c in chunks for layer in c.layers for t in range(c.start, c.end)]


@pytest.mark.parametrize("layers,start,end,lpc,tpc,expected", [
    # layer groups outer, token ranges inner; the last group / range is shorter
    ([0, 1, 2, 3, 4], 3, 10, 2, 3, [((0, 1), 3, 6), ((0, 1), 6, 9), ((0, 1), 9, 10),
                                    ((2, 3), 3, 6), ((2, 3), 6, 9), ((2, 3), 9, 10),
                                    ((4,), 3, 6), ((4,), 6, 9), ((4,), 9, 10)]),
    ([7], 0, 1, None, None, [((7,), 0, 1)]),  # one layer, one token
    ([7], 4, 5, 3, 8, [((7,), 4, 5)]),  # sizes larger than what there is
    ([0, 1, 2], 0, 4, None, None, [((0, 1, 2), 0, 4)]),  # None: everything in one chunk
    ([0, 1, 2], 0, 4, 0, 0, [((0, 1, 2), 0, 4)]),  # 0 means the same
    ([0, 1, 2], 0, 4, 1, 1, [((i,), t, t + 1) for i in range(3) for t in range(4)]),
    ([5, 2, 9], 0, 2, 2, None, [((5, 2), 0, 2), ((9,), 0, 2)]),  # the caller's layer order is kept
    ([0, 1], 6, 6, 1, 1, []),  # no tokens
    ([], 0, 8, 2, 2, []),  # no layers
])
def test_plan_chunks_cases(layers, start, end, lpc, tpc, expected):
    assert plan_chunks(layers, start, end, lpc, tpc) == [ChunkSpec(*e) for e in expected]


@settings(max_examples=200, deadline=None)
@given(n_layers=st.integers(0, 12), start=st.integers(0, 50), n_tokens=st.integers(0, 70),
       lpc=st.none() | st.integers(0, 14), tpc=st.none() | st.integers(0, 80))
def test_plan_chunks_cover_exactly_once_in_order(n_layers, start, n_tokens, lpc, tpc):
    layers = list(range(n_layers))
    end = start + n_tokens
    chunks = plan_chunks(layers, start, end, lpc, tpc)
    cells = covered(chunks)
    assert sorted(cells) == [(la, t) for la in layers for t in range(start, end)]
    assert len(cells) == len(set(cells))  # no overlap
    assert all(c.start < c.end and c.layers for c in chunks)  # no empty chunk
    # layer groups outer (consecutive, in the given order), token ranges inner (ascending, adjacent)
    groups = []
    for c in chunks:
        if not groups or groups[-1][0] != c.layers:
            groups.append((c.layers, []))
        groups[-1][1].append((c.start, c.end))
    assert [la for g, _ in groups for la in g] == (layers if n_tokens else [])
    for g, ranges in groups:
        assert len(g) == (lpc or n_layers) or g == groups[-1][0]
        assert ranges[0][0] == start and ranges[-1][1] == end
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(e - s == (tpc or n_tokens) for s, e in ranges[:-1])
    if layers and n_tokens:
        assert len(chunks) == math.ceil(n_layers / (lpc or n_layers)) * math.ceil(n_tokens / (tpc or n_tokens))


def test_iter_chunks_cuts_the_right_slices():
    kv = rand_kv([0, 1, 2], 10)
    got = list(iter_chunks(kv, 20, 30, layers_per_chunk=2, tokens_per_chunk=4))
    assert [s for s, _ in got] == plan_chunks([0, 1, 2], 20, 30, 2, 4)
    for spec, part in got:
        assert list(part) == list(spec.layers)
        for i in spec.layers:
            assert torch.equal(part[i][0], kv[i][0][spec.start - 20:spec.end - 20])
            assert torch.equal(part[i][1], kv[i][1][spec.start - 20:spec.end - 20])
    assert_kv_equal(chunk_of(kv, ChunkSpec((2,), 25, 26), 20), {2: (kv[2][0][5:6], kv[2][1][5:6])})


# ============================================================================ both transports
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(transport, dtype):
    kv = rand_kv([3, 4, 5], 17, dtype)
    spec = ChunkSpec((3, 4, 5), 100, 117)
    h = transport.put(kv, spec)
    assert isinstance(h, KVHandle) and h.transport == transport.name
    assert h.spec == spec and h.shape == (17, HEADS, DIM) and h.dtype == str(dtype).removeprefix("torch.")
    assert h.nbytes == 2 * 3 * 17 * HEADS * DIM * dtype.itemsize
    got = transport.get(h)
    assert_kv_equal(got, kv)
    assert_kv_equal(transport.get(h), kv)  # a get does not consume the chunk
    transport.release(h)
    transport.release(h)  # twice is harmless


def test_round_trip_of_strided_tensors_and_one_token(transport):
    base = rand_kv([0, 1], 12)
    # views with gaps (every other token; a transposed copy back): put copies what they show
    kv = {i: (k[::2], v.transpose(0, 1).contiguous().transpose(0, 1)[::2]) for i, (k, v) in base.items()}
    h = transport.put(kv, ChunkSpec((0, 1), 0, 6))
    assert_kv_equal(transport.get(h), {i: (k.contiguous(), v.contiguous()) for i, (k, v) in kv.items()})
    transport.release(h)
    one = rand_kv([9], 1)
    h = transport.put(one, ChunkSpec((9,), 41, 42))
    assert_kv_equal(transport.get(h), one)
    transport.release(h)


def test_empty_token_range_round_trips(transport):
    kv = rand_kv([0, 1], 0)
    h = transport.put(kv, ChunkSpec((0, 1), 8, 8))
    assert h.nbytes == 0
    got = transport.get(h)
    assert list(got) == [0, 1] and all(k.shape == (0, HEADS, DIM) and v.shape == (0, HEADS, DIM)
                                       for k, v in got.values())
    transport.release(h)


def test_layer_order_follows_the_spec(transport):
    kv = rand_kv([2, 0, 1], 5)
    h = transport.put(kv, ChunkSpec((1, 2, 0), 0, 5))
    got = transport.get(h)
    assert list(got) == [1, 2, 0]
    assert_kv_equal(got, {i: kv[i] for i in (1, 2, 0)})
    transport.release(h)


def _malformed():
    k = torch.zeros(4, HEADS, DIM)
    ok = (k, k.clone())
    return [
        ("layers missing", {0: ok}, ChunkSpec((0, 1), 0, 4)),
        ("extra layer", {0: ok, 1: ok, 2: ok}, ChunkSpec((0, 1), 0, 4)),
        ("other layers", {0: ok, 2: ok}, ChunkSpec((0, 1), 0, 4)),
        ("no layers", {}, ChunkSpec((), 0, 4)),
        ("tokens differ from the spec", {0: ok}, ChunkSpec((0,), 0, 5)),
        ("end before start", {0: ok}, ChunkSpec((0,), 4, 0)),
        ("2-d tensors", {0: (k[:, 0], k[:, 0])}, ChunkSpec((0,), 0, 4)),
        ("K and V shapes differ", {0: (k, torch.zeros(4, HEADS, DIM + 1))}, ChunkSpec((0,), 0, 4)),
        ("layers' shapes differ", {0: ok, 1: (torch.zeros(4, HEADS + 1, DIM),) * 2}, ChunkSpec((0, 1), 0, 4)),
        ("K and V dtypes differ", {0: (k, k.to(torch.bfloat16))}, ChunkSpec((0,), 0, 4)),
        ("layers' dtypes differ", {0: ok, 1: (k.half(), k.half())}, ChunkSpec((0, 1), 0, 4)),
    ]


@pytest.mark.parametrize("what,kv,spec", _malformed(), ids=[m[0] for m in _malformed()])
def test_malformed_chunks_raise_value_error(transport, what, kv, spec):
    with pytest.raises(ValueError):
        transport.put(kv, spec)
    # (the autouse fixture checks no segment was left behind)


def test_build_transport():
    assert isinstance(build_transport("shm"), SharedMemoryTransport)
    with pytest.raises(ValueError, match="unknown KV transport"):
        build_transport("carrier-pigeon")


# ============================================================================ shared memory
def _echo_in_child(handle: KVHandle, prefix: str) -> tuple[KVHandle, list[int], str]:
    """In another process: receive the chunk, release it (the receiver owns it), send it back as a
    new chunk; also report what was received, so the parent checks the data, not just the echo."""
    t = SharedMemoryTransport(prefix=prefix)
    kv = t.get(handle)
    t.release(handle)
    return t.put(kv, handle.spec), [os.getpid()], repr(sorted(kv))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_chunk_read_in_another_process(dtype):
    t = SharedMemoryTransport(prefix=PREFIX)
    kv = rand_kv([0, 1, 2], 33, dtype)
    spec = ChunkSpec((0, 1, 2), 7, 40)
    h = t.put(kv, spec)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        back, (pid,), layers = pool.submit(_echo_in_child, h, PREFIX).result(timeout=120)
    assert pid != os.getpid() and layers == "[0, 1, 2]"
    assert not os.path.exists(f"/dev/shm/{h.ref}"), "the receiver released the chunk"
    assert back.ref != h.ref and back.spec == spec
    assert_kv_equal(t.get(back), kv)
    t.release(back)


def test_shm_release_unlinks_and_tolerates_a_concurrent_release(monkeypatch):
    t = SharedMemoryTransport(prefix=PREFIX)
    h = t.put(rand_kv([0], 3), ChunkSpec((0,), 0, 3))
    assert os.path.exists(f"/dev/shm/{h.ref}")
    t.release(h)
    assert not os.path.exists(f"/dev/shm/{h.ref}")
    t.release(h)
    # another holder unlinks it between our attach and our unlink
    h = t.put(rand_kv([0], 3), ChunkSpec((0,), 0, 3))
    from multiprocessing import shared_memory

    class Raced(shared_memory.SharedMemory):
        def close(self):
            super().close()
            if os.path.exists(f"/dev/shm/{self.name}"):
                os.unlink(f"/dev/shm/{self.name}")

    monkeypatch.setattr(shared_memory, "SharedMemory", Raced)
    t.release(h)
    assert not os.path.exists(f"/dev/shm/{h.ref}")


def test_shm_put_that_fails_midway_leaves_nothing():
    t = SharedMemoryTransport(prefix=PREFIX)
    meta = torch.empty(4, HEADS, DIM, device="meta")  # passes the shape checks; copying it fails
    with pytest.raises(NotImplementedError):
        t.put({0: (meta, meta)}, ChunkSpec((0,), 0, 4))
    assert not leftovers()


def test_shm_never_pickles_tensors():
    t = SharedMemoryTransport(prefix=PREFIX)
    h = t.put(rand_kv(range(4), 256), ChunkSpec((0, 1, 2, 3), 0, 256))
    import pickle

    assert len(pickle.dumps(h)) < 400 < h.nbytes  # only the name, spec and shape cross the pipe
    t.release(h)


SCRIPT = """
import multiprocessing, os, sys
from concurrent.futures import ProcessPoolExecutor
import torch
from tidal.runtime.kv_transfer import ChunkSpec, SharedMemoryTransport

PREFIX = sys.argv[1]

def echo(h):
    t = SharedMemoryTransport(prefix=PREFIX)
    kv = t.get(h)
    t.release(h)
    return t.put(kv, h.spec)

if __name__ == "__main__":
    t = SharedMemoryTransport(prefix=PREFIX)
    kv = {i: (torch.randn(9, 2, 4).to(torch.bfloat16), torch.randn(9, 2, 4).to(torch.bfloat16)) for i in (0, 1)}
    spec = ChunkSpec((0, 1), 0, 9)
    for _ in range(3):  # put, get, release, release again
        h = t.put(kv, spec)
        assert all(torch.equal(a, b) for i in kv for a, b in zip(kv[i], t.get(h)[i]))
        t.release(h)
        t.release(h)
    h = t.put({0: (kv[0][0][:0], kv[0][1][:0])}, ChunkSpec((0,), 3, 3))  # no tokens
    t.get(h)
    t.release(h)
    meta = torch.empty(9, 2, 4, device="meta")
    try:  # fails midway: the segment is removed, the tracker stays consistent
        t.put({0: (meta, meta)}, ChunkSpec((0,), 0, 9))
    except NotImplementedError:
        pass
    try:
        t.put(kv, ChunkSpec((0,), 0, 9))
    except ValueError:
        pass
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        back = pool.submit(echo, t.put(kv, spec)).result()
    t.get(back)
    t.release(back)
    if sys.argv[2] == "keep":  # the receiver "died": the chunk stays until its holder releases it
        print(t.put(kv, spec).ref)
    print("done")
"""


@pytest.mark.parametrize("mode", ["clean", "keep"])
def test_shm_no_resource_tracker_warnings_at_exit(tmp_path, mode):
    script = tmp_path / "kv_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.run([sys.executable, str(script), PREFIX, mode], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "done"
    assert proc.stderr.strip() == "", f"stderr not clean:\n{proc.stderr}"
    if mode == "keep":
        name = proc.stdout.split()[0]
        # the tracker neither warned of it nor unlinked it at exit: ownership is explicit
        assert os.path.exists(f"/dev/shm/{name}")
        SharedMemoryTransport().release(KVHandle("shm", name, ChunkSpec((0, 1), 0, 9), (9, 2, 4), "bfloat16", 0))
        assert not os.path.exists(f"/dev/shm/{name}")


# ============================================================================ Ray: a chunk owned by an actor
def _owner_actor(ray, name: str):
    """A worker actor's part of the Ray transport: it puts chunks and answers their readers."""

    @ray.remote(num_cpus=0, concurrency_groups={"kv": 1})
    class Owner:
        def put(self, kv, spec):
            return RayTransport().put(kv, spec)

        @ray.method(concurrency_group="kv")
        def fetch(self, key):
            from tidal.runtime.kv_transfer import serve_chunk

            return serve_chunk(key)

        @ray.method(concurrency_group="kv")
        def drop(self, keys):
            from tidal.runtime.kv_transfer import drop_chunks

            drop_chunks(keys)

    return Owner.options(name=name).remote()


def test_ray_chunk_of_an_actor_crosses_plain_pickle_then_is_gone_when_released_or_its_owner_dies(ray_local):
    """The control path pickles a handle with plain pickle, which keeps an ObjectRef's id but not
    its owner: a reader on another node then waited for ever. A handle names the owning actor
    instead; released, or with its owner dead, it reads as gone at once, never as a hang."""
    import pickle

    from tidal.runtime.kv_transfer import KVChunkGone

    ray = ray_local
    name = f"tidal-test-{secrets.token_hex(4)}"
    owner = _owner_actor(ray, name)
    kv = rand_kv([0, 1], 7, torch.bfloat16)
    h = pickle.loads(pickle.dumps(ray.get(owner.put.remote(kv, ChunkSpec((0, 1), 0, 7)))))
    assert h.ref.server == name and h.ref.ref is None  # no ObjectRef on the control path
    reader = RayTransport()
    assert_kv_equal(reader.get(h), kv)
    assert_kv_equal(reader.get(h), kv)  # a get does not consume the chunk
    reader.release(h)
    ray.get(owner.drop.remote([]))  # (the release went before this call: one actor, one kv thread, in order)
    with pytest.raises(KVChunkGone, match="released"):
        reader.get(h)
    h2 = pickle.loads(pickle.dumps(ray.get(owner.put.remote(kv, ChunkSpec((0, 1), 0, 7)))))
    ray.kill(owner)  # (asynchronous: wait until the actor answers no more, or a call may still reach it)
    for _ in range(300):
        try:
            ray.get(owner.drop.remote([]), timeout=5)
        except ray.exceptions.RayError:
            break
        time.sleep(0.1)
    with pytest.raises(KVChunkGone, match="cannot be read"):  # (bounded: at worst RAY_GET_TIMEOUT_S)
        reader.get(h2)
    reader.release(h2)  # harmless with its owner gone


# ============================================================================ paged KV caches
TINY = ModelArch(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=4,
                 num_heads=4, num_kv_heads=HEADS, head_dim=DIM, name="tiny")


def filled_cache(block_size: int, dtype: torch.dtype, seed: int, num_blocks: int = 16) -> PagedKVCache:
    cache = PagedKVCache(TINY, range(TINY.num_layers), num_blocks, block_size, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for layer in cache.layers.values():
        layer.k.copy_(torch.randn(layer.k.shape, generator=g))
        layer.v.copy_(torch.randn(layer.v.shape, generator=g))
    return cache


def snapshot(cache: PagedKVCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {i: (layer.k.clone(), layer.v.clone()) for i, layer in cache.layers.items()}


@pytest.mark.parametrize("dst_block_size", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_chunk_export", [False, True], ids=["export-once", "export-per-chunk"])
def test_chunked_transfer_moves_exactly_the_blocks_asked_for(transport, dtype, dst_block_size, per_chunk_export):
    src = filled_cache(8, dtype, seed=1)
    dst = filled_cache(dst_block_size, dtype, seed=2, num_blocks=24)
    src_table = [3, 7, 1, 12, 5]  # 40 tokens in scattered blocks
    dst_table = [9, 0, 14, 2, 6, 21, 11, 17, 19, 4][: math.ceil(40 / dst_block_size)]
    layers, start, end = [1, 2], 5, 37
    before = snapshot(dst)
    whole = src.export(src_table, layers, start, end)
    specs = plan_chunks(layers, start, end, layers_per_chunk=1, tokens_per_chunk=10)
    assert len(specs) == 8
    for spec in specs:
        if per_chunk_export:  # the sender exports each chunk from its pool as it goes
            part = src.export(src_table, spec.layers, spec.start, spec.end)
        else:
            part = chunk_of(whole, spec, start)
        h = transport.put(part, spec)
        got = transport.get(h)
        transport.release(h)
        assert list(got) == list(spec.layers) and all(k.shape[0] == spec.end - spec.start for k, _ in got.values())
        dst.import_(dst_table, got, start=spec.start)

    assert_kv_equal(dst.export(dst_table, layers, start, end), whole)
    # every other slot is as it was: other layers, tokens [0, 5) and [37, 40), the other blocks
    expected = {i: (k.clone(), v.clone()) for i, (k, v) in before.items()}
    pos = torch.arange(start, end)
    slots = torch.tensor(dst_table)[pos // dst_block_size] * dst_block_size + pos % dst_block_size
    for i in layers:
        for j in (0, 1):
            flat = expected[i][j].view(-1, HEADS, DIM)
            flat[slots] = whole[i][j]
    after = snapshot(dst)
    assert_kv_equal(after, expected)
    # and the transfer did something: each (layer, K or V, token) asked for changed (the pools were random)
    changed = sum(int((x != y).flatten(0, 1).any(dim=(-1, -2)).sum())
                  for i in before for x, y in zip(before[i], after[i], strict=True))
    assert changed == 2 * len(layers) * (end - start)


# ============================================================================ a migrated request
def merge(chunks, layers, start: int, end: int):
    """Assemble received chunks into whole ``[end - start, heads, dim]`` tensors per layer."""
    out = {}
    for spec, kv in chunks:
        for i in spec.layers:
            k, v = kv[i]
            if i not in out:
                out[i] = (k.new_empty((end - start, *k.shape[1:])), v.new_empty((end - start, *v.shape[1:])))
            out[i][0][spec.start - start:spec.end - start] = k
            out[i][1][spec.start - start:spec.end - start] = v
    assert sorted(out) == sorted(layers)
    return {i: out[i] for i in layers}


def finish(engine) -> list[list[int]]:
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return outs


PARAMS_KW = dict(temperature=0, max_tokens=10, ignore_eos=True)
PROMPT = ("The tide comes in and goes out twice a day because the moon pulls on the oceans of the Earth, and")


@pytest.fixture(scope="module")
def two_engines(make_tiny_engine):
    # B has another block size, so the KV lands in a different layout (the random-weight tiny_llama:
    # what is checked is that the moved KV continues the request, whatever the weights)
    return make_tiny_engine(max_num_batched_tokens=64), make_tiny_engine(max_num_batched_tokens=64, block_size=8)


@pytest.fixture(scope="module")
def reference(two_engines, smol_tokenizer):
    """The request run alone, start to end, on engine A."""
    from tidal import SamplingParams

    a = two_engines[0]
    a.add_request("ref", None, SamplingParams(**PARAMS_KW), prompt_token_ids=smol_tokenizer.encode(PROMPT))
    return finish(a)["ref"]


def test_transferred_request_continues_with_identical_tokens(transport, two_engines, reference, smol_tokenizer):
    from tidal import SamplingParams
    from tidal.engine.llm_engine import RequestSnapshot

    a, b = two_engines
    prompt = smol_tokenizer.encode(PROMPT)
    assert len(reference) == PARAMS_KW["max_tokens"]
    rid = f"m-{transport.name}"
    a.add_request(rid, None, SamplingParams(**PARAMS_KW), prompt_token_ids=prompt)
    while len(a.scheduler.requests[rid].output_token_ids) < 4:
        a.step()
    snap = a.export_request(rid)
    n = snap.num_computed_tokens
    assert n == len(prompt) + 3
    layers = sorted(snap.kv)
    assert layers == list(range(a.arch.num_layers))
    lpc, tpc = math.ceil(len(layers) / 2), math.ceil(n / 3)
    received = []
    for spec, part in iter_chunks(snap.kv, 0, n, lpc, tpc):  # sent one chunk at a time
        h = transport.put(part, spec)
        received.append((spec, transport.get(h)))
        transport.release(h)
    specs = [s for s, _ in received]
    assert specs == plan_chunks(layers, 0, n, lpc, tpc)
    assert len({s.layers for s in specs}) == 2 and len({(s.start, s.end) for s in specs}) == 3
    kv = merge(received, layers, 0, n)
    assert_kv_equal(kv, snap.kv)
    a.abort_request(rid)

    b.import_request(RequestSnapshot(snap.request_id, snap.prompt, snap.prompt_token_ids, snap.output_token_ids,
                                     snap.params, n, kv, snap.priority, snap.request_class))
    assert finish(b)[rid] == reference
    assert b.kv_manager.num_free_blocks == b.kv_manager.num_blocks
    assert a.kv_manager.num_free_blocks == a.kv_manager.num_blocks


def test_a_released_chunk_reads_as_gone_not_as_a_crash():
    """A receiver that reads a chunk its owner already released (an aborted request's chunk whose
    ``kv`` message was still queued) gets KVChunkGone, which the worker handles by dropping the import."""
    import torch

    from tidal.cluster.handoff import ChunkSpec
    from tidal.runtime.kv_transfer import KVChunkGone, SharedMemoryTransport

    tr = SharedMemoryTransport(f"tidal-kv-test{os.getpid()}")
    kv = {0: (torch.ones(2, 1, 4), torch.zeros(2, 1, 4))}
    h = tr.put(kv, ChunkSpec((0,), 0, 2))
    tr.release(h)
    with pytest.raises(KVChunkGone, match="released before it was read"):
        tr.get(h)
    tr.release(h)  # releasing twice stays harmless


def test_the_front_ends_outbox_never_blocks_on_a_worker_that_cannot_take_a_command():
    """A PUSH socket with no worker connected blocks a send, and the cluster's lock with it (a
    worker that died, or one still starting). The outbox drops what is for a dead worker and keeps,
    in order, what is for a live one until it connects."""
    import zmq

    from tidal.runtime.outbox import Outbox
    from tidal.runtime.protocol import Abort, decode_command

    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PUSH) for _ in range(2)]
    for i, s in enumerate(socks):
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"inproc://outbox-{i}")
    box = Outbox()
    for i, msg in ((0, Abort("a")), (1, Abort("b")), (1, Abort("c"))):
        box.put(i, msg)
    alive = [False, True].__getitem__  # worker 0 died, worker 1 still starts
    try:
        box.flush(socks, alive)  # returns: nothing blocks
        assert list(box.queue) == [(1, Abort("b")), (1, Abort("c"))]
        pull = ctx.socket(zmq.PULL)
        pull.connect("inproc://outbox-1")
        deadline = time.monotonic() + 5
        while box.queue and time.monotonic() < deadline:
            box.flush(socks, alive)
            time.sleep(0.01)
        assert [decode_command(pull.recv()) for _ in range(2)] == [Abort("b"), Abort("c")]
        pull.close(0)
        box.clear_wakeups()  # the puts' wake-ups are read without blocking
    finally:
        box.close()
        for s in socks:
            s.close(0)
        ctx.term()
