"""``tidal bench soak --chaos`` in every mode, on processes and on Ray actors: a two-instance server
of the default model per mode (colocated, 1P1D, split, ``--kv-pressure drop`` and ``migrate``),
each soaked for ``--duration`` seconds at ``--multiple`` x its measured capacity while a random
worker is SIGKILLed every ``--chaos-interval`` seconds. Each server is started, soaked and stopped
by its pid, one at a time; after it stops, none of its processes may be left.

Writes one JSON (``benchmarks/results/...``) that ``tidal bench report`` puts on the performance
page, and prints each mode's summary. Usage::

    python benchmarks/chaos_soak.py --duration 60 --output benchmarks/results/NAME.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tidal.bench.chaos import descendants, process_state
from tidal.common.machine import machine_info
from tidal.common.results import run_stamp, write_json
from tidal.experiments.server_proc import serve, stop

COMMON = ["--instances", "2", "--threads-per-instance", "1", "--max-num-seqs", "8", "--max-queued-requests", "16"]
MODES = {  # mode: its flags (a KV pool small enough that drop and migrate act on KV pressure)
    "colocate": ["--kv-cache-memory", "64MiB"],
    "disaggregate": ["--mode", "disaggregate", "--prefill-instances", "1", "--kv-cache-memory", "64MiB"],
    "split": ["--mode", "split", "--kv-cache-memory", "64MiB"],
    "drop": ["--kv-pressure", "drop", "--kv-cache-memory", "12MiB"],
    "migrate": ["--kv-pressure", "migrate", "--kv-cache-memory", "12MiB"],
}
BACKENDS = {"process": [], "ray": ["--backend", "ray"]}


def soak_one(mode: str, backend: str, args: argparse.Namespace) -> dict:
    flags = [*COMMON, *MODES[mode], *BACKENDS[backend]]
    t0 = time.monotonic()
    proc, url, log = serve(flags, ["--dtype", "float32"])
    start_s = time.monotonic() - t0
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "tidal.cli", "bench", "soak", "--base-url", url, "--chaos",
           "--chaos-interval", str(args.chaos_interval), "--duration", str(args.duration), "--multiple",
           str(args.multiple), "--max-tokens", str(args.max_tokens), "--seed", str(args.seed),
           "--progress-interval", "15", "--output", out]
    try:
        print(f"== {mode} on {backend} (server up in {start_s:.0f} s): {' '.join(cmd[3:])}", flush=True)
        code = subprocess.run(cmd, stdout=subprocess.PIPE, text=True).returncode
        with open(out) as f:
            r = json.load(f)
        print(_summary(mode, backend, r), flush=True)
        tree = descendants(proc.pid)
    finally:
        stop(proc)
        os.unlink(out)
    with open(log) as f:
        server_log = f.read()
    os.unlink(log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_state(p) not in (None, "Z") for p in tree):
        time.sleep(0.5)
    r.pop("health", None)  # the samples; their statuses are kept
    r.pop("machine", None)
    return {"mode": mode, "backend": backend, "server_flags": flags, "server_start_s": round(start_s, 1),
            "soak_exit_code": code, "server_exit_code": proc.returncode,
            "server_tracebacks": server_log.count("Traceback"),
            "left_after_stop": sorted(p for p in tree if process_state(p) not in (None, "Z")), "soak": r}


def _summary(mode: str, backend: str, r: dict) -> str:
    ch = r["chaos"]
    return (f"   {mode}/{backend}: {ch['kills']} kills, sent {r['sent']}, completed {r['completed']}, refused-503 "
            f"{r['refused_503']}, lost {r['lost_streams']}, other errors {r['other_errors']}, KV left "
            f"{r['leaked_kv_blocks']}, processes left {ch['processes_left']}, {'CLEAN' if r['clean'] else 'NOT CLEAN'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of chaos per mode and backend")
    p.add_argument("--chaos-interval", type=float, default=10.0)
    p.add_argument("--multiple", type=float, default=1.5, help="arrival rate = multiple x measured capacity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--output", default="results/chaos_soak.json")
    args = p.parse_args()
    runs = [soak_one(m, b, args) for b in args.backends.split(",") for m in args.modes.split(",")]
    clean = all(r["soak"]["clean"] and not r["left_after_stop"] and r["server_exit_code"] == 0
                and not r["server_tracebacks"] for r in runs)
    result = {
        "benchmark": "tidal bench soak --chaos", "title": f"chaos soak: every mode, processes and Ray actors, "
        f"{args.duration:g} s each ({args.duration * len(runs) / 60:g} min of kills in all)",
        "command": "python benchmarks/chaos_soak.py " + " ".join(sys.argv[1:]), "machine": machine_info(),
        **run_stamp(), "config": vars(args), "runs": runs, "clean": clean,
        "notes": "Each row is one two-instance `tidal serve` of the default model (float32, one thread per "
                 "instance, 8 sequences and 16 queued requests at most), started, soaked and stopped by its pid. "
                 "A refusal counts only as a 503 (or 429) with Retry-After and an OpenAI error body; a stream "
                 "accepted and then broken is lost; KV blocks left is counted once the server is idle again; "
                 "processes left are killed workers still there, and any process of the server after it stopped.",
    }
    write_json(result, args.output)
    print(f"wrote {args.output}: {'CLEAN' if clean else 'NOT CLEAN'}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
