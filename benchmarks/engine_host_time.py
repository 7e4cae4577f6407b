"""The engine's host time per decode step: ``LLMEngine.step``'s wall time less the model runner's
(``StepResult.step_time_s``), i.e. scheduling, token bookkeeping and the output side (detokenization,
outputs), for a batch of decodes, with outputs streamed every step and with final-only outputs
(``LLM.generate``'s: one output per request, text decoded once at its end).

On a GPU this time is not hidden behind the model: an H200 ran an 8B model's batch-32 decode step in
~6 ms of GPU time with ~1.2 ms of host time after it (``benchmarks/gpu_check.py``'s steps stage).

    .venv/bin/python benchmarks/engine_host_time.py [--model PATH] [--batches 1,32] [--steps 60] [--output PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

PROG = "benchmarks/engine_host_time.py"


def measure(engine, batch: int, steps: int, final_only: bool, seed: int) -> dict:
    """Median host and runner milliseconds over ``steps`` decode steps of ``batch`` requests."""
    from tidal import SamplingParams

    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    for i in range(batch):
        engine.add_request(f"{final_only}-{batch}-{i}", None,
                           SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True),
                           prompt_token_ids=[rng.randrange(100, vocab) for _ in range(64)], final_only=final_only)
    host, runner = [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        comp = engine.last_result.composition
        if comp.num_prefill_tokens == 0 and comp.num_decode_seqs == batch and len(host) < steps:
            host.append(wall - engine.last_result.step_time_s)
            runner.append(engine.last_result.step_time_s)
    return {"host_ms_median": round(1e3 * statistics.median(host), 3),
            "runner_ms_median": round(1e3 * statistics.median(runner), 3), "steps": len(host)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a checkpoint (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=60, help="decode steps timed per batch and mode")
    ap.add_argument("--repeats", type=int, default=3, help="each batch and mode this many times, interleaved")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated integers, not {args.batches!r}")
    if any(b < 1 for b in batches) or args.steps < 1 or args.repeats < 1:
        ap.error("--batches, --steps and --repeats must be >= 1")

    from tidal.common.machine import machine_info
    from tidal.common.results import command_line, write_result
    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(model=args.model, device=args.device, dtype=args.dtype,
                                                max_num_seqs=max(batches), max_num_batched_tokens=4096))
    cmd = command_line(PROG, argv if argv is not None else sys.argv[1:])
    machine = machine_info(device=args.device, dtype=str(engine.model.dtype).removeprefix("torch."))
    print(f"command: {cmd}\nmachine: {machine.get('cpu_model')}, {machine.get('cores', '?')} cores, "
          f"device {args.device}, dtype {machine['dtype']}", flush=True)
    rows = []
    for b in batches:
        for mode in ("streamed", "final-only"):
            reps = [measure(engine, b, args.steps, mode == "final-only", seed=r) for r in range(args.repeats)]
            row = {"batch": b, "outputs": mode,
                   "host_ms_median": round(statistics.median(r["host_ms_median"] for r in reps), 3),
                   "runner_ms_median": round(statistics.median(r["runner_ms_median"] for r in reps), 3),
                   "repeats": reps}
            rows.append(row)
            print(f"batch {b:>3}  {mode:<10}  host {row['host_ms_median']:7.3f} ms a step  "
                  f"(runner {row['runner_ms_median']:.3f} ms)", flush=True)
    if args.output:
        write_result({"benchmark": PROG, "command": cmd, "machine": machine, "rows": rows}, args.output, plots=False)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
