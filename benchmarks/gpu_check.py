"""The GPU check a developer runs when a device is lent (issue 41): one script, one log, one JSON.

    python benchmarks/gpu_check.py --out DIR [--tokenizer DIR] [--stages models,parity,steps,offline,serve]

Stages, each in its own process under a time limit (a hang or a crash costs that stage only):
- ``models``: random-weight Llama checkpoints of the Llama-3.2-1B and Llama-3-8B shapes (vocabulary 49,152,
  bf16, the default model's tokenizer beside them), built on the GPU (nothing can be downloaded there);
- ``parity``: float32 greedy tokens of tidal (CUDA graphs + Triton attention, and ``--enforce-eager``)
  against a plain transformers greedy loop, 8 prompts x 32 tokens, 1B shape;
- ``steps``: 8B bf16 decode step times at batch 1 and 32, CUDA graphs against eager, beside
  ``AnalyticCostModel``'s prediction for this GPU (the ratio the issue asks for);
- ``offline``: ``tidal bench offline --device cuda`` (tidal, transformers generate, generate_batch), 8B;
- ``serve``: ``tidal serve`` on CUDA (one instance, ``--instances 2``, 1P1D, split) answering the same
  greedy requests as one instance, 1B shape.

``--device cpu --tiny`` runs every stage on a 2-layer model on the CPU: how the script is tested before a
GPU is lent. Every figure goes to ``DIR/gpu_check.json`` (one object per stage) and the log to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SHAPES = {  # name -> (hidden, layers, heads, kv heads, intermediate, tied head)
    "1b": (2048, 16, 32, 8, 8192, True),
    "8b": (4096, 32, 32, 8, 14336, False),
    "tiny": (256, 2, 4, 2, 512, True),
}
VOCAB = 49152


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ============================================================================ stages
def stage_models(args) -> dict:
    import torch
    import transformers

    out = {}
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    for name in args.shapes:
        path = os.path.join(args.models, name)
        if os.path.exists(os.path.join(path, "config.json")):
            out[name] = "exists"
            continue
        h, layers, heads, kvh, inter, tied = SHAPES[name]
        cfg = transformers.LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                                       num_key_value_heads=kvh, intermediate_size=inter, vocab_size=VOCAB,
                                       tie_word_embeddings=tied, max_position_embeddings=4096,
                                       rope_theta=500000.0, torch_dtype="bfloat16")
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(dev):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        del model
        _save_tokenizer(args, path)
        out[name] = {"params": None, "seconds": round(time.perf_counter() - t0, 1)}
        log(f"models: {name} built in {out[name]['seconds']} s")
    return out


def _save_tokenizer(args, path: str) -> None:
    import shutil

    if args.tokenizer:
        for f in os.listdir(args.tokenizer):
            shutil.copy(os.path.join(args.tokenizer, f), path)
        return
    from tidal.engine.loader import load_checkpoint
    from tidal.engine.tokenizer import Tokenizer

    Tokenizer.from_checkpoint(load_checkpoint(None)).hf.save_pretrained(path)


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def stage_parity(args) -> dict:
    import torch
    import transformers

    from tidal import LLM, SamplingParams

    name = args.parity_shape
    path = os.path.join(args.models, name)
    prompts = _prompts(8, 8, 300, seed=1)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(args.device).eval()
    ref = []
    with torch.inference_mode():
        for p in prompts:  # one prompt at a time: no padding in the reference
            ids = torch.tensor([p], device=args.device)
            o = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=args.parity_tokens, min_new_tokens=args.parity_tokens)
            ref.append(o[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out = {}
    for label, kw in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = LLM(model=path, dtype="float32", device=args.device, kv_cache_memory="2GiB", max_num_seqs=8,
                  max_num_batched_tokens=256, **kw)
        backend = llm.engine.model.attention_backend
        got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=args.parity_tokens, ignore_eos=True),
                           use_tqdm=False)
        toks = [list(g.outputs[0].token_ids) for g in got]
        same = sum(a == b for a, b in zip(toks, ref, strict=True))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
                      for a, b in zip(toks, ref, strict=True)]
        graphs = llm.engine.runner.graphs
        out[label] = {"equal": same, "of": len(prompts), "first_divergence": first_diff, "attention": backend,
                      "graph_replays": graphs.replays if graphs else 0}
        log(f"parity {label}: {same}/{len(prompts)} equal to transformers ({backend}, "
            f"{out[label]['graph_replays']} graph replays)")
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def stage_steps(args) -> dict:
    import torch

    from tidal import SamplingParams
    from tidal.config import EngineConfig
    from tidal.engine.llm_engine import LLMEngine
    from tidal.sim.analytic import AnalyticCostModel
    from tidal.sim.hardware import get_hardware

    path = os.path.join(args.models, args.step_shape)
    hw_name = _hardware_name(args)
    out: dict = {"hardware_model": hw_name, "shape": args.step_shape}
    for label, kw in (("eager", {"enforce_eager": True}), ("graphs", {})):
        e = LLMEngine(EngineConfig.from_kwargs(model=path, dtype="bfloat16", device=args.device,
                                               kv_cache_memory="8GiB", max_num_seqs=64,
                                               max_num_batched_tokens=4096, **kw))
        model = AnalyticCostModel(e.arch, get_hardware(hw_name), dtype_bytes=2) if hw_name else None
        res = {"attention": e.model.attention_backend}
        for batch in (1, 32):
            for i, p in enumerate(_prompts(batch, 128, 128, seed=batch)):
                e.add_request(f"{label}-{batch}-{i}", None,
                              SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), prompt_token_ids=p)
            times, walls, ratios = [], [], []
            steps = 0
            while e.has_unfinished_requests():
                t0 = time.perf_counter()
                e.step()
                wall = time.perf_counter() - t0
                comp = e.last_result.composition
                steps += 1
                if comp.num_prefill_tokens or comp.num_decode_seqs != batch or steps < 8:
                    continue  # decodes of the whole batch only, after a few warm steps
                times.append(e.last_result.step_time_s)
                walls.append(wall)
                if model is not None:
                    ratios.append(e.last_result.step_time_s / model.decode_step_time_at(list(comp.context_lens), 0))
            res[f"batch{batch}"] = {
                "step_ms_median": round(1e3 * statistics.median(times), 3),
                "engine_step_ms_median": round(1e3 * statistics.median(walls), 3),
                "steps": len(times),
                "vs_analytic": round(statistics.median(ratios), 3) if ratios else None}
            log(f"steps {label} batch {batch}: {res[f'batch{batch}']}")
        if e.runner.graphs is not None:
            res["graph_pool_mib"] = round(e.runner.graphs.pool_bytes / 2**20, 1)
        out[label] = res
        del e
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def _hardware_name(args) -> str | None:
    import torch

    if not args.device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return "h200" if "H200" in name else "h100-80g" if "H100" in name else None


def stage_offline(args) -> dict:
    path = os.path.join(args.models, args.offline_shape)
    dst = os.path.join(args.out, "offline.json")
    cmd = [sys.executable, "-m", "tidal.cli", "bench", "offline", "--model", path, "--device", args.device,
           "--dtype", "bfloat16" if args.device.startswith("cuda") else "float32",
           "--systems", args.offline_systems, "--workloads", args.offline_workloads, "--repeats", "1",
           "--no-peak", "--no-prefill-runs", "--no-plots", "--no-progress", "--output", dst]
    log("offline:", " ".join(cmd))
    subprocess.run(cmd, check=True, timeout=args.stage_timeout - 10)
    with open(dst) as f:
        data = json.load(f)
    return {"command": " ".join(cmd), "summary": _offline_summary(data)}


def _offline_summary(data: dict) -> dict:
    out = {}
    for w, rep in (data.get("workloads") or {}).items():
        out[w] = {"output_tok_s": {s: r.get("output_tok_s") for s, r in rep.get("results", {}).items()},
                  "status": {s: r.get("status") for s, r in rep.get("results", {}).items()},
                  "ratios": rep.get("ratios", {}).get("output_tok_s")}
    return out


def stage_serve(args) -> dict:
    import httpx

    path = os.path.join(args.models, args.serve_shape)
    prompts = _prompts(6, 8, 120, seed=3)
    modes = {"one": [], "split": ["--instances", "2", "--mode", "split"],
             "disaggregate": ["--instances", "2", "--mode", "disaggregate", "--prefill-instances", "1"],
             "instances2": ["--instances", "2"]}
    out, ref = {}, None
    for i, (mode, extra) in enumerate(modes.items()):
        port = 18500 + i
        cmd = [sys.executable, "-m", "tidal.cli", "serve", "--model", path, "--device", args.device,
               "--port", str(port), "--kv-cache-memory", "2GiB", *extra]
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            t0 = time.perf_counter()
            url = f"http://127.0.0.1:{port}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve {mode} exited: {proc.stderr.read().decode()[-800:]}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > 240:
                    raise RuntimeError(f"serve {mode} did not answer /health in 240 s")
                time.sleep(1)
            started = time.perf_counter() - t0
            got = []
            with httpx.Client(timeout=120) as c:
                model = c.get(url + "/v1/models").json()["data"][0]["id"]
                for p in prompts:
                    r = c.post(url + "/v1/completions", json={"model": model, "prompt": p, "max_tokens": 16,
                                                              "temperature": 0})
                    r.raise_for_status()
                    got.append(r.json()["choices"][0]["text"])
            ref = got if ref is None else ref
            out[mode] = {"start_s": round(started, 1), "equal_to_one_instance": sum(a == b for a, b in
                                                                                   zip(got, ref, strict=True)),
                         "of": len(prompts)}
            log(f"serve {mode}: {out[mode]}")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out


def stage_profile(args) -> dict:
    """``tidal profile`` on the GPU (the quick grid): the fit's R^2 of its step times."""
    path = os.path.join(args.models, args.step_shape)
    dst = os.path.join(args.out, "profile.json")
    cmd = [sys.executable, "-m", "tidal.cli", "profile", "--model", path, "--device", args.device, "--quick",
           "--no-live", "--repeats", "5", "--kv-cache-memory", "8GiB", "--no-progress", "--output", dst,
           "--dtype", "bfloat16" if args.device.startswith("cuda") else "float32"]
    log("profile:", " ".join(cmd))
    run = subprocess.run(cmd, check=True, timeout=args.stage_timeout - 10, capture_output=True, text=True)
    lines = [ln for ln in run.stdout.splitlines() if "R2" in ln or "fit" in ln]
    log("profile:", *lines)
    return {"command": " ".join(cmd), "fit_lines": lines}


STAGES = {"models": stage_models, "parity": stage_parity, "steps": stage_steps, "offline": stage_offline,
          "serve": stage_serve, "profile": stage_profile}


# ============================================================================ driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=None, help="where the checkpoints are built (default OUT/../models)")
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer directory to copy beside each model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="every stage on a 2-layer model (a CPU dry run)")
    ap.add_argument("--stages", default="models,parity,steps,offline,serve")
    ap.add_argument("--stage-timeout", type=int, default=240)
    ap.add_argument("--stage-timeouts", default="", help="per stage, e.g. models=150,offline=200")
    ap.add_argument("--deadline", type=int, default=0,
                    help="seconds for the whole check: no stage starts past it, each gets what is left")
    ap.add_argument("--offline-systems", default="tidal,hf,hf-cb")
    ap.add_argument("--offline-workloads", default="c,b,a")
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # run one stage in this process
    args = ap.parse_args()
    args.models = args.models or os.path.join(os.path.dirname(os.path.abspath(args.out)), "models")
    big = "tiny" if args.tiny else "8b"
    small = "tiny" if args.tiny else "1b"
    args.shapes = sorted({big, small})
    args.parity_shape, args.step_shape, args.offline_shape, args.serve_shape = small, big, big, small
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.models, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    if args.stage:
        result = STAGES[args.stage](args)
        with open(os.path.join(args.models, f"stage-{args.stage}.json"), "w") as f:
            json.dump(result, f, indent=1)
        return 0
    report = {"argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch

        report["torch"] = torch.__version__
        report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001
        report["torch"] = f"unavailable ({e})"
    start = time.perf_counter()
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        limit = dict((k, int(v)) for k, v in (x.split("=") for x in args.stage_timeouts.split(",") if x)).get(
            stage, args.stage_timeout)
        if args.deadline:
            limit = min(limit, int(args.deadline - (t0 - start)))
            if limit < 20:
                log(f"== stage {stage}: skipped (deadline)")
                report[stage] = {"rc": "skipped (deadline)"}
                continue
        cmd = [sys.executable, os.path.abspath(__file__), "--stage", stage, *sys.argv[1:], "--stage-timeout",
               str(limit)]
        log(f"== stage {stage}")
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
        took = round(time.perf_counter() - t0, 1)
        entry: dict = {"rc": rc, "seconds": took}
        path = os.path.join(args.models, f"stage-{stage}.json")
        if rc == 0 and os.path.exists(path):
            with open(path) as f:
                entry["result"] = json.load(f)
        report[stage] = entry
        log(f"== stage {stage}: rc {rc} in {took} s")
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
