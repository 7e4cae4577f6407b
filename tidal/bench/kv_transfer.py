"""``tidal bench kv-transfer``: MB/s and latency per chunk size of each KV transport.

One chunk is ``--layers-per-chunk`` layers x ``--tokens`` tokens of K and V in a model's shape
(``tidal.sim.models``: ``[tokens, kv_heads, head_dim]`` per layer, random values in ``--dtype``).
For each transport and chunk size the sender ``put``s the chunk, hands its handle to a receiver in
another process, which ``get``s it (a copy in its own memory) and ``release``s it:

- ``shm``: the receiver is a spawned process; the handle crosses a pipe (only the segment's name);
- ``ray``: the receiver is a Ray actor on a local Ray (``ray.init`` here, shut down at the end);
  the chunk goes through the object store; release is the sender dropping its reference.

Reported per transport and size: median put, get, release and put+get latency, the median round
trip the sender sees (put, hand over, get, release, reply), and MB/s = K+V bytes of the chunk /
median (put + get) (MB = 10^6 bytes). The first round (not timed) checks the receiver got the
same bits. Prints a table, writes JSON and a PNG (MB/s against chunk bytes, one line per transport).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import shlex
import statistics
import sys
import time
from typing import Any

PROG = "tidal bench kv-transfer"
DEFAULT_OUTPUT = "results/kv_transfer.json"
TRANSPORT_NAMES = ("shm", "ray")
DTYPES = ("float32", "bfloat16", "float16")
RAY_MISSING = "Ray is not installed (pip install -e '.[ray]')"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from tidal.sim.models import MODELS

    p = sub.add_parser("kv-transfer", help="KV transfer between instances: MB/s and latency per chunk size",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default="shm,ray", help=f"comma-separated, of {', '.join(TRANSPORT_NAMES)}")
    p.add_argument("--model-shape", default="smollm2-135m", help=f"KV shape of a model: {', '.join(MODELS)}")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--tokens", default="16,64,256,1024", help="tokens per chunk, comma-separated (one size each)")
    p.add_argument("--layers-per-chunk", type=int, default=None, help="layers per chunk (default: all the model's)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per transport and size")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (the first checks the data)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON result path (the PNG is written beside it)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


# ============================================================================ chunks and receivers
def make_chunk(arch: Any, layers: int, tokens: int, dtype: str, seed: int = 0) -> tuple[dict, Any]:
    import torch

    from tidal.runtime.kv_transfer import ChunkSpec

    g = torch.Generator().manual_seed(seed)
    shape = (tokens, arch.num_kv_heads, arch.head_dim)
    dt = getattr(torch, dtype)
    kv = {i: (torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt)) for i in range(layers)}
    return kv, ChunkSpec(tuple(range(layers)), 0, tokens)


def bits_checksum(kv: dict) -> int:
    """Sum of the raw bits of every K and V (exact, the same in any process)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    total = 0
    for k, v in kv.values():
        for t in (k, v):
            total += int(t.contiguous().view(ints[t.element_size()]).to(torch.int64).sum())
    return total


def receive(transport: Any, handle: Any, check: bool) -> tuple[float, float, int | None]:
    """The receiver's side: get (timed), release (timed), the checksum when asked."""
    t0 = time.perf_counter()
    kv = transport.get(handle)
    t1 = time.perf_counter()
    transport.release(handle)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, (bits_checksum(kv) if check else None)


def _shm_receiver_main(conn: Any) -> None:
    """A spawned process: receive handles from the pipe until ``None``; reply with the timings."""
    from tidal.runtime.kv_transfer import SharedMemoryTransport

    transport = SharedMemoryTransport()
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        handle, check = msg
        conn.send(receive(transport, handle, check))
    conn.close()


class ShmReceiver:
    description = "a spawned process (handles over a pipe)"

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_shm_receiver_main, args=(child,), name="kv-receiver", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            self.close()
            raise RuntimeError("the shm receiver process did not start")

    def __call__(self, handle: Any, check: bool) -> tuple[float, float, int | None]:
        self.conn.send((handle, check))
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the shm receiver process died (exit code {self.proc.exitcode})") from None

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()


class RayReceiver:
    description = "a Ray actor (handles as task arguments)"

    def __init__(self) -> None:
        import ray

        @ray.remote(num_cpus=0)
        class _Receiver:
            def receive(self, handle: Any, check: bool) -> tuple[float, float, int | None]:
                from tidal.runtime.kv_transfer import RayTransport

                return receive(RayTransport(), handle, check)

            def ready(self) -> bool:
                return True

        self.ray = ray
        self.actor = _Receiver.remote()
        ray.get(self.actor.ready.remote(), timeout=300)

    def __call__(self, handle: Any, check: bool) -> tuple[float, float, int | None]:
        return self.ray.get(self.actor.receive.remote(handle, check))

    def close(self) -> None:
        self.ray.kill(self.actor)


def measure(transport: Any, receiver: Any, kv: dict, spec: Any, repeats: int, warmup: int,
            bar: Any) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"put_s": [], "get_s": [], "release_s": [], "round_trip_s": []}
    want = bits_checksum(kv)
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        handle = transport.put(kv, spec)
        t1 = time.perf_counter()
        try:
            get_s, release_s, got = receiver(handle, r == 0)
            t_rel = time.perf_counter()
            transport.release(handle)  # the sender's part (ray: dropping the reference; shm: already gone)
            handle = None
            t2 = time.perf_counter()
        except BaseException:
            if handle is not None:
                transport.release(handle)  # never leave a chunk behind
            raise
        if r == 0 and got != want:
            raise RuntimeError(f"{transport.name}: the receiver got other data (bits checksum {got} != {want})")
        if r >= warmup:
            samples["put_s"].append(t1 - t0)
            samples["get_s"].append(get_s)
            samples["release_s"].append(release_s + (t2 - t_rel))
            samples["round_trip_s"].append(t2 - t0)
        bar.update(1)
    return samples


def summarize(samples: dict[str, list[float]], chunk_bytes: int) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in samples.items()}
    put_get = statistics.median(p + g for p, g in zip(samples["put_s"], samples["get_s"], strict=True))
    return {
        "put_ms": 1e3 * med["put_s"],
        "get_ms": 1e3 * med["get_s"],
        "release_ms": 1e3 * med["release_s"],
        "latency_ms": 1e3 * put_get,
        "round_trip_ms": 1e3 * med["round_trip_s"],
        "mb_s": chunk_bytes / 1e6 / put_get if put_get > 0 else float("inf"),
    }


# ============================================================================ reporting
def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'transport':<10}{'tokens':>7}{'chunk MB':>10}{'put ms':>9}{'get ms':>9}{'release ms':>11}"
            f"{'put+get ms':>11}{'round trip ms':>14}{'MB/s':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['transport']:<10}{r['tokens']:>7}{r['chunk_bytes'] / 1e6:>10.3f}{r['put_ms']:>9.3f}"
                     f"{r['get_ms']:>9.3f}{r['release_ms']:>11.3f}{r['latency_ms']:>11.3f}"
                     f"{r['round_trip_ms']:>14.3f}{r['mb_s']:>9.0f}")
    return "\n".join(lines)


def plot(result: dict[str, Any], json_path: str) -> list[str]:
    from tidal.common.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in result["transports"]:
        rows = sorted((r for r in result["rows"] if r["transport"] == name), key=lambda r: r["chunk_bytes"])
        if not rows:
            continue
        xs, ys = [r["chunk_bytes"] for r in rows], [r["mb_s"] for r in rows]
        ax.plot(xs, ys, marker="o", label=name)
        for r in rows:
            ax.annotate(f"{r['tokens']} tok", (r["chunk_bytes"], r["mb_s"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("chunk size (bytes of K+V)")
    ax.set_ylabel("MB/s (bytes / (put + get))")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left")
    ax.set_title(f"KV transfer: {result['model_shape']} {result['dtype']}, {result['layers_per_chunk']} layers per "
                 f"chunk\n{result['machine'].get('cpu_model', '')}", fontsize=9)
    fig.tight_layout()
    path = os.path.splitext(json_path)[0] + ".png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def command(args: argparse.Namespace, transports: list[str], tokens: list[int], layers: int) -> str:
    argv = ["--transports", ",".join(transports), "--model-shape", args.model_shape, "--dtype", args.dtype,
            "--tokens", ",".join(map(str, tokens)), "--layers-per-chunk", str(layers),
            "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--output", args.output]
    if args.no_plots:
        argv.append("--no-plots")
    return shlex.join([*PROG.split(), *argv])


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


# ============================================================================ run
def run(args: argparse.Namespace) -> int:
    from tidal.sim.models import get_model

    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORT_NAMES]
    if bad or not transports:
        return _error(f"unknown transport {bad[0] if bad else '(none)'!r}; available: {', '.join(TRANSPORT_NAMES)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        arch = get_model(args.model_shape)
    except ValueError as e:
        return _error(str(e))
    if not tokens or min(tokens) < 1:
        return _error("--tokens must be positive integers")
    if args.repeats < 1 or args.warmup < 0:
        return _error("--repeats must be >= 1 and --warmup >= 0")
    layers = arch.num_layers if args.layers_per_chunk is None else args.layers_per_chunk
    if not 1 <= layers <= arch.num_layers:
        return _error(f"--layers-per-chunk must be in [1, {arch.num_layers}] for {args.model_shape}")

    import torch

    from tidal.common.machine import describe, machine_info
    from tidal.common.progress import progress_bar
    from tidal.common.results import write_result
    from tidal.runtime.kv_transfer import build_transport

    skipped: dict[str, str] = {}
    if "ray" in transports:
        try:
            import ray  # noqa: F401
        except ImportError:
            skipped["ray"] = RAY_MISSING
    runnable = [t for t in transports if t not in skipped]
    machine = machine_info(dtype=args.dtype)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per_token = arch.kv_bytes_per_token(elem, layers)
    cmd = command(args, transports, tokens, layers)
    print(f"command: {cmd}")
    print(f"machine: {describe(machine)}")
    print(f"model shape {args.model_shape}: {arch.num_kv_heads} KV heads x {arch.head_dim} head_dim, {args.dtype}; "
          f"{layers} of {arch.num_layers} layers per chunk = {per_token} bytes of K+V per token")
    for name, why in skipped.items():
        print(f"{name}: skipped: {why}")

    rows: list[dict[str, Any]] = []
    receivers: dict[str, str] = {}
    t_start = time.perf_counter()
    with progress_bar(len(runnable) * len(tokens) * (args.warmup + args.repeats), "kv-transfer", "chunk",
                      enabled=not args.no_progress) as bar:
        for name in runnable:
            ray_started = False
            receiver: Any = None
            try:
                if name == "ray":
                    import ray

                    if not ray.is_initialized():
                        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
                                 logging_level=logging.WARNING)
                        ray_started = True
                    receiver = RayReceiver()
                else:
                    receiver = ShmReceiver()
                receivers[name] = receiver.description
                transport = build_transport(name, str(os.getpid()))  # segments named tidal-kv-<pid>-*
                for n in tokens:
                    kv, spec = make_chunk(arch, layers, n, args.dtype)
                    chunk_bytes = 2 * layers * n * arch.num_kv_heads * arch.head_dim * elem
                    samples = measure(transport, receiver, kv, spec, args.repeats, args.warmup, bar)
                    rows.append({"transport": name, "tokens": n, "layers": layers, "chunk_bytes": chunk_bytes,
                                 **summarize(samples, chunk_bytes), "samples": samples})
                    del kv
            finally:
                if receiver is not None:
                    receiver.close()
                if ray_started:
                    import ray

                    ray.shutdown()

    print(format_table(rows))
    result: dict[str, Any] = {
        "benchmark": "kv-transfer",
        "command": cmd,
        "machine": machine,
        "model_shape": args.model_shape,
        "dtype": args.dtype,
        "layers_per_chunk": layers,
        "bytes_per_token": per_token,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "transports": runnable,
        "receivers": receivers,
        "skipped": skipped,
        "rows": rows,
        "wall_time_s": time.perf_counter() - t_start,
        "notes": "latency_ms = median(put + get); mb_s = chunk_bytes / 1e6 / latency; round_trip_ms includes "
                 "handing the handle over and the reply; release_ms = receiver's release + the sender dropping it",
    }
    plots = write_result(result, args.output, plots=not args.no_plots, plotter=plot, prog=PROG)
    print(f"wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


__all__ = ["add_parser", "format_table", "make_chunk", "measure", "run", "summarize"]
