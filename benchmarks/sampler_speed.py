"""The sampler's time per step on this machine: ``Sampler.sample`` on random logits for a batch of sampled
rows (temperature only, top-k, top-p, seeded or not), at the default model's vocabulary (49,152) and
Llama 3's (128,256), beside greedy rows; and the default model's engine, greedy against sampled (output
tokens a second). A sampled request's step pays the sampler on top of the model's step (the OpenAI API
samples at temperature 1 unless a request says otherwise).

    .venv/bin/python benchmarks/sampler_speed.py [--batches 1,32] [--vocabs 49152,128256] [--repeats 7]
                                                 [--device cpu] [--output PATH]

``--tree DIR`` times the sampler of another checkout's ``tidal`` (e.g. the commit before a change) in the
same run, after this one's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PROG = "benchmarks/sampler_speed.py"
# logits: normal with this spread; "peaked" puts ~97 % of the mass on the likeliest 2 % of the vocabulary
# (a language model's next-token distribution is at least that peaked), "flat" ~48 % (a worst case)
SHAPES = {"peaked": 4.0, "flat": 2.0}
CONFIGS = {  # name -> SamplingParams keywords
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {"temperature": 0.8},
    "top-k 40": {"temperature": 0.8, "top_k": 40},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "top-p 0.9, seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 0},
}


def time_sampler(batches: list[int], vocabs: list[int], repeats: int, device: str) -> list[dict]:
    import torch

    from tidal.core.sampling import SamplingParams
    from tidal.engine.sampler import Sampler

    rows = []
    for vocab in vocabs:
        for batch in batches:
            for shape, scale in SHAPES.items():
                g = torch.Generator().manual_seed(vocab + batch)
                logits = (torch.randn(batch, vocab, generator=g) * scale).to(device)
                sampler = Sampler(0)
                ids = [f"r{i}" for i in range(batch)]
                setups = {name: [SamplingParams(**{**kw, **({"seed": i} if "seed" in kw else {})})
                                 for i in range(batch)]
                          for name, kw in CONFIGS.items() if shape == "peaked" or name != "greedy"}
                for params in setups.values():  # warm every setup first (the allocator grows its heap once)
                    sampler.sample(logits, ids, params)
                for name, params in setups.items():
                    times = []
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        sampler.sample(logits, ids, params)
                        times.append(time.perf_counter() - t0)
                    rows.append({"label": f"vocabulary {vocab:,}, batch {batch}, {shape} logits, {name}",
                                 "value": round(1e3 * statistics.median(times), 3), "unit": "ms"})
    return rows


def time_engine(batch: int, repeats: int, device: str) -> list[dict]:
    """The default model's engine on ``batch`` requests of 64 prompt tokens and 64 output tokens each (every
    token the model's step plus the sampler's): output tokens a second, greedy against sampled."""
    from tidal import SamplingParams
    from tidal.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(device=device, max_num_seqs=batch)
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(64)] for i in range(batch)]
    rows = []
    for name, kw in ENGINE_CONFIGS.items():
        walls = []
        for r in range(repeats + 1):  # the first warms
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(f"{name}-{r}-{i}", None, SamplingParams(max_tokens=64, ignore_eos=True, **kw),
                                   prompt_token_ids=p, final_only=True)
            while engine.has_unfinished_requests():
                engine.step()
            walls.append(time.perf_counter() - t0)
        rows.append({"label": f"default model, {batch} requests x 64 -> 64 tokens, {name}",
                     "value": round(batch * 64 / statistics.median(walls[1:]), 1), "unit": "out tok/s"})
    return rows


ENGINE_CONFIGS = {"greedy": {"temperature": 0.0}, "temperature 1.0": {"temperature": 1.0},
                  "top-p 0.9": {"temperature": 0.8, "top_p": 0.9}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--vocabs", default="49152,128256")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tree", default=None, help="also time this checkout's sampler (its tidal/), in the same run")
    ap.add_argument("--engine-batch", type=int, default=32,
                    help="also run the default model's engine on this many requests, greedy and sampled (0: no)")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # a --tree child: JSON rows out
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        vocabs = [int(v) for v in args.vocabs.split(",")]
    except ValueError:
        ap.error("--batches and --vocabs take comma-separated integers")
    if args.repeats < 1 or min(batches) < 1 or min(vocabs) < 2:
        ap.error("--repeats and --batches must be >= 1, --vocabs >= 2")
    import json

    import torch

    def measure() -> list[dict]:
        rows = time_sampler(batches, vocabs, args.repeats, args.device)
        return rows + (time_engine(args.engine_batch, 3, args.device) if args.engine_batch > 0 else [])

    if args.rows_only:
        print(json.dumps(measure()))
        return 0
    from tidal.common.machine import machine_info
    from tidal.common.results import command_line, write_figures

    cmd = command_line(PROG, argv if argv is not None else sys.argv[1:])
    machine = machine_info(num_threads=torch.get_num_threads(), device=args.device)
    print(f"command: {cmd}\nmachine: {machine.get('cpu_model')}, {machine.get('cores', '?')} cores, "
          f"device {args.device}, {torch.get_num_threads()} threads", flush=True)
    trees = {"this tree": measure()}
    if args.tree:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.tree)}
        child = [sys.executable, os.path.abspath(__file__), "--rows-only", "--batches", args.batches, "--vocabs",
                 args.vocabs, "--repeats", str(args.repeats), "--device", args.device, "--engine-batch",
                 str(args.engine_batch)]
        out = subprocess.run(child, env=env, cwd=os.path.abspath(args.tree), check=True, capture_output=True,
                             text=True)
        rev = subprocess.run(["git", "-C", args.tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        trees[f"tree {rev or args.tree}"] = json.loads(out.stdout.strip().splitlines()[-1])
    names = list(trees)
    figures = []
    for i, row in enumerate(trees[names[0]]):
        value = f"{row['value']:,} {row['unit']}"
        for n in names[1:]:
            other = trees[n][i]["value"]
            ratio = other / row["value"] if row["unit"] == "ms" else row["value"] / other
            value += f"; {n}: {other:,} {row['unit']} (this one {ratio:.1f}x as fast)"
        figures.append([row["label"], value])
    if not args.output:
        for label, value in figures:
            print(f"  {label}: {value}")
    else:
        write_figures(args.output, PROG, "Sampling: the sampler's time a step, and the engine greedy against sampled "
                      f"({args.device}, {torch.get_num_threads()} threads)",
                      PROG, figures, "Sampler.sample on random logits, median of "
                      f"{args.repeats}; peaked: normal logits x {SHAPES['peaked']}, flat: x {SHAPES['flat']}. The "
                      "engine rows: the default model, final-only outputs, median of 3 runs after one warm run.",
                      {"trees": trees})
    return 0


if __name__ == "__main__":
    sys.exit(main())
