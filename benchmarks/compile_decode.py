"""Would ``torch.compile`` pay for tidal's decode step? The model's decode forward (embedding, every
layer with paged attention, LM head) on a synthetic batch of decodes, eager against compiled
(Inductor, one static-shape graph per batch size, ``fullgraph=True``), on the default model with
the engine's own dtype and weight choice (``--dtype``/``--quantization auto`` as ``tidal serve``).

For each batch size it prints the median forward time of both, the compile time of the first call,
and how far the compiled logits are from the eager ones (fusion changes the rounding: in bf16 the
greedy token can move). It measures the forward only: the engine's own per-step work (scheduling,
batch building, sampling) comes on top of both.

    .venv/bin/python benchmarks/compile_decode.py [--batch-sizes 1,4,32] [--context 256] [--output PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from tidal.common import flags as F
from tidal.common.machine import machine_info
from tidal.common.results import command_line, write_result

PROG = "benchmarks/compile_decode.py"


def _decode_batch(engine: Any, n: int, context: int) -> tuple:
    """``n`` decodes at position ``context``, each on its own blocks of the engine's KV pool, after
    a prefill of ``context`` random tokens."""
    import torch

    from tidal.engine.attention import AttentionBatch, DecodeGroup, PrefillSeq

    bs, dev = engine.kv_manager.block_size, engine.device
    width = context // bs + 1
    if n * width > engine.kv_manager.num_blocks:
        raise SystemExit(f"{PROG}: error: {n} decodes of {context} tokens need {n * width} KV blocks; "
                         f"the pool has {engine.kv_manager.num_blocks} (raise --kv-cache-memory)")
    tables = torch.arange(n * width, device=dev).view(n, width)
    gen = torch.Generator(device="cpu").manual_seed(0)
    model = engine.model
    for row in tables:  # a real context: each sequence's random prompt prefilled (eagerly) into its blocks
        p = torch.arange(context, device=dev)
        prompt = torch.randint(100, 40000, (context,), generator=gen).to(dev)
        pre = AttentionBatch(positions=p, slot_mapping=row[p // bs] * bs + p % bs, num_decodes=0, decode_groups=[],
                             prefills=[PrefillSeq(0, context, 0, row, None)], block_size=bs)
        model(model.embed(prompt), pre, engine.kv_cache.layers)
    pos = torch.full((n,), context, device=dev)
    slots = tables[:, context // bs] * bs + context % bs
    mask = (torch.arange(width * bs, device=dev).unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, width * bs)
    ids = torch.randint(100, 40000, (n,), generator=gen).to(dev)

    def forward(ids, pos, slots, tables, mask):
        batch = AttentionBatch(positions=pos, slot_mapping=slots, num_decodes=n,
                               decode_groups=[DecodeGroup(0, n, tables, mask)], prefills=[], block_size=bs)
        return model.compute_logits(model(model.embed(ids), batch, engine.kv_cache.layers))

    return forward, (ids, pos, slots, tables, mask)


def _median_ms(fn: Any, args: tuple, repeats: int, sync: Any) -> float:
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 32])
    p.add_argument("--context", type=int, default=256, help="tokens already in each decode's KV")
    p.add_argument("--repeats", type=int, default=30, help="timed forwards per batch size and mode (median kept)")
    F.add_engine_flags(p, defaults={"kv_cache_memory": "1GiB"})
    p.add_argument("--output", default="results/compile_decode.json")
    args = p.parse_args(argv)

    import torch

    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(**F.engine_kwargs(args)))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    machine = machine_info(dtype=str(engine.dtype).removeprefix("torch."), num_threads=torch.get_num_threads())
    command = command_line(PROG, argv if argv is not None else sys.argv[1:])
    print(f"command: {command}")
    print(f"machine: {machine.get('cpu_model')} ({machine.get('cores')} cores), torch {torch.__version__}, "
          f"device {engine.device}, engine: {engine.describe_weights()}")
    rows = []
    with torch.inference_mode():
        for n in args.batch_sizes:
            forward, inputs = _decode_batch(engine, n, args.context)
            eager_ms = _median_ms(forward, inputs, args.repeats, sync)
            print(f"[batch {n}] eager {eager_ms:.2f} ms; compiling ...", file=sys.stderr, flush=True)
            compiled = torch.compile(forward, dynamic=False, fullgraph=True)
            t0 = time.perf_counter()
            got = compiled(*inputs)
            sync()
            compile_s = time.perf_counter() - t0
            ref = forward(*inputs)
            compiled_ms = _median_ms(compiled, inputs, args.repeats, sync)
            eager_again = _median_ms(forward, inputs, args.repeats, sync)  # eager both sides of it: drift shows
            rows.append({"batch": n, "eager_ms": eager_ms, "eager_after_ms": eager_again, "compiled_ms": compiled_ms,
                         "speedup": statistics.mean([eager_ms, eager_again]) / compiled_ms, "compile_s": compile_s,
                         "max_abs_logit_diff": float((got.float() - ref.float()).abs().max()),
                         "greedy_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean())})
            print(f"[batch {n}] compiled {compiled_ms:.2f} ms after {compile_s:.0f} s of compile",
                  file=sys.stderr, flush=True)
    print(f"decode forward at context {args.context}, median of {args.repeats}:")
    print(f"{'batch':>6}{'eager ms':>10}{'(after)':>9}{'compiled':>10}{'speedup':>9}{'compile s':>11}"
          f"{'max |dlogit|':>14}{'greedy same':>13}")
    for r in rows:
        print(f"{r['batch']:>6}{r['eager_ms']:>10.2f}{r['eager_after_ms']:>9.2f}{r['compiled_ms']:>10.2f}"
              f"{r['speedup']:>8.2f}x{r['compile_s']:>11.0f}{r['max_abs_logit_diff']:>14.3g}{r['greedy_agree']:>12.0%}")
    write_result({"command": command, "machine": machine, "engine": engine.describe_weights(),
                  "context": args.context, "repeats": args.repeats, "rows": rows}, args.output, False, prog=PROG)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
