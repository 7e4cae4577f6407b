"""``tidal bench offline``: offline throughput of tidal against its peers, in one run.

Every system serves the same random-token prompts (fixed seed) on the same model file, machine,
thread count and dtype, with greedy decoding and a forced output length (EOS ignored):

* ``tidal``    -- :class:`tidal.LLM`'s engine, stepped by hand so each step's time and batch
  composition are recorded;
* ``hf``       -- transformers' plain batched ``model.generate`` (left padding, pad = EOS, all
  requests of a workload in one padded batch);
* ``hf-cb``    -- transformers' own continuous batching, ``model.generate_batch`` with a persistent
  manager; defaults tuned on this CPU: page_size 64, max_batch_tokens 512, max_requests_per_batch 16
  (its CPU/sdpa path attends each query over the whole batch's KV under a mask, so large batches
  cost quadratically), num_blocks sized for the largest workload, no block sharing (the repeats
  send identical prompts, a prefix cache would skip their prefill);
* ``llamacpp`` -- llama-cpp-python, when importable: one request after another (it has no batch
  API), on the GGUF's own (possibly quantized) weights.

Workloads: ``a`` 64 requests with prompts uniform in [32, 512] tokens; ``b`` a batch of 32 prompts
of 128 tokens; ``c`` one 128-token prompt (decode latency). 128 output tokens each.

Each timed run comes after a short warm-up and excludes model loading; runs of the systems are
interleaved repeat by repeat (so drift of a shared machine hits all of them alike) and the median
is reported. Output tok/s = generated tokens / wall time. Decode tok/s: for tidal, the tokens of
its decode-only steps over their summed step time; for every system (tidal included, as a
like-for-like column) also an estimate ``(output - one token per request) / (wall - prefill wall)``
where the prefill wall is a separate run with one output token.

The report also measures the machine's matmul peak (a large square matmul and a decode-shaped
"skinny" one) and the fraction of it that tidal's batch-``b`` decode steps reach.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tidal.bench.offline_peak import (
    combine_peaks,
    decode_step_flops,
    linear_params,
    machine_info,
    measure_matmul_peak,
)
from tidal.bench.offline_report import format_report, write_plot  # noqa: F401
from tidal.bench.offline_systems import (  # noqa: F401  (re-exported for tests and scripts)
    _DESCRIPTION,
    ALL_SYSTEMS,
    ALL_WORKLOADS,
    DEFAULT_OUTPUT,
    DEFAULT_WORKLOADS,
    PEERS,
    RUNNERS,
    SYSTEM_LABELS,
    BenchContext,
    CpuMeter,
    StepRecord,
    SystemRunner,
    SystemUnavailable,
    Workload,
    installed_systems,
    make_workloads,
)
from tidal.common import flags as F
from tidal.common.machine import load_average
from tidal.common.progress import progress_lines
from tidal.common.results import command_line, run_stamp, write_json

CPU_DTYPES = ("bfloat16", "float32")  # what the CPU runs; --dtype auto resolves to one of them


# ============================================================================ the benchmark
@dataclass
class BenchOptions:
    workloads: Sequence[str] = DEFAULT_WORKLOADS
    systems: Sequence[str] | None = None  # None: every installed one
    repeats: int = 3
    dtype: str = "auto"  # auto: what tidal's engine picks on this CPU; the report holds the resolved name
    model: str | None = None
    output: str | None = DEFAULT_OUTPUT
    plot: str | None = None  # None: next to the JSON; "" : no plot
    num_requests: int | None = None
    output_len: int | None = None
    num_threads: int | None = None
    device: str = "cpu"  # cuda: tidal and transformers on the GPU (llama.cpp stays a CPU peer)
    async_scheduling: bool = False  # tidal's --async-scheduling (decode steps on CUDA graphs)
    seed: int = 0
    max_num_batched_tokens: int | None = None
    hf_cb_max_batch_tokens: int = 512
    hf_cb_page_size: int = 64
    hf_cb_max_requests: int | None = 16
    measure_peak: bool = True
    peak_square_n: int = 2048
    peak_samples: int = 5
    prefill_runs: bool = True
    command: str | None = None
    quiet: bool = False  # no progress lines (--no-progress, --quiet)


@dataclass
class BenchResult:
    report: dict[str, Any]
    generated: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)  # workload -> system -> ids
    text: str = ""


def _median(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _tidal_decode(steps: list[StepRecord]) -> tuple[int, float]:
    """Tokens and seconds of the decode-only steps (no prefill token in the step)."""
    toks, secs = 0, 0.0
    for s in steps:
        if s.num_prefill_tokens == 0 and s.num_decode_seqs > 0:
            toks += s.num_decode_seqs
            secs += s.time_s
    return toks, secs


def resolve_systems(requested: Sequence[str] | None) -> list[str]:
    if requested is None:
        return installed_systems()
    out = []
    for s in requested:
        s = s.strip()
        if not s:
            continue
        if s not in ALL_SYSTEMS:
            raise ValueError(f"unknown system {s!r} (known: {', '.join(ALL_SYSTEMS)})")
        if s not in out:
            out.append(s)
    if not out:
        raise ValueError("no system selected")
    return out


def run_benchmark(opts: BenchOptions) -> BenchResult:
    """Run every selected system on every selected workload; return the report (and write it)."""
    import torch

    from tidal.config import default_cpu_threads
    from tidal.engine.loader import load_checkpoint
    from tidal.engine.sizing import dtype_name

    requested = opts.dtype
    if opts.device != "cpu" and not (opts.device.startswith("cuda") and torch.cuda.is_available()):
        raise ValueError(f"--device {opts.device}: no CUDA device here (use --device cpu)")
    opts = replace(opts, dtype=dtype_name(requested, opts.device))  # "auto" as the engine resolves it there
    if opts.dtype not in CPU_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CPU_DTYPES)}, got {requested!r}")
    if opts.repeats < 1:
        raise ValueError("repeats must be >= 1")
    systems = resolve_systems(opts.systems)
    wl_names = []
    for w in opts.workloads:
        w = w.strip()
        if w not in ALL_WORKLOADS:
            raise ValueError(f"unknown workload {w!r} (known: {', '.join(ALL_WORKLOADS)})")
        if w and w not in wl_names:
            wl_names.append(w)
    threads = opts.num_threads or default_cpu_threads()
    torch.set_num_threads(threads)

    ckpt = load_checkpoint(opts.model)  # metadata only
    arch = ckpt.arch
    eos = arch.eos_token_ids[0] if arch.eos_token_ids else 0
    avoid = set(arch.eos_token_ids) | ({arch.bos_token_id} if arch.bos_token_id is not None else set())
    workloads = make_workloads(wl_names, arch.vocab_size, sorted(avoid), opts.seed, opts.num_requests,
                               opts.output_len)
    ctx = BenchContext(
        model_path=ckpt.path, dtype=opts.dtype, num_threads=threads, arch=arch, eos_token_id=eos, device=opts.device,
        async_scheduling=opts.async_scheduling,
        max_requests=max(w.num_requests for w in workloads),
        max_seq_len=max(max(w.prompt_lens) + w.output_len for w in workloads), workloads=workloads,
        max_num_batched_tokens=opts.max_num_batched_tokens, hf_cb_max_batch_tokens=opts.hf_cb_max_batch_tokens,
        hf_cb_page_size=opts.hf_cb_page_size, hf_cb_max_requests=opts.hf_cb_max_requests)

    command = opts.command or command_line("tidal bench offline")
    report: dict[str, Any] = {
        "command": command,
        **run_stamp(),  # date, tidal's version and commit (the performance page reads them)
        "machine": {**machine_info(threads, opts.dtype), "device": _device_name(opts.device)},
        "model": {"path": ckpt.path, "format": ckpt.format, "name": arch.name, "architecture": arch.architecture,
                  "num_params": arch.num_params(), "linear_params": linear_params(arch),
                  "hidden_size": arch.hidden_size, "num_layers": arch.num_layers, "vocab_size": arch.vocab_size},
        "options": {**{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in asdict(opts).items()
                       if k not in ("command", "quiet")}, "dtype_requested": requested},
        "systems": {},
        "workloads": {},
    }
    result = BenchResult(report)
    b_decode: dict[str, Any] | None = None
    runs_per = opts.repeats * (2 if opts.prefill_runs else 1) + 1
    prog = progress_lines(len(workloads) * len(systems) * runs_per, enabled=not opts.quiet)

    # ---------------------------------------------------------------- machine peak
    peak_runs: list[dict[str, Any]] = []

    def measure_peak(when: str) -> None:
        prog.line(f"measuring matmul peak ({opts.dtype}, {when})", count=False)
        meter = CpuMeter()
        meter.start()
        pk = measure_matmul_peak(arch.hidden_size, opts.dtype, square_n=opts.peak_square_n,
                                 samples=opts.peak_samples)
        pk["when"], pk["other_cores"] = when, meter.other_cores()
        peak_runs.append(pk)

    if opts.measure_peak:
        measure_peak("before the runs")

    # ---------------------------------------------------------------- load
    runners: dict[str, SystemRunner] = {}
    for name in systems:
        runner = RUNNERS[name](ctx)
        prog.line(f"loading {name}", count=False)
        t0 = time.perf_counter()
        try:
            runner.load()
        except SystemUnavailable as e:
            report["systems"][name] = {"status": "skipped", "reason": str(e), "label": SYSTEM_LABELS[name]}
            prog.line(f"{name}: skipped ({e})", count=False)
            continue
        except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
            reason = f"load failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            report["systems"][name] = {"status": "skipped", "reason": reason, "label": SYSTEM_LABELS[name]}
            prog.line(f"{name}: skipped ({reason})", count=False)
            if name == "tidal":
                raise
            continue
        runner.load_s = time.perf_counter() - t0
        runners[name] = runner
        report["systems"][name] = {"status": "ok", "label": SYSTEM_LABELS[name], "notes": runner.notes,
                                   "load_s": runner.load_s, "settings": runner.settings()}
    torch.set_num_threads(threads)  # loaders may have touched it
    prog.total = len(workloads) * len(runners) * runs_per

    # ---------------------------------------------------------------- run
    try:
        for w in workloads:
            rows: dict[str, dict[str, Any]] = {}
            raw: dict[str, dict[str, Any]] = {}
            failed: dict[str, str] = {}
            generated: dict[str, list[list[int]]] = {}
            warm_prompts = w.prompts[: min(2, w.num_requests)]
            for name, runner in runners.items():
                try:
                    runner.generate(warm_prompts, min(4, w.output_len))
                    prog.line(f"workload {w.name}: {name} warm-up")
                except Exception as e:  # noqa: BLE001
                    failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                    prog.line(f"workload {w.name}: {name} FAILED in warm-up: {failed[name]}")
                raw[name] = {"wall": [], "prefill": [], "tokens": [], "dec_toks": [], "dec_secs": [], "steps": [],
                             "other_cores": []}
            names = list(runners)
            for rep in range(opts.repeats):
                k = rep % len(names)  # rotate who goes first, so no system always follows the same one
                for name in names[k:] + names[:k]:
                    runner = runners[name]
                    if name in failed:
                        continue
                    r = raw[name]
                    meter = CpuMeter()
                    meter.start()
                    try:
                        out = runner.generate(w.prompts, w.output_len)
                    except Exception as e:  # noqa: BLE001
                        failed[name] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                        prog.line(f"workload {w.name} rep {rep + 1}: {name} FAILED: {failed[name]}")
                        continue
                    r["wall"].append(out.wall_s)
                    r["other_cores"].append(meter.other_cores())
                    r["tokens"].append(out.num_output_tokens)
                    generated[name] = out.token_ids
                    if out.steps is not None:
                        dt, ds = _tidal_decode(out.steps)
                        r["dec_toks"].append(dt)
                        r["dec_secs"].append(ds)
                        r["steps"].extend(out.steps)
                    oc = r["other_cores"][-1]
                    prog.line(f"workload {w.name} rep {rep + 1}/{opts.repeats}: {name:8s} "
                              f"{out.wall_s:8.2f} s  {out.num_output_tokens / out.wall_s:9.1f} out tok/s"
                              + (f"  (other processes: {oc:.2f} cores)" if oc is not None else ""))
                    if opts.prefill_runs:
                        try:
                            pre = runner.generate(w.prompts, 1)
                            r["prefill"].append(pre.wall_s)
                            prog.line(f"workload {w.name} rep {rep + 1}/{opts.repeats}: {name:8s} "
                                      f"prefill-only {pre.wall_s:8.2f} s")
                        except Exception as e:  # noqa: BLE001
                            prog.line(f"workload {w.name}: {name} prefill-only run failed: {e}")
            for name in runners:
                rows[name] = _summarize(name, w, raw[name], failed.get(name), generated)
            if w.name == "b" and "tidal" in raw:
                b_decode = _collect_b_decode(raw["tidal"]["steps"], w.num_requests, arch)
            report["workloads"][w.name] = {**w.summary(), "results": rows, "ratios": _ratios(rows)}
            result.generated[w.name] = generated
            if opts.output:  # a partial report after each workload: a long run killed midway keeps its results
                write_json({**report, "partial": True}, opts.output)
    finally:
        for runner in runners.values():
            runner.close()
        gc.collect()

    if opts.measure_peak:
        measure_peak("after the runs")
        report["peak"] = combine_peaks(peak_runs)
    report["machine"]["loadavg_end"] = load_average()
    report["peak_fraction"] = _peak_fraction(report.get("peak"), b_decode, workloads)
    result.text = format_report(report)
    if opts.output:
        out_dir = os.path.dirname(os.path.abspath(opts.output))
        os.makedirs(out_dir, exist_ok=True)
        plot_path = opts.plot if opts.plot is not None else os.path.splitext(opts.output)[0] + ".png"
        if plot_path:
            _try_plot(report, plot_path)
        report["output"] = opts.output
        write_json(report, opts.output)
    elif opts.plot:
        _try_plot(report, opts.plot)
    return result


def _try_plot(report: dict[str, Any], path: str) -> None:
    try:
        write_plot(report, path)
        report["plot"] = path
    except Exception as e:  # noqa: BLE001 - a chart must not lose the measurements
        report["plot_error"] = f"{type(e).__name__}: {e}"
        print(f"tidal bench offline: could not write the plot {path}: {e}", file=sys.stderr)


def _summarize(name: str, w: Workload, r: dict[str, Any], failure: str | None,
               generated: dict[str, list[list[int]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"system": name}
    if not r["wall"]:
        row.update(status="failed", reason=failure or "no run completed")
        return row
    wall = _median(r["wall"])
    tokens = r["tokens"][-1]
    row.update(
        status="ok" if all(t == w.expected_output_tokens for t in r["tokens"]) else "wrong_length",
        wall_s=wall, wall_s_all=r["wall"], output_tokens=tokens, output_tokens_all=r["tokens"],
        expected_output_tokens=w.expected_output_tokens, output_tok_s=tokens / wall,
    )
    oc = [x for x in r["other_cores"] if x is not None]
    row["other_cores_all"] = oc
    row["other_cores_median"] = _median(oc)
    if failure:
        row["reason"] = f"failed in a later repeat: {failure}"
    decode_tokens = tokens - w.num_requests  # the first token of each request comes out of its prefill
    pre = _median(r["prefill"])
    if pre is not None:
        row["prefill_s"] = pre
        row["prefill_s_all"] = r["prefill"]
        row["decode_tok_s_est"] = decode_tokens / (wall - pre) if wall > pre and decode_tokens > 0 else None
    if r["dec_secs"]:
        rates = [t / s for t, s in zip(r["dec_toks"], r["dec_secs"], strict=True) if s > 0]
        row["decode_tok_s"] = _median(rates)
        row["decode_tok_s_all"] = rates
        row["decode_method"] = "decode-only engine steps: their tokens / their summed step time"
        steps = r["steps"]
        row["num_steps"] = len(steps) // max(1, len(r["wall"]))
        row["decode_step_s_median"] = _median([s.time_s for s in steps if s.num_prefill_tokens == 0])
    else:
        row["decode_tok_s"] = row.get("decode_tok_s_est")
        row["decode_method"] = "(output - 1 per request) / (wall - prefill-only wall)"
    if name != "tidal" and "tidal" in generated and name in generated:
        ref, mine = generated["tidal"], generated[name]
        same = sum(1 for a, b in zip(ref, mine, strict=False) if a == b)
        prefix = [_common_prefix(a, b) for a, b in zip(ref, mine, strict=False)]
        row["greedy_match_requests"] = same
        row["greedy_match_mean_prefix"] = sum(prefix) / len(prefix) if prefix else 0
    return row


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    t = rows.get("tidal")
    if not t or t.get("status") not in ("ok", "wrong_length"):
        return {}
    out: dict[str, Any] = {"output_tok_s": {}, "decode_tok_s_est": {}}
    best: tuple[str, float] | None = None
    for name, row in rows.items():
        if name == "tidal" or row.get("status") not in ("ok", "wrong_length"):
            continue
        out["output_tok_s"][name] = t["output_tok_s"] / row["output_tok_s"]
        if t.get("decode_tok_s_est") and row.get("decode_tok_s_est"):
            out["decode_tok_s_est"][name] = t["decode_tok_s_est"] / row["decode_tok_s_est"]
        if name in PEERS and (best is None or row["output_tok_s"] > best[1]):
            best = (name, row["output_tok_s"])
    if best is not None:
        out["best_peer"] = best[0]
        out["tidal_over_best_peer"] = t["output_tok_s"] / best[1]
    return out


def _peak_fraction(peak: dict[str, Any] | None, b_decode: dict[str, Any] | None,
                   workloads: list[Workload]) -> dict[str, Any]:
    """FLOP/s of tidal's decode steps at the batch of workload b, against the measured matmul peaks."""
    if peak is None:
        return {"status": "skipped", "reason": "matmul peak not measured"}
    wb = next((w for w in workloads if w.name == "b"), None)
    if wb is None:
        return {"status": "skipped", "reason": "workload b not run"}
    if b_decode is None:
        return {"status": "skipped", "reason": f"no tidal decode-only step at batch {wb.num_requests}"}
    return {"status": "ok", "batch": wb.num_requests, **b_decode,
            "flops_formula": "2 * linear params (incl. lm_head) * batch + 4 * context * heads * head_dim * layers "
                             "per sequence",
            "fraction_of_square_peak": b_decode["gflops"] / peak["square"]["gflops"],
            "fraction_of_skinny_peak": b_decode["gflops"] / peak["skinny"]["gflops"]}


def _collect_b_decode(steps: list[StepRecord], batch: int, arch) -> dict[str, Any] | None:
    dec = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_seqs == batch]
    if not dec:
        return None
    t = statistics.median(s.time_s for s in dec)
    mean_ctx = sum(s.sum_context for s in dec) / len(dec) / batch
    flops = decode_step_flops(arch, batch, mean_ctx * batch)
    return {"num_steps": len(dec), "median_step_s": t, "mean_context": mean_ctx, "flops_per_step": flops,
            "linear_flops_per_step": 2.0 * linear_params(arch) * batch, "gflops": flops / t / 1e9}


# ============================================================================ command line
def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", type=_csv, default=list(DEFAULT_WORKLOADS),
                   help="comma-separated subset of a,b,c (default: a,b,c)")
    p.add_argument("--systems", type=_csv, default=None,
                   help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default: every installed one)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system and workload; the median is reported")
    p.add_argument("--output-len", type=int, default=None, help="override the 128 output tokens per request")
    p.add_argument("--hf-cb-max-batch-tokens", type=int, default=512,
                   help="transformers generate_batch max_batch_tokens (default 512, tidal's step budget)")
    p.add_argument("--hf-cb-page-size", type=int, default=64, help="transformers generate_batch page_size")
    p.add_argument("--hf-cb-max-requests", type=int, default=16,
                   help="transformers generate_batch max_requests_per_batch (default 16: on CPU its sdpa path "
                        "attends every query to the whole batch's KV under a mask, so cost grows with the "
                        "square of the batch; 0 = the largest workload's batch)")
    p.add_argument("--no-peak", action="store_true", help="skip the matmul peak measurement")
    p.add_argument("--no-prefill-runs", action="store_true",
                   help="skip the prefill-only runs (no decode estimate for the peers)")
    F.add_engine_flags(p, only=("model", "dtype", "num_threads", "device", "async_scheduling"),
                       choices={"dtype": ("auto", *CPU_DTYPES)},
                       defaults={"device": "cpu"},
                       helps={"dtype": "weights/activations dtype of every system; auto: what tidal's engine "
                                       "picks on this CPU (bfloat16 where native and timed faster, else float32)",
                              "num_threads": "CPU threads for every system (default: all cores)",
                              "device": "cpu (default) or cuda[:N]: tidal and transformers on that GPU; llama.cpp "
                                        "always runs on the CPU"})
    F.add_scheduler_flags(p, only=("max_num_batched_tokens",),
                          helps={"max_num_batched_tokens": "tidal's step token budget (default: the offline LLM's, 2048)"})
    F.add_workload_flags(p, only=("num_requests", "seed"),
                         helps={"num_requests": "override the request count of workloads a and b",
                                "seed": "seed of the random prompts"})
    g = F.add_output_flags(p, DEFAULT_OUTPUT, aliases={"no_progress": ["--quiet"]},
                           helps={"output": "JSON report path (default: results/offline.json)",
                                  "no_plots": "no PNG chart (as --plot '')"})
    g.add_argument("--plot", default=None, help="PNG chart path (default: next to the JSON; '' for none)")


def _device_name(device: str) -> str:
    import torch

    return "cpu" if device == "cpu" else f"{device} ({torch.cuda.get_device_name(torch.device(device))})"


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        workloads=args.workloads, systems=args.systems, repeats=args.repeats, dtype=args.dtype, model=args.model,
        output=args.output or None, plot="" if args.no_plots else args.plot, num_requests=args.num_requests,
        output_len=args.output_len, num_threads=args.num_threads, seed=args.seed, device=args.device,
        async_scheduling=bool(args.async_scheduling),
        max_num_batched_tokens=args.max_num_batched_tokens, hf_cb_max_batch_tokens=args.hf_cb_max_batch_tokens,
        hf_cb_page_size=args.hf_cb_page_size, hf_cb_max_requests=args.hf_cb_max_requests,
        measure_peak=not args.no_peak, prefill_runs=not args.no_prefill_runs, quiet=args.no_progress)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="offline throughput: tidal vs transformers and llama.cpp",
                       description=_DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable()  # a crash in a peer's native code (or its thread) leaves a traceback
    _note_signals()
    try:
        opts = options_from_args(args)
        result = run_benchmark(opts)
    except ValueError as e:
        print(f"tidal bench offline: error: {e}", file=sys.stderr)
        return 2
    print(result.text)
    if opts.output:
        print(f"\nwrote {opts.output}" + (f" and {result.report['plot']}" if result.report.get("plot") else ""))
    return 0


def _note_signals() -> None:
    """Say so on stderr when a signal ends a (long) run, instead of dying without a word."""
    import signal

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        print(f"tidal bench offline: stopped by {name} (the JSON holds the workloads finished so far)",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread / not on this platform
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, on_signal)


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/offline_throughput.py ...`` == ``tidal bench offline ...``."""
    p = argparse.ArgumentParser(prog="offline_throughput", description=_DESCRIPTION)
    add_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING))
    return run(args)


__all__ = [
    "BenchOptions", "BenchResult", "Workload", "add_arguments", "add_parser", "decode_step_flops",
    "linear_params", "main", "make_workloads", "measure_matmul_peak", "run", "run_benchmark",
]
