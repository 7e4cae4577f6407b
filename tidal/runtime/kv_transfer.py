"""Moving a request's KV between instances, in chunks, through one interface with two transports.

A request's KV (``layer -> (K, V)``, each ``[tokens, kv_heads, head_dim]``, as
``LLMEngine.export_request`` / ``PagedKVCache.export`` give it) is cut into chunks by layer
groups and token ranges (:func:`plan_chunks`). The sender ``put``s one chunk at a time between
its steps, so it keeps computing while earlier chunks are in flight; each ``put`` returns a small
picklable :class:`KVHandle` that travels on the control path; the receiver ``get``s the chunk
(a copy in its own memory) and writes it into its pool, then ``release``s the handle.

- :class:`SharedMemoryTransport` (``shm``): one POSIX shared-memory segment per chunk between local
  processes; only the segment's name and shape cross the pipe, never the tensor data.
- :class:`RayTransport` (``ray``): the Ray object store, across the nodes of a Ray cluster (needs
  ``pip install -e '.[ray]'``); a handle names the worker actor that owns the chunk.

Whoever holds a handle that will never be received (a receiver died) calls ``release``: the
segment is unlinked, so nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from tidal.cluster.handoff import ChunkSpec, plan_chunks  # pure: the simulator plans the same chunks

KV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) [tokens, kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class KVHandle:
    """Where one chunk is (picklable, small): the transport's reference plus its shape."""

    transport: str
    ref: Any  # shm: the segment name; ray: an ObjectRef
    spec: ChunkSpec
    shape: tuple[int, int, int]  # tokens, kv_heads, head_dim
    dtype: str
    nbytes: int


class KVChunkGone(LookupError):
    """The chunk was released before it was read: whoever owned it gave up on it (the front end
    released the chunks of a request it aborted, while its ``kv`` messages were still on their way)."""


class KVTransport:
    name = "base"

    def put(self, kv: KV, spec: ChunkSpec) -> KVHandle:
        raise NotImplementedError

    def get(self, handle: KVHandle) -> KV:
        raise NotImplementedError

    def release(self, handle: KVHandle) -> None:
        raise NotImplementedError


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def _check(kv: KV, spec: ChunkSpec) -> tuple[tuple[int, int, int], torch.dtype]:
    if not spec.layers:
        raise ValueError("a chunk needs at least one layer")
    if sorted(kv) != sorted(spec.layers):
        raise ValueError(f"chunk has layers {sorted(kv)}, its spec says {list(spec.layers)}")
    k0 = kv[spec.layers[0]][0]
    shape = tuple(k0.shape)
    if len(shape) != 3 or shape[0] != spec.end - spec.start:
        raise ValueError(f"chunk tensors must be [tokens={spec.end - spec.start}, kv_heads, head_dim]; got {shape}")
    for k, v in kv.values():
        if tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != k0.dtype or v.dtype != k0.dtype:
            raise ValueError("every K and V of a chunk must share one shape and dtype")
    return shape, k0.dtype  # type: ignore[return-value]


def _shm_unlink(name: str) -> None:
    """Remove a POSIX shared-memory segment by name, without attaching to it."""
    try:
        import _posixshmem  # CPython's own (what SharedMemory.unlink calls), on every POSIX platform
    except ImportError:  # pragma: no cover - not POSIX
        shm = shared_memory.SharedMemory(name=name)
        shm.close()
        shm.unlink()
        return
    _posixshmem.shm_unlink(name if name.startswith("/") else "/" + name)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Ownership is explicit (the receiver or the front end unlinks), so Python's resource tracker
    must not also unlink the segment at exit (it would warn of a leak, or remove a live chunk)."""
    with contextlib.suppress(Exception):  # best effort; harmless when not tracked
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - no public API before 3.13


class SharedMemoryTransport(KVTransport):
    name = "shm"

    def __init__(self, prefix: str = "tidal-kv"):
        self.prefix = prefix

    def put(self, kv: KV, spec: ChunkSpec) -> KVHandle:
        shape, dtype = _check(kv, spec)
        per = math.prod(shape)
        count = 2 * len(spec.layers) * per
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        # (a segment cannot be empty: a chunk of no tokens still takes one byte)
        shm = shared_memory.SharedMemory(name=f"{self.prefix}-{secrets.token_hex(8)}", create=True,
                                         size=max(1, nbytes))
        try:
            if count:
                flat = torch.frombuffer(shm.buf, dtype=dtype, count=count)
                for j, layer in enumerate(spec.layers):
                    k, v = kv[layer]
                    flat[(2 * j) * per:(2 * j + 1) * per].copy_(k.reshape(-1))
                    flat[(2 * j + 1) * per:(2 * j + 2) * per].copy_(v.reshape(-1))
                del flat
        except BaseException:
            shm.close()
            shm.unlink()  # (still registered with the resource tracker: unlink unregisters it)
            raise
        shm.close()
        _untrack(shm)  # only now: the receiver, or whoever gives up on the chunk, unlinks it
        return KVHandle(self.name, shm.name, spec, shape, str(dtype).removeprefix("torch."), nbytes)

    def get(self, handle: KVHandle) -> KV:
        dtype = _dtype(handle.dtype)
        per = math.prod(handle.shape)
        count = 2 * len(handle.spec.layers) * per
        try:
            shm = shared_memory.SharedMemory(name=handle.ref)
        except FileNotFoundError:
            raise KVChunkGone(f"KV chunk {handle.ref} was released before it was read") from None
        _untrack(shm)
        try:
            if not count:
                return {layer: (torch.empty(handle.shape, dtype=dtype), torch.empty(handle.shape, dtype=dtype))
                        for layer in handle.spec.layers}
            flat = torch.frombuffer(shm.buf, dtype=dtype, count=count)
            out = {layer: (flat[(2 * j) * per:(2 * j + 1) * per].reshape(handle.shape).clone(),
                           flat[(2 * j + 1) * per:(2 * j + 2) * per].reshape(handle.shape).clone())
                   for j, layer in enumerate(handle.spec.layers)}
            del flat
        finally:
            shm.close()
        return out

    def release(self, handle: KVHandle) -> None:
        """Unlink the segment (already gone: nothing to do). Never through the resource tracker: all of a
        cluster's processes share one, which keeps a set of names, so two holders releasing one chunk at
        once (the front end tearing a move down while its receiver lets the chunk go) registered it once
        and unregistered it twice, and the tracker died on the second (a KeyError traceback)."""
        with contextlib.suppress(FileNotFoundError):
            _shm_unlink(handle.ref)


def unlink_segments(prefix: str) -> None:
    """Unlink every shared-memory segment named ``prefix*``: a cluster's own chunks once its workers
    are gone (one whose receiver died before reading it belongs to no one else, and a segment
    outlives every process that made it)."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join("/dev/shm", name))


@dataclass(frozen=True, slots=True)
class RayChunkRef:
    """Where a Ray chunk is: ``server``, the named actor that put it (a worker), and the chunk's
    ``key`` there; or, put by a process that is no actor (a driver), the ``ObjectRef`` itself."""

    server: str | None
    key: str
    ref: Any = None


# the chunks this process put and still owns (key -> ObjectRef): the owner's reference keeps each
# alive until ``release``; a worker actor serves them to readers (``serve_chunk``, ``drop_chunks``)
_HELD: dict[str, Any] = {}
RAY_GET_TIMEOUT_S = float(os.environ.get("TIDAL_RAY_KV_TIMEOUT_S", "60"))  # a chunk unread by then is lost


def serve_chunk(key: str) -> list[Any] | None:
    """A worker actor's answer to a reader: the chunk's ``ObjectRef`` inside a list (returned
    through Ray, so the reader borrows it with its owner's address and Ray counts the reference),
    or None when it was released."""
    ref = _HELD.get(key)
    return None if ref is None else [ref]


def drop_chunks(keys: list[str]) -> None:
    for key in keys:
        _HELD.pop(key, None)


class RayTransport(KVTransport):
    """Chunks as objects in the Ray object store, owned by the process that put them.

    An ``ObjectRef`` must not cross the ZeroMQ control path as itself: plain pickle keeps only its
    id, not its owner's address, and a reader on another node then waits for ever for an object
    it cannot locate (the P/D hang across Ray nodes). So a worker actor keeps each chunk's
    reference (``_HELD``) and the handle names the actor and a key; a reader asks the actor for
    the reference (a Ray call: ownership travels with it), reads the object, and ``release`` tells
    the actor to drop its reference. Every wait is bounded (``RAY_GET_TIMEOUT_S``): a chunk whose
    owner died or dropped it is :class:`KVChunkGone`, never a hang."""

    name = "ray"

    def __init__(self) -> None:
        import ray  # noqa: F401  (fails early with ImportError when Ray is not installed)

        self._servers: dict[str, Any] = {}  # actor name -> its handle

    def _server(self, name: str) -> Any:
        import ray

        if name not in self._servers:
            self._servers[name] = ray.get_actor(name)
        return self._servers[name]

    def put(self, kv: KV, spec: ChunkSpec) -> KVHandle:
        import ray

        shape, dtype = _check(kv, spec)
        k = torch.stack([kv[layer][0] for layer in spec.layers])
        v = torch.stack([kv[layer][1] for layer in spec.layers])
        stacked = torch.stack([k, v]).cpu().contiguous()  # [2, layers, tokens, kv_heads, head_dim]
        nbytes = stacked.numel() * stacked.element_size()
        # numpy arrays go zero-copy through Plasma; torch has no numpy dtype for bfloat16, so as int16 bits
        arr = stacked.view(torch.int16).numpy() if stacked.dtype == torch.bfloat16 else stacked.numpy()
        ref, key = ray.put(arr), secrets.token_hex(12)
        _HELD[key] = ref
        server = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
        # a driver's chunk carries its reference (read in this process, or passed on through Ray itself)
        where = RayChunkRef(server, key) if server else RayChunkRef(None, key, ref)
        return KVHandle(self.name, where, spec, shape, str(dtype).removeprefix("torch."), nbytes)

    def get(self, handle: KVHandle) -> KV:
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        where: RayChunkRef = handle.ref
        try:
            if where.server is None:
                ref = where.ref
            else:
                got = ray.get(self._server(where.server).fetch.remote(where.key), timeout=RAY_GET_TIMEOUT_S)
                if got is None:
                    raise KVChunkGone(f"KV chunk {where.key} was released before it was read")
                ref = got[0]
            arr = ray.get(ref, timeout=RAY_GET_TIMEOUT_S)
        except (GetTimeoutError, RayError, ValueError) as e:  # its owner died, or it cannot be reached in time
            raise KVChunkGone(f"KV chunk {where.key} cannot be read from {where.server or 'its owner'}: "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        t = torch.from_numpy(arr.copy())
        if handle.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return {layer: (t[0, j], t[1, j]) for j, layer in enumerate(handle.spec.layers)}

    def release(self, handle: KVHandle) -> None:
        """The owner drops its reference (Ray frees the object when no reader holds one either);
        a message to the owning actor when it is another process, which nobody waits for."""
        where: RayChunkRef = handle.ref
        if where.server is None or where.key in _HELD:
            _HELD.pop(where.key, None)
            return
        with contextlib.suppress(Exception):  # the owner is gone: so are its chunks
            self._server(where.server).drop.remote([where.key])


TRANSPORTS = {"shm": SharedMemoryTransport, "ray": RayTransport}


def build_transport(name: str, tag: str = "") -> KVTransport:
    """``tag``: the shared-memory segments' names carry it (a cluster's front end gives its pid, so
    the segments of one cluster can be told from another's)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; available: {', '.join(TRANSPORTS)}")
    if name == "shm" and tag:
        return SharedMemoryTransport(f"tidal-kv-{tag}")
    return TRANSPORTS[name]()


def chunk_of(kv: KV, spec: ChunkSpec, start: int) -> KV:
    """The part of ``kv`` (whose first token is ``start``) that ``spec`` covers."""
    a, b = spec.start - start, spec.end - start
    return {layer: (kv[layer][0][a:b], kv[layer][1][a:b]) for layer in spec.layers}


def iter_chunks(kv: KV, start: int, end: int, layers_per_chunk: int | None = None,
                tokens_per_chunk: int | None = None) -> Iterator[tuple[ChunkSpec, KV]]:
    for spec in plan_chunks(sorted(kv), start, end, layers_per_chunk, tokens_per_chunk):
        yield spec, chunk_of(kv, spec, start)


__all__ = ["KV", "TRANSPORTS", "ChunkSpec", "KVHandle", "KVTransport", "RayChunkRef", "RayTransport",
           "SharedMemoryTransport", "build_transport", "drop_chunks", "serve_chunk", "chunk_of", "iter_chunks", "plan_chunks"]
