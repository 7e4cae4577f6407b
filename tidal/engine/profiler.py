"""``tidal profile``: time the real engine's step over a grid of batch shapes.

Each sample is one hand-built :class:`~tidal.core.plan.StepPlan` executed by the engine's own
:class:`~tidal.engine.runner.ModelRunner`: fake requests get blocks from the engine's
:class:`~tidal.core.kv_manager.KVCacheManager` (their KV contents are garbage, which does not
change the timing), and the median wall time of its runs is kept.
Every point is timed once per pass (``repeats`` passes in shuffled orders; the first run of a
point follows ``warmup`` untimed ones).
A sample is described only by its chunk list ``[[start, num_tokens, sample], ...]``, so any
feature set can be fitted to it later (:class:`tidal.sim.profiled.ProfiledCostModel`).

KunServe Eq. 1's alpha, beta, gamma (per decoder layer) are fitted to single-chunk steps over a
grid of (prefix, tokens) (:func:`profile_eq1`), saved as ``eq1``; ``tidal serve --profile``
gives them to a pipeline group's microbatch split.

The engine's per-step work outside ``execute`` (the scheduler's schedule and update, the output
side) is measured on a few real small batches and fitted as ``a + b * num_seqs``.
"""

from __future__ import annotations

import datetime
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from tidal.common.machine import machine_info
from tidal.core.plan import BatchComposition, ScheduledChunk, StepPlan
from tidal.core.sampling import SamplingParams

FORMAT = "tidal-profile/1"
Chunk = tuple[int, int, bool]  # (start, num_tokens, sample)
Progress = Callable[[int, int, dict[str, Any]], None]  # (done, total, the sample just measured)

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def _point(prefill: int, decodes: int, context: int, prefix: int = 0, sample: bool = True,
           spread: bool = False) -> list[Chunk]:
    """``decodes`` decodes with ``context`` cached tokens (or, with ``spread``, contexts spread
    evenly over [context/4, context]) and one prefill chunk of ``prefill`` tokens after ``prefix``."""
    chunks: list[Chunk] = []
    for i in range(decodes):
        ctx = context if not spread or decodes == 1 else context // 4 + (context - context // 4) * i // (decodes - 1)
        chunks.append((max(1, ctx), 1, True))
    if prefill:
        chunks.append((prefix, prefill, sample))
    return chunks


def default_grid(quick: bool = False) -> list[list[Chunk]]:
    """The chunk lists to time. Fresh prefills and uniform decodes over P x D x C, plus chunked
    prefills (a cached prefix; some not sampled, as a long prompt's middle chunk) and decodes
    whose contexts differ (the runner pads them into groups)."""
    if quick:
        return [_point(16, 0, 0), _point(64, 0, 0), _point(128, 0, 0), _point(64, 0, 0, sample=False),
                _point(0, 1, 64), _point(0, 4, 64), _point(0, 8, 256), _point(0, 8, 256, spread=True),
                _point(16, 2, 64), _point(32, 4, 128), _point(32, 0, 0, prefix=64),
                _point(64, 0, 0, prefix=128, sample=False)]
    grid: list[list[Chunk]] = []
    for p in (0, 16, 64, 128, 256, 512):
        for d in (0, 1, 2, 4, 8, 16, 32, 64):
            for c in (64, 256, 512, 1024):
                if (p == 0 and d == 0) or (d == 0 and c != 64):  # no decodes: the context is moot
                    continue
                grid.append(_point(p, d, c))
    for p in (64, 256, 512):
        for prefix in (256, 1024):
            grid.append(_point(p, 0, 0, prefix=prefix, sample=True))
            grid.append(_point(p, 0, 0, prefix=prefix, sample=False))
            grid.append(_point(p, 16, 512, prefix=prefix, sample=False))
    for p in (128, 512):
        grid.append(_point(p, 0, 0, sample=False))
    for d in (8, 32, 64):
        for c in (512, 1024):
            grid.append(_point(0, d, c, spread=True))
            grid.append(_point(64, d, c, spread=True))
    return grid


def _fits(engine: Any, chunks: Sequence[Chunk]) -> bool:
    kv = engine.kv_manager
    need = sum(kv.blocks_for_tokens(s + n) for s, n, _ in chunks)
    longest = max(s + n for s, n, _ in chunks)
    return need <= kv.num_free_blocks and longest <= engine.max_model_len


def time_chunks(engine: Any, chunks: Sequence[Chunk], repeats: int = 3, warmup: int = 1,
                rng: random.Random | None = None) -> list[float]:
    """Execute the plan made of ``chunks`` ``warmup + repeats`` times; the measured wall times."""
    rng = rng or random.Random(0)
    kv = engine.kv_manager
    vocab = engine.arch.vocab_size
    ids = [f"__profile_{i}" for i in range(len(chunks))]
    sched: list[ScheduledChunk] = []
    try:
        for rid, (start, n, sample) in zip(ids, chunks, strict=True):
            if kv.allocate(rid, start + n) is None:
                raise RuntimeError(f"the KV pool cannot hold the profiled batch {list(chunks)}")
            sched.append(ScheduledChunk(rid, tuple(rng.randrange(vocab) for _ in range(n)), start,
                                        tuple(kv.block_table(rid)), sample, GREEDY))
        plan = StepPlan(step_id=0, chunks=tuple(sched), composition=BatchComposition.of(sched))
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            engine.runner.execute(plan)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times
    finally:
        for rid in ids:
            kv.free(rid)
        engine.runner.sampler.forget(ids)


def measure_overhead(engine: Any, batch_sizes: Sequence[int] = (1, 4, 16, 32), steps: int = 5,
                     prompt_len: int = 8) -> dict[str, Any]:
    """Engine wall time per step outside ``execute`` (schedule, update, outputs) on real decode
    batches; least squares ``a + b * num_seqs`` (both clipped at 0)."""
    rng = random.Random(1)
    vocab = engine.arch.vocab_size
    xs, ys = [], []
    cap = engine.config.scheduler.max_num_seqs
    for n in [b for b in batch_sizes if b <= cap]:
        ids = [f"__overhead_{n}_{i}" for i in range(n)]
        for rid in ids:
            engine.add_request(rid, None, GREEDY, prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)])
        try:
            for _ in range(4 * n):  # until every prompt is prefilled and decoding
                engine.step()
                if all(r.num_output_tokens for r in _requests(engine, ids)):
                    break
            over = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                over.append(max(0.0, time.perf_counter() - t0 - engine.last_result.step_time_s))
            xs.append(n)
            ys.append(statistics.median(over))
        finally:
            engine.abort_request(ids)
    if not xs:
        return {"per_step_s": 0.0, "per_seq_s": 0.0, "points": []}
    b = 0.0
    if len(set(xs)) > 1:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
                / sum((x - mx) ** 2 for x in xs))
    a = max(0.0, statistics.fmean(ys) - b * statistics.fmean(xs))
    return {"per_step_s": a, "per_seq_s": b, "points": [[x, y] for x, y in zip(xs, ys, strict=True)]}


LIVE_RUNS = ((48, 2.0), (48, 8.0))  # (requests, arrival rate in req/s of engine time)


StepRecord = tuple[list[tuple[int, int, bool]], float]  # (chunks as (start, tokens, sample), execute s)


def record_steps(engine: Any) -> tuple[list[StepRecord], Callable[[], None]]:
    """From now on, every non-empty step ``engine`` executes, with its measured execute time;
    and a function that stops recording."""
    steps: list[StepRecord] = []
    execute = engine.runner.execute

    def timed(plan: StepPlan) -> Any:
        res = execute(plan)
        if plan.chunks:
            steps.append(([(c.start, len(c.token_ids), c.sample) for c in plan.chunks], res.step_time_s))
        return res

    def stop() -> None:
        engine.runner.execute = execute

    engine.runner.execute = timed
    return steps, stop


def measure_live(engine: Any, runs: Sequence[tuple[int, float]] = LIVE_RUNS, seed: int = 1234,
                 prompt: tuple[int, int] = (16, 768), output: tuple[int, int] = (8, 160),
                 progress: Progress | None = None) -> list[dict[str, Any]]:
    """Steps of real serving: requests of mixed lengths arrive (Poisson, on a clock that advances by
    each step's measured time, so nothing sleeps) and the engine's own scheduler composes the
    batches. Every executed step is one sample. The grid covers the corners; these samples carry
    what the grid's isolated points miss (mixed contexts, KV spread over the pool, allocator and
    cache state of a running server)."""
    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    steps, stop = record_steps(engine)
    try:
        for r, (n, rate) in enumerate(runs):
            t, arrivals = 0.0, []
            for _ in range(n):
                t += rng.expovariate(rate)
                arrivals.append(t)
            ids = [f"__live_{r}_{i}" for i in range(n)]
            clock, nxt = 0.0, 0
            while nxt < n or engine.has_unfinished_requests():
                while nxt < n and arrivals[nxt] <= clock:
                    params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*output), ignore_eos=True)
                    engine.add_request(ids[nxt], None, params,
                                       prompt_token_ids=[rng.randrange(vocab) for _ in range(rng.randint(*prompt))])
                    nxt += 1
                if not engine.has_unfinished_requests():
                    clock = arrivals[nxt]
                    continue
                engine.step()
                clock += engine.last_result.step_time_s
            if progress is not None:
                progress(r + 1, len(runs), {"chunks": [], "time_s": clock, "pass": r, "live": True,
                                            "steps": len(steps)})
    finally:
        stop()
    return [{"chunks": [list(c) for c in chunks], "time_s": t, "source": "live"} for chunks, t in steps]


EQ1_TOKENS = (1, 16, 32, 64, 128, 256)  # a chunk's tokens (1: a decode) ...
EQ1_PREFIXES = (0, 128, 512, 1024)  # ... after this many cached tokens


def eq1_grid(quick: bool = False) -> list[tuple[int, int]]:
    """(prefix, tokens) of the single-chunk steps Eq. 1 is fitted to."""
    if quick:
        return [(p, c) for p in (0, 512) for c in (1, 16, 64)]
    return [(p, c) for p in EQ1_PREFIXES for c in EQ1_TOKENS]


def profile_eq1(engine: Any, grid: Sequence[tuple[int, int]] | None = None, repeats: int = 3,
                warmup: int = 1) -> dict[str, Any]:
    """KunServe Eq. 1's alpha, beta, gamma on this engine (Sec. 4.3: "profiled offline"): a step
    of one chunk of ``tokens`` after ``prefix`` cached tokens (sampling nothing, as a chunk cut
    by the microbatch split) is timed over ``grid`` (median of ``repeats``), divided by the
    decoder layers the engine holds (a pipeline stage pays its own layers' share), and fitted by
    least squares (:func:`tidal.cluster.pressure.fit_chunk_cost`). The embedding and final norm
    fall into beta and gamma. Returns the coefficients (seconds per layer), the points and R^2."""
    from tidal.cluster.pressure import fit_chunk_cost

    grid = eq1_grid() if grid is None else grid
    layers = len(engine.model.layer_ids)
    rng = random.Random(2)
    points = []
    for prefix, tokens in grid:
        if not _fits(engine, [(prefix, tokens, False)]):
            continue
        t = statistics.median(time_chunks(engine, [(prefix, tokens, False)], repeats, warmup, rng))
        points.append((prefix, tokens, t / layers))
    cost = fit_chunk_cost(points)
    pred = [cost.chunk(p, c) for p, c, _ in points]
    ys = [y for _, _, y in points]
    mean = statistics.fmean(ys)
    ss = sum((y - mean) ** 2 for y in ys)
    r2 = 1.0 - sum((y - q) ** 2 for y, q in zip(ys, pred, strict=True)) / ss if ss else 1.0
    return {"alpha": cost.alpha, "beta": cost.beta, "gamma": cost.gamma, "per": "decoder layer",
            "num_layers": layers, "r2": r2, "points": [[p, c, y] for p, c, y in points]}


def _requests(engine: Any, ids: Sequence[str]) -> list[Any]:
    return [engine.scheduler.requests[rid] for rid in ids]


def profile_engine(engine: Any, grid: Sequence[Sequence[Chunk]] | None = None, repeats: int = 3, warmup: int = 1,
                   progress: Progress | None = None, overhead: bool = True,
                   live_runs: Sequence[tuple[int, float]] | None = LIVE_RUNS,
                   eq1: Sequence[tuple[int, int]] = ()) -> dict[str, Any]:
    """Time ``engine``'s step on every chunk list of ``grid`` (default :func:`default_grid`);
    returns the JSON-able profile (see the module docstring). Points the KV pool cannot hold are
    listed under ``skipped``. The KV manager is all free again afterwards."""
    import torch

    from tidal.engine.runner import ModelRunner

    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    grid = default_grid() if grid is None else grid
    kv = engine.kv_manager
    free_before = kv.num_free_blocks
    if engine.has_unfinished_requests():
        raise ValueError("profile an idle engine: it has unfinished requests")
    rng = random.Random(0)
    points, skipped = [], []
    for chunks in grid:
        chunks = [(int(s), int(n), bool(b)) for s, n, b in chunks]
        if chunks and _fits(engine, chunks):
            points.append(chunks)
        else:
            skipped.append([list(c) for c in chunks])
    # one timed run of every point per pass, in a new random order each pass: a burst of load
    # from elsewhere, or a slow spell of the CPU, then spoils one run of scattered points (which
    # the median drops, and the fit averages out) instead of every run of neighbouring points
    times: list[list[float]] = [[] for _ in points]
    total, done = len(points) * repeats, 0
    for r in range(repeats):
        order = list(range(len(points)))
        rng.shuffle(order)
        for i in order:
            chunks = points[i]
            t = time_chunks(engine, chunks, 1, warmup if r == 0 else 0, rng)[0]
            times[i].append(t)
            done += 1
            if progress is not None:
                progress(done, total, {"chunks": chunks, "time_s": t, "pass": r})
    samples = [{"chunks": [list(c) for c in chunks], "time_s": statistics.median(ts), "times_s": ts}
               for chunks, ts in zip(points, times, strict=True)]
    assert kv.num_free_blocks == free_before == kv.num_blocks, "the profiler leaked KV blocks"
    if live_runs:
        samples += measure_live(engine, live_runs, progress=progress)
        assert kv.num_free_blocks == kv.num_blocks, "the live measurement leaked KV blocks"
    over = measure_overhead(engine) if overhead else {"per_step_s": 0.0, "per_seq_s": 0.0, "points": []}
    assert kv.num_free_blocks == kv.num_blocks, "the overhead measurement leaked KV blocks"
    eq1_fit = profile_eq1(engine, eq1, repeats, warmup) if eq1 else None  # (prefix, tokens) points
    arch, ckpt = engine.arch, engine.checkpoint
    return {
        "format": FORMAT,
        "model": {"name": arch.name, "path": str(ckpt.path), "architecture": arch.architecture,
                  "num_layers": len(engine.model.layer_ids), "hidden_size": arch.hidden_size,
                  "intermediate_size": arch.intermediate_size, "num_heads": arch.num_heads,
                  "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab_size": arch.vocab_size},
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": machine_info(),
        "block_size": kv.block_size,
        "decode_grouping": {"fill": ModelRunner.GROUP_FILL, "min_group": ModelRunner.MIN_GROUP},
        "sampling": "greedy",
        "repeats": repeats,
        "warmup": warmup,
        "samples": samples,
        "skipped": skipped,
        "overhead": over,
        **({"eq1": eq1_fit} if eq1_fit is not None else {}),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
