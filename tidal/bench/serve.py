"""``tidal bench serve``: TTFT, TPOT, ITL, SLO attainment, goodput and capacity of a live server.

Works against any OpenAI-compatible server (tidal, vLLM, llama.cpp). It builds a workload
(:mod:`tidal.workload`), sends it with the streaming client (:mod:`tidal.bench.client`) and
summarizes the records with the shared metric definitions (:mod:`tidal.metrics`), then writes
a JSON report (summary, config, machine, command, per-request records) and PNG plots
(:mod:`tidal.common.plots`) and prints a summary table.

With ``--capacity-search`` it finds the highest request rate whose SLO attainment is at least
``--target-attainment``: every probe replays the same requests (same lengths and prompts, same
arrival pattern rescaled to the probe's average rate), bounded by ``--num-requests`` or
``--duration``; every probe is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from tidal import metrics as M
from tidal import workload as W
from tidal.bench.client import BenchError, ClientOptions, check_server, normalize_base_url
from tidal.bench.client import run as run_client
from tidal.common import flags as F
from tidal.common.machine import machine_info
from tidal.common.progress import progress_bar
from tidal.common.results import command_line, run_command, write_result

DEFAULT_OUTPUT = os.path.join("results", "serve.json")
DEFAULT_NUM_REQUESTS = 100
PROG = "tidal bench serve"


# ============================================================================ arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    g.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may end before max_tokens)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--request-timeout", type=F.positive_float, default=600.0, help="seconds one request may take")

    g = F.add_workload_flags(p, helps={
        "num_requests": f"requests per run or probe (default {DEFAULT_NUM_REQUESTS} unless --duration)",
        "duration": "seconds of arrivals per run or probe; requests still running --drain-timeout later "
                    "are cancelled and count as failed"})
    g.add_argument("--max-concurrency", type=F.positive_int, default=None, help="most requests in flight")
    g.add_argument("--tokenizer", default="default",
                   help="'default' (tidal's default model), an HF tokenizer dir or .gguf file, or 'none' "
                        "(approximate text prompts)")
    g.add_argument("--prompt-format", choices=["auto", "ids", "text"], default="auto",
                   help="ids: token-id arrays (completions only); text: text of exact token length; "
                        "auto: ids for completions with a tokenizer, else text")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="with --duration: seconds to wait for running requests after the last arrival")
    g.add_argument("--warmup-requests", type=int, default=1, help="short requests sent before measuring")

    F.add_slo_flags(p)
    F.add_output_flags(p, DEFAULT_OUTPUT)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="online serving benchmark: TTFT, TPOT, ITL, SLO attainment, goodput, capacity",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


# ============================================================================ helpers
def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "func" and not callable(v)}


class _Tok:
    """Adapter of a tidal/HF tokenizer to :class:`tidal.workload.TokenizerLike`."""

    def __init__(self, tok: Any, name: str):
        self.tok = tok
        self.name = name
        hf = getattr(tok, "hf", tok)
        self.vocab_size = len(hf)
        self.special_ids = [int(i) for i in getattr(hf, "all_special_ids", [])]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Any) -> str:
        return self.tok.decode(list(ids))


def load_tokenizer(spec: str) -> _Tok | None:
    if spec == "none":
        return None
    try:
        if spec == "default":
            from tidal.engine.loader import load_checkpoint
            from tidal.engine.tokenizer import Tokenizer

            ckpt = load_checkpoint(None)
            return _Tok(Tokenizer.from_checkpoint(ckpt), ckpt.arch.name)
        if os.path.isdir(spec):
            from transformers import AutoTokenizer

            return _Tok(AutoTokenizer.from_pretrained(spec), os.path.basename(spec.rstrip("/")))
        from tidal.engine.loader import load_checkpoint
        from tidal.engine.tokenizer import Tokenizer

        return _Tok(Tokenizer.from_checkpoint(load_checkpoint(spec)), os.path.basename(spec))
    except BenchError:
        raise
    except Exception as e:  # model files, transformers: one line, not a traceback
        raise BenchError(f"cannot load tokenizer {spec!r}: {' '.join(str(e).split())[:300]}") from None


def _validate(args: argparse.Namespace) -> tuple[M.SLO, dict[str, Any]]:
    slo = M.parse_slo(args.slo)
    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise BenchError(f"--extra-body is not JSON: {e.msg}") from None
        if not isinstance(extra, dict):
            raise BenchError("--extra-body must be a JSON object")
    if args.trace is not None and not os.path.isfile(args.trace):
        raise BenchError(f"trace file not found: {args.trace}")
    if args.dataset is not None and not os.path.isfile(args.dataset):
        raise BenchError(f"dataset file not found: {args.dataset}")
    if args.tokenizer not in ("default", "none") and not os.path.exists(args.tokenizer):
        raise BenchError(f"tokenizer not found: {args.tokenizer}")
    F.check_capacity_flags(args)
    if args.endpoint == "chat" and args.prompt_format == "ids":
        raise BenchError("--prompt-format ids needs --endpoint completions (chat messages are text)")
    if args.tokenizer == "none" and args.prompt_format == "ids":
        raise BenchError("--prompt-format ids needs a tokenizer (--tokenizer default or a path)")
    if args.warmup_requests < 0:
        raise BenchError("--warmup-requests must be >= 0")
    return slo, extra


def _workload_options(args: argparse.Namespace, rate: float | None, num: int | None) -> W.WorkloadOptions:
    # capacity probes are bounded by --duration when they run, not when the base workload is made
    return F.workload_options(args, rate=rate, num_requests=num,
                              duration_s=args.duration if not args.capacity_search else None)


# ============================================================================ running
def _run_once(specs: list[W.RequestSpec], copts: ClientOptions, slo: M.SLO, desc: str, progress: bool
              ) -> tuple[list[M.RequestRecord], dict[str, Any]]:
    with progress_bar(len(specs), desc, "req", progress) as bar:
        records, duration = run_client(specs, copts, lambda rec: bar.update(1))
    return records, M.summarize(records, duration, slo)


def _warmup(specs: list[W.RequestSpec], copts: ClientOptions, n: int, tok: _Tok | None, fmt: str, seed: int) -> None:
    """``n`` short requests of the workload's first prompt lengths, with prompts of their own (a
    different seed): the measured prompts stay out of the server's prefix cache."""
    if n <= 0 or not specs:
        return
    base = [W.RequestSpec(0.0, specs[i % len(specs)].prompt_len, min(specs[i % len(specs)].output_len, 4))
            for i in range(n)]
    probe = W.materialize(base, tok, fmt, seed=seed + 1, special_ids=tok.special_ids if tok else ())
    records, _ = run_client(probe, replace(copts, time_limit_s=None, max_concurrency=None))
    bad = [r for r in records if not r.success]
    if bad:
        raise BenchError(f"test request to {copts.url} failed: {bad[0].error}")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    slo, extra = _validate(args)
    base_url = normalize_base_url(args.base_url)
    num = args.num_requests
    if num is None and args.duration is None:
        num = DEFAULT_NUM_REQUESTS
    # lengths and arrivals first: bad workloads and trace files fail before any traffic
    wl_rate, wl_n = args.rate, num
    if args.capacity_search:  # one base workload (at 1 req/s, or the trace's times) rescaled per probe
        wl_rate = None if args.trace else 1.0
        if wl_n is None:  # duration-bounded probes: enough arrivals for the highest rate
            wl_n = int(math.ceil(args.search_high * args.duration * 1.5)) + 16
    lengths = W.make_requests(_workload_options(args, wl_rate, wl_n))
    models = check_server(base_url)
    model = args.model or (models[0] if models else None)
    if not model:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    tok = load_tokenizer(args.tokenizer)
    fmt = args.prompt_format
    if fmt == "auto":
        fmt = "ids" if tok is not None and args.endpoint == "completions" else "text"
    if args.workload == "alpaca-real" and tok is not None:  # real output lengths need the tokenizer
        lengths = W.make_requests(_workload_options(args, wl_rate, wl_n), tok)
    specs = W.materialize(lengths, tok, fmt, seed=args.seed, special_ids=tok.special_ids if tok else ())
    copts = ClientOptions(base_url=base_url, model=model, endpoint=args.endpoint, temperature=args.temperature,
                          ignore_eos=args.ignore_eos, max_concurrency=args.max_concurrency,
                          request_timeout_s=args.request_timeout,
                          time_limit_s=args.duration, drain_s=args.drain_timeout, extra_body=extra, tokenizer=tok)
    _warmup(specs, copts, args.warmup_requests, tok, fmt, args.seed)
    print(f"{PROG}: {model} at {base_url} ({args.endpoint}), workload "
          f"{args.workload or 'trace ' + str(args.trace)}, {len(specs)} requests, prompts as {fmt}"
          f"{' (tokenizer ' + tok.name + ')' if tok else ''}", file=sys.stderr)
    progress = not args.no_progress
    cluster_before = cluster_state(base_url)
    search_report = None
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if args.capacity_search:
        search = F.capacity_search(args)
        by_rate: dict[float, tuple[list[M.RequestRecord], dict[str, Any], list[W.RequestSpec]]] = {}
        while (rate := search.next_rate()) is not None:
            probe_specs = W.specs_at_rate(specs, rate, args.duration)
            records, summary = _run_once(probe_specs, copts, slo, f"rate {rate:.3g}/s", progress)
            search.record(rate, summary["slo_attainment"] or 0.0, summary)
            by_rate[rate] = (records, summary, probe_specs)
            print(f"  probe {len(search.probes)}: rate {rate:.4g} req/s -> attainment "
                  f"{summary['slo_attainment'] or 0:.1%} ({'pass' if search.probes[-1].passed else 'fail'})",
                  file=sys.stderr)
        search_report = search.report()
        shown = search.capacity if search.capacity is not None else search.probes[0].rate
        records, summary, used = by_rate[shown]
        summary = dict(summary, rate=shown)
    else:
        records, summary = _run_once(specs, copts, slo, "requests", progress)
        used = specs
        summary = dict(summary, rate=args.rate if args.rate is not None else (None if args.trace else "inf"))
    wl = {"name": args.workload or f"trace {os.path.basename(args.trace)}", "trace": args.trace, "prompt_format": fmt,
          "tokenizer": tok.name if tok else None, **W.length_stats(used)}
    result: dict[str, Any] = {
        **summary,
        "model": model,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "workload": wl,
        "capacity_search": search_report,
        "started_at": started,
        "config": _config(args),
        "machine": machine_info(),
        "command": command_line(PROG),
        "requests": [r.to_dict() for r in attach_placements(records, base_url)],
    }
    instances = instance_breakdown(cluster_before, cluster_state(base_url))
    if instances is not None:
        result["instances"] = instances
    return result


def cluster_state(base_url: str) -> dict[str, Any] | None:
    """The server's cluster section of ``/admin/state`` (tidal with several instances), else None."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/admin/state", timeout=10)
        cluster = r.json().get("cluster") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return cluster if isinstance(cluster, dict) and isinstance(cluster.get("instances"), list) else None


def attach_placements(records: list[M.RequestRecord], base_url: str) -> list[M.RequestRecord]:
    """Each record's placement as the server logged it (``/admin/splits`` of a tidal cluster in
    ``--mode split``: its pair, split point and KV moved), joined on the response id."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/admin/splits", timeout=10)
        log = r.json().get("splits") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return records
    by_id = {e.get("request_id"): e for e in log or [] if isinstance(e, dict)}
    for rec in records:
        if rec.response_id in by_id:
            rec.placement = by_id[rec.response_id]
    return records


def instance_breakdown(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """Per instance, what this run did there: requests dispatched, hand-offs received, failures and
    restarts (differences of the server's counters), and its KV use and step time at the end."""
    if after is None:
        return None
    prev = {i["index"]: i for i in (before or {}).get("instances", [])}
    out = []
    for inst in after["instances"]:
        b = prev.get(inst["index"], {})
        out.append({"index": inst["index"], "role": inst.get("role"), "alive": inst.get("alive"),
                    **{k: inst.get(k, 0) - b.get(k, 0) for k in ("dispatched", "handoffs_in", "failures", "restarts")},
                    "kv_usage_end": inst.get("kv_usage"), "step_time_ema_s": inst.get("step_time_ema_s")})
    return out


# ============================================================================ reporting
def _f(x: Any, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    return format(x, spec)


def format_summary(r: dict[str, Any]) -> str:
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value: Any, spec: str = ".2f") -> None:
        lines.append(f"{label:<36}{_f(value, spec):>14}")

    lines.append(f"model: {r['model']}  ({r['base_url']}, {r['endpoint']})")
    wl = r["workload"]
    rate = r.get("rate")
    convs = f" in {wl['conversations']} conversations" if wl.get("conversations") else ""
    lines.append(f"workload: {wl['name']}, {wl['num_requests']} requests{convs}, prompts as {wl['prompt_format']}, "
                 f"rate {'trace times' if rate is None else rate}{' conversations/s' if convs else ''}"
                 + (f" x{r['config']['time_scale']:g}" if rate is None and r["config"].get("time_scale") else ""))
    row("Successful requests:", r["completed"], "d")
    row("Failed requests:", r["failed"], "d")
    row("Benchmark duration (s):", r["duration_s"])
    row("Total input tokens:", r["total_input_tokens"], "d")
    row("Total generated tokens:", r["total_output_tokens"], "d")
    row("Request throughput (req/s):", r["request_throughput"])
    row("Output token throughput (tok/s):", r["output_throughput"])
    row("Total token throughput (tok/s):", r["total_token_throughput"])
    if r.get("cached_prompt_share") is not None:  # the server reported its prefix cache's hits
        row("Prompt tokens cached (%):", 100 * r["cached_prompt_share"])
    lines.append("{s:{c}^{n}}".format(s=" SLO ", n=w, c="-"))
    lines.append(f"SLOs: {', '.join(f'{k} <= {v:g} ms' for k, v in r['slo'].items()) or 'none (attain = succeed)'}")
    att = r["slo_attainment"]
    row("SLO attainment (%):", None if att is None else 100 * att)
    for k, v in (r.get("slo_attainment_by_metric") or {}).items():
        row(f"  meeting {k} (%):", None if v is None else 100 * v)
    row("Goodput (req/s):", r["goodput"]["request_throughput"])
    row("Goodput (output tok/s):", r["goodput"]["output_throughput"])
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        d = r[key]
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=w, c="-"))
        short = key.split("_")[0].upper()
        row(f"Mean {short} (ms):", d["mean"])
        row(f"Median {short} (ms):", d["p50"])
        row(f"P90 {short} (ms):", d["p90"])
        row(f"P99 {short} (ms):", d["p99"])
    cs = r.get("capacity_search")
    if cs:
        lines.append("{s:{c}^{n}}".format(s=" Capacity search ", n=w, c="-"))
        lines.append(f"target attainment {cs['target_attainment']:.0%}; {cs['note']}")
        for p in cs["probes"]:
            lines.append(f"  rate {p['rate']:>9.4g} req/s   attainment {100 * p['attainment']:6.1f}%   "
                         f"{'pass' if p['passed'] else 'fail'}")
        cap = cs["capacity_rps"]
        row("Capacity (req/s):", cap, ".3g")
    if r.get("instances"):
        lines.append("{s:{c}^{n}}".format(s=" Instances ", n=w, c="-"))
        for i in r["instances"]:
            lines.append(f"  {i['index']} {i['role'] or '':<10} dispatched {i['dispatched']:>5}  hand-offs in "
                         f"{i['handoffs_in']:>4}  failures {i['failures']}  KV {_f(100 * (i['kv_usage_end'] or 0), '.0f')}%")
    if r.get("errors"):
        lines.append("{s:{c}^{n}}".format(s=" Errors ", n=w, c="-"))
        for msg, n in r["errors"].items():
            lines.append(f"  {n} x {msg}")
    lines.append("=" * w)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def work() -> tuple[dict[str, Any], list[str]]:
        result = run_benchmark(args)
        return result, write_result(result, args.output, not args.no_plots, prog=PROG)

    def done(out: tuple[dict[str, Any], list[str]]) -> int:
        result, plots = out
        print(format_summary(result))
        print(f"wrote {args.output}" + (f" and {', '.join(plots)}" if plots else ""))
        return 0

    # BenchError; WorkloadError, SLOError and bad values of the pure modules are ValueErrors
    return run_command(PROG, work, done, (BenchError, ValueError))


def main(argv: list[str] | None = None) -> int:
    """``python -m tidal.bench.serve ...`` == ``tidal bench serve ...``."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["add_arguments", "add_parser", "format_summary", "load_tokenizer", "main", "run", "run_benchmark"]
